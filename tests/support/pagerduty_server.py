"""A local HTTPS server that speaks PagerDuty's Events API v2, for tests.

    with EventsApiServer() as server:                 # 127.0.0.1, random port, throwaway CA
        monkeypatch.setenv("SSL_CERT_FILE", server.ca_bundle)
        server.script(503, 503, 202)                  # the next responses, then normal service
        ... EventsApiV2Client(key, base_url=server.url) ...
        server.requests[-1].body                      # every request, as received
        server.incidents                              # one per dedup_key while open

`POST /v2/enqueue` validates the event the way PagerDuty does (400 "invalid event" with an
`errors` list), answers 202 with the dedup_key, and keeps incidents: a trigger for a dedup_key
with an open incident is deduplicated onto it; acknowledge and resolve change its status; a
trigger after a resolve opens a new incident. Scripted faults come first, in order: an int status
(202 means "process normally"), or a `Fault` for a body, headers, a delay or a dropped connection.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import trustme

ACTIONS = ("trigger", "acknowledge", "resolve")
SEVERITIES = ("critical", "error", "warning", "info")

FAULT_BODIES: dict[int, dict[str, Any]] = {
    429: {
        "status": "throttle event",
        "message": "Requests for this service are arriving too quickly. Please retry later.",
    },
    500: {"status": "error", "message": "Internal server error"},
    502: {"status": "error", "message": "Bad gateway"},
    503: {"status": "error", "message": "Service unavailable"},
    504: {"status": "error", "message": "Gateway timeout"},
}


@dataclass(frozen=True)
class Fault:
    """One scripted response. status 202 with no body: handle the event normally (after `delay`).
    `drop`: close the connection without answering. `drip`: send the body one byte per `drip`
    seconds (a server that never stops answering); `drip_headers`: the status line too."""

    status: int = 503
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    drop: bool = False
    drip: float = 0.0
    drip_headers: bool = False  # with `drip`: the status line and headers dripped too


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    raw: bytes
    status: int = 0  # what the server answered (0: dropped)

    @property
    def body(self) -> Any:
        return json.loads(self.raw)


@dataclass
class Incident:
    dedup_key: str
    status: str  # triggered | acknowledged | resolved
    events: list[dict[str, Any]]

    @property
    def first(self) -> dict[str, Any]:
        return self.events[0]


class EventsApiServer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._script: list[Fault] = []
        self.requests: list[Request] = []
        self.all_incidents: list[Incident] = []
        self.handler_errors: list[BaseException] = []
        self._dir = tempfile.TemporaryDirectory(prefix="pd-events-")
        self._ca = trustme.CA()
        self.ca_bundle = str(Path(self._dir.name) / "ca.pem")
        self._ca.cert_pem.write_to_path(self.ca_bundle)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
        self._httpd = _Server(("127.0.0.1", 0), _Handler, context, self)
        self.port = self._httpd.server_address[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self._thread: threading.Thread | None = None

    # -- lifecycle --

    def start(self) -> EventsApiServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.close_connections()
        self._httpd.server_close()
        self._dir.cleanup()

    def __enter__(self) -> EventsApiServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- scripting and inspection --

    def script(self, *responses: int | Fault) -> None:
        """Queue the next responses, in order; after them the server behaves normally."""
        with self._lock:
            self._script.extend(r if isinstance(r, Fault) else Fault(status=r) for r in responses)

    @property
    def pending_script(self) -> int:
        with self._lock:
            return len(self._script)

    @property
    def incidents(self) -> dict[str, Incident]:
        """Open (triggered or acknowledged) incidents by dedup_key."""
        with self._lock:
            return {i.dedup_key: i for i in self.all_incidents if i.status != "resolved"}

    @property
    def enqueue_requests(self) -> list[Request]:
        return [r for r in self.requests if r.path == "/v2/enqueue"]

    def _next_fault(self) -> Fault | None:
        with self._lock:
            return self._script.pop(0) if self._script else None

    # -- the Events API --

    def handle_event(self, raw: bytes) -> tuple[int, dict[str, Any]]:
        try:
            event = json.loads(raw)
        except ValueError:
            return 400, _invalid(["Could not parse JSON"])
        if not isinstance(event, dict):
            return 400, _invalid(["Event object is not a JSON object"])
        errors = validate_event(event)
        if errors:
            return 400, _invalid(errors)
        action = event["event_action"]
        key = event.get("dedup_key") or uuid.uuid4().hex
        with self._lock:
            open_incident = next(
                (i for i in self.all_incidents if i.dedup_key == key and i.status != "resolved"),
                None,
            )
            if action == "trigger":
                if open_incident is None:
                    self.all_incidents.append(Incident(key, "triggered", [event]))
                else:
                    open_incident.events.append(event)  # deduplicated
            elif open_incident is not None:
                open_incident.events.append(event)
                open_incident.status = "acknowledged" if action == "acknowledge" else "resolved"
        return 202, {"status": "success", "message": "Event processed", "dedup_key": key}


def validate_event(event: dict[str, Any]) -> list[str]:
    """The checks PagerDuty makes before accepting an event, with its wording."""
    errors = []
    key = event.get("routing_key")
    if not isinstance(key, str) or not key:
        errors.append("'routing_key' is missing or blank")
    elif len(key) != 32:
        errors.append("Length of 'routing_key' is incorrect (should be 32 characters)")
    action = event.get("event_action")
    if not isinstance(action, str) or not action:
        errors.append("'event_action' is missing or blank")
    elif action not in ACTIONS:
        errors.append(
            "'event_action' is invalid (must be one of: 'trigger', 'acknowledge' or 'resolve')"
        )
    dedup = event.get("dedup_key")
    if dedup is not None and (not isinstance(dedup, str) or len(dedup) > 255):
        errors.append("'dedup_key' must be a string of at most 255 characters")
    if action in ("acknowledge", "resolve") and not dedup:
        errors.append("'dedup_key' is missing or blank")
    if action == "trigger":
        payload = event.get("payload")
        if not isinstance(payload, dict):
            errors.append("'payload' is missing or not an object")
        else:
            for name in ("summary", "source", "severity"):
                value = payload.get(name)
                if not isinstance(value, str) or not value.strip():
                    errors.append(f"'payload.{name}' is missing or blank")
            severity = payload.get("severity")
            if isinstance(severity, str) and severity and severity not in SEVERITIES:
                errors.append(
                    "'payload.severity' is invalid (must be one of the following: "
                    "'critical', 'warning', 'error' or 'info')"
                )
            details = payload.get("custom_details")
            if details is not None and not isinstance(
                details, dict | list | str | int | float | bool
            ):
                errors.append("'payload.custom_details' is invalid")
        links = event.get("links")
        if links is not None and (
            not isinstance(links, list)
            or not all(
                isinstance(link, dict) and isinstance(link.get("href"), str) for link in links
            )
        ):
            errors.append("'links' must be a list of objects with an 'href'")
    return errors


def _invalid(errors: list[str]) -> dict[str, Any]:
    return {"status": "invalid event", "message": "Event object is invalid", "errors": errors}


class _Server(ThreadingHTTPServer):
    # Handler threads are joined by server_close(), after stop() has cut their connections.
    daemon_threads = False
    block_on_close = True

    def __init__(self, address, handler, context: ssl.SSLContext, owner: EventsApiServer):
        self.context = context
        self.owner = owner
        self._connections: set[ssl.SSLSocket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, handler)

    def finish_request(self, request, client_address) -> None:
        # The TLS handshake happens here, in the connection's own thread, not in the accept loop.
        request.settimeout(10)
        try:
            tls = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            self.owner.handler_errors.append(exc)  # e.g. a client that distrusts our CA
            return
        with self._connections_lock:
            self._connections.add(tls)
        try:
            super().finish_request(tls, client_address)
        finally:
            with self._connections_lock:
                self._connections.discard(tls)
            with contextlib.suppress(OSError):
                tls.shutdown(socket.SHUT_RDWR)
            tls.close()

    def close_connections(self) -> None:
        with self._connections_lock:
            for connection in self._connections:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request, client_address) -> None:
        self.owner.handler_errors.append(sys.exc_info()[1])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 10  # an idle kept-alive connection ends on its own
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        owner = self.server.owner
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        record = Request("POST", self.path, dict(self.headers.items()), raw)
        with owner._lock:
            owner.requests.append(record)
        if self.path != "/v2/enqueue":
            record.status = 404
            self._reply(404, {"status": "error", "message": "Not found"})
            return
        fault = owner._next_fault()
        if fault is not None:
            if fault.delay:
                time.sleep(fault.delay)
            if fault.drop:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if not (fault.status == 202 and fault.body is None):
                body = fault.body
                if body is None:
                    body = FAULT_BODIES.get(fault.status) or (
                        _invalid(["Scripted rejection"])
                        if fault.status == 400
                        else {"status": "error", "message": f"HTTP {fault.status}"}
                    )
                record.status = fault.status
                self._reply(fault.status, body, fault.headers, drip=fault.drip)
                return
        status, body = owner.handle_event(raw)
        record.status = status
        self._reply(status, body)

    def do_GET(self) -> None:
        owner = self.server.owner
        with owner._lock:
            owner.requests.append(Request("GET", self.path, dict(self.headers.items()), b"", 405))
        self._reply(405, {"status": "error", "message": "Method not allowed"})

    def _reply(
        self, status: int, body: Any, headers: dict[str, str] | None = None, drip: float = 0.0
    ) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        write_body(self, data, drip)


def write_body(handler: BaseHTTPRequestHandler, data: bytes, drip: float) -> None:
    """The body at once, or (`drip`) a byte at a time until the client hangs up."""
    if not drip:
        handler.wfile.write(data)
        return
    handler.close_connection = True
    try:
        for index in range(len(data)):
            handler.wfile.write(data[index : index + 1])
            handler.wfile.flush()
            time.sleep(drip)
    except OSError:
        pass  # the client gave up: what a drip test wants
