"""A local HTTPS server that receives webhooks, for tests (a throwaway CA, like the Events API's).

    with WebhookServer() as server:                    # 127.0.0.1, random port
        url = server.url + "/services/T0/B0/secret"      # a Slack-like incoming webhook path
        server.script(503, Fault(status=429, headers={"Retry-After": "1"}))
        server.script(Fault(status=200, delay=2.0))      # answer normally, 2 s late
        server.requests[-1].body                         # every request, as received

Paths under /services/ answer as Slack's incoming webhooks do: 200 `ok` for a body with a
`text` string or a `blocks` list of typed blocks, 400 `invalid_payload` / `no_text` otherwise.
Any other path takes any JSON object with 200. Scripted responses come first, in order.
"""

from __future__ import annotations

import json
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import trustme

from tests.support.pagerduty_server import Fault, _Server, write_body

__all__ = ["Fault", "Received", "WebhookServer"]


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    raw: bytes
    status: int = 0

    @property
    def body(self) -> Any:
        return json.loads(self.raw)


class WebhookServer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._script: list[Fault] = []
        self.requests: list[Received] = []
        self.handler_errors: list[BaseException] = []
        self._dir = tempfile.TemporaryDirectory(prefix="webhook-")
        ca = trustme.CA()
        self.ca_bundle = str(Path(self._dir.name) / "ca.pem")
        ca.cert_pem.write_to_path(self.ca_bundle)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
        self._httpd = _Server(("127.0.0.1", 0), _Handler, context, self)
        self.port = self._httpd.server_address[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self._thread: threading.Thread | None = None

    def start(self) -> WebhookServer:
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

    def __enter__(self) -> WebhookServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def script(self, *responses: int | Fault) -> None:
        with self._lock:
            self._script.extend(r if isinstance(r, Fault) else Fault(status=r) for r in responses)

    def received(self, path: str) -> list[Received]:
        with self._lock:
            return [r for r in self.requests if r.path == path]

    def next_fault(self) -> Fault | None:
        with self._lock:
            return self._script.pop(0) if self._script else None


def slack_errors(raw: bytes) -> str | None:
    """What Slack's incoming webhooks answer to a body they refuse, else None."""
    try:
        body = json.loads(raw)
    except ValueError:
        return "invalid_payload"
    if not isinstance(body, dict):
        return "invalid_payload"
    blocks = body.get("blocks")
    if blocks is not None and (
        not isinstance(blocks, list)
        or not all(isinstance(b, dict) and isinstance(b.get("type"), str) for b in blocks)
    ):
        return "invalid_blocks"
    if not isinstance(body.get("text"), str) and not blocks:
        return "no_text"
    return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 10
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        owner: WebhookServer = self.server.owner  # type: ignore[assignment]
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        record = Received(self.path, dict(self.headers.items()), raw)
        with owner._lock:
            owner.requests.append(record)
        fault = owner.next_fault()
        if fault is not None and fault.delay:
            time.sleep(fault.delay)
        if fault is not None and fault.drip_headers:
            record.status = fault.status
            head = f"HTTP/1.1 {fault.status} Scripted\r\nContent-Length: 2\r\n\r\nok"
            write_body(self, head.encode(), fault.drip)
            return
        if fault is not None and not (fault.status == 200 and fault.body is None):
            record.status = fault.status
            self._reply(
                fault.status, fault.body or f"scripted {fault.status}", fault.headers, fault.drip
            )
            return
        if self.path.startswith("/services/"):
            error = slack_errors(raw)
            record.status = 400 if error else 200
            self._reply(record.status, error or "ok")
            return
        try:
            ok = isinstance(json.loads(raw), dict)
        except ValueError:
            ok = False
        record.status = 200 if ok else 400
        self._reply(record.status, "ok" if ok else "not a JSON object")

    def _reply(
        self, status: int, text: Any, headers: dict[str, str] | None = None, drip: float = 0.0
    ) -> None:
        if isinstance(text, bytes):
            data = text
        else:
            data = text.encode() if isinstance(text, str) else json.dumps(text).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        write_body(self, data, drip)
