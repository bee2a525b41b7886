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

import json
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tests.support.https_receiver import HttpsReceiver, Received, ReceiverHandler

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


@dataclass
class Incident:
    dedup_key: str
    status: str  # triggered | acknowledged | resolved
    events: list[dict[str, Any]]

    @property
    def first(self) -> dict[str, Any]:
        return self.events[0]


class EventsApiServer(HttpsReceiver):
    def __init__(self) -> None:
        super().__init__(_Handler, prefix="pd-events-")
        self.all_incidents: list[Incident] = []

    @property
    def incidents(self) -> dict[str, Incident]:
        """Open (triggered or acknowledged) incidents by dedup_key."""
        with self._lock:
            return {i.dedup_key: i for i in self.all_incidents if i.status != "resolved"}

    @property
    def enqueue_requests(self) -> list[Received]:
        return [r for r in self.requests if r.path == "/v2/enqueue"]

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


class _Handler(ReceiverHandler):
    server: Any

    def do_POST(self) -> None:
        owner: EventsApiServer = self.server.owner
        record = self.receive()
        if self.path != "/v2/enqueue":
            record.status = 404
            self._reply(404, {"status": "error", "message": "Not found"})
            return
        fault = owner.next_fault()
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
        status, body = owner.handle_event(record.raw)
        record.status = status
        self._reply(status, body)

    def do_GET(self) -> None:
        self.receive().status = 405
        self._reply(405, {"status": "error", "message": "Method not allowed"})

    def _reply(
        self, status: int, body: Any, headers: dict[str, str] | None = None, drip: float = 0.0
    ) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.reply(status, data, "application/json", headers, drip)
