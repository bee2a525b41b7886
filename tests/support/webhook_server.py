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
import time
from typing import Any

from tests.support.https_receiver import HttpsReceiver, Received, ReceiverHandler, write_body


class WebhookServer(HttpsReceiver):
    def __init__(self) -> None:
        super().__init__(_Handler, prefix="webhook-")

    def received(self, path: str) -> list[Received]:
        with self._lock:
            return [r for r in self.requests if r.path == path]

    def posted(self, path: str) -> list[tuple[Received, Any]]:
        """The requests to `path` whose body is JSON, each with its body."""
        found = []
        for request in self.received(path):
            try:
                found.append((request, request.body))
            except ValueError:
                continue
        return found


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


class _Handler(ReceiverHandler):
    def do_POST(self) -> None:
        owner: WebhookServer = self.server.owner  # type: ignore[assignment]
        record = self.receive()
        raw = record.raw
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
        self.reply(status, data, "text/plain", headers, drip)
