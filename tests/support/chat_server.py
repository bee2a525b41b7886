"""A local HTTP server that speaks the OpenAI chat-completions API, for tests of the judge.

    with ChatServer() as server:                        # 127.0.0.1, random port, threaded
        server.script(Reply.verdict(False, 0.9, "no refund amount"), Reply.garbage("hmm"))
        judge = OpenAICompatibleJudge(server.base_url, "judge-model")   # base_url ends in /v1
        ... await judge.judge(end) ...
        server.requests[-1].body["messages"]            # every request, as received
        server.max_in_flight                            # the most requests handled at once

`POST /v1/chat/completions` answers the standard response shape (`id`, `object`,
`created`, `model`, `choices[0].message.content`, `finish_reason`, `usage`). Scripted replies
come first, in order, one per request; then `default` (a satisfied verdict). A `Reply` sets
the message content, or a status with an OpenAI-style error body, a raw body, headers, and a
delay before answering (longer than the client's timeout: a hung model). `chunked` sends the
body with no Content-Length, in `chunk_size` pieces `trickle` seconds apart (a server that keeps
a connection busy, or one whose reply has no declared end); `padding` puts that many spaces
before the JSON (still valid JSON, only large). `Request.sent` counts the body bytes the server
got out before the client hung up. Anything else is 404.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

COMPLETIONS_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Reply:
    """One scripted response: 200 with `content` as the assistant message, unless `status` is
    not 200 (an error body) or `body` is given (sent as is)."""

    content: str | None = None
    status: int = 200
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    chunked: bool = False
    chunk_size: int = 16_384
    trickle: float = 0.0
    padding: int = 0

    @classmethod
    def verdict(cls, satisfied: bool, confidence: float, reason: str, **kw: Any) -> Reply:
        text = json.dumps({"satisfied": satisfied, "confidence": confidence, "reason": reason})
        return cls(content=text, **kw)

    @classmethod
    def garbage(cls, text: str = "I think the agent did fine overall!", **kw: Any) -> Reply:
        return cls(content=text, **kw)

    @classmethod
    def error(cls, status: int, **kw: Any) -> Reply:
        return cls(status=status, **kw)


GOOD = Reply.verdict(True, 0.92, "The answer gives the refund policy the user asked for.")


@dataclass
class Request:
    method: str
    path: str
    headers: Message  # as received; names are case-insensitive (`"authorization" in headers`)
    raw: bytes
    status: int = 0  # what the server answered (0: the client was gone)
    sent: int = 0  # body bytes written before the client hung up (or all of them)

    @property
    def body(self) -> Any:
        return json.loads(self.raw)


class ChatServer:
    def __init__(self, default: Reply = GOOD) -> None:
        self.default = default
        self.requests: list[Request] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._script: list[Reply] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as base_url: the judge POSTs to {base_url}/chat/completions."""
        return f"http://127.0.0.1:{self.port}/v1"

    def script(self, *replies: Reply) -> None:
        with self._lock:
            self._script.extend(replies)

    def __enter__(self) -> ChatServer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._closing.set()  # wakes handlers sleeping on a delay
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _next(self) -> Reply:
        with self._lock:
            return self._script.pop(0) if self._script else self.default

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                record = Request("POST", self.path, self.headers, raw)
                with server._lock:
                    server.requests.append(record)
                if self.path != COMPLETIONS_PATH:
                    self._send(record, 404, _error_body("not found", "invalid_request_error"))
                    return
                with server._lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    reply = server._next()
                    closing = bool(reply.delay) and server._closing.wait(reply.delay)
                finally:
                    # Out of flight before the answer goes out: the client may send its next
                    # request as soon as it has read this one.
                    with server._lock:
                        server.in_flight -= 1
                if not closing:
                    body = b" " * reply.padding + _response_body(reply, raw)
                    if reply.chunked:
                        self._send_chunked(record, reply, body)
                    else:
                        self._send(record, reply.status, body, reply.headers)

            def _send(
                self,
                record: Request,
                status: int,
                body: bytes,
                headers: dict[str, str] | None = None,
            ) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    for name, value in (headers or {}).items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(body)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client gave up (its timeout): nothing to answer
                record.sent = len(body)
                record.status = status

            def _send_chunked(self, record: Request, reply: Reply, body: bytes) -> None:
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.end_headers()
                    for start in range(0, len(body), reply.chunk_size):
                        if reply.trickle and server._closing.wait(reply.trickle):
                            return
                        piece = body[start : start + reply.chunk_size]
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        self.wfile.flush()
                        record.sent += len(piece)
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                    return  # the client hung up mid-body
                record.status = reply.status

        return Handler


def _response_body(reply: Reply, raw: bytes) -> bytes:
    if reply.body is not None:
        return reply.body
    if reply.status != 200:
        kind = "rate_limit_exceeded" if reply.status == 429 else "server_error"
        if 400 <= reply.status < 500 and reply.status != 429:
            kind = "invalid_request_error"
        return _error_body(f"scripted HTTP {reply.status}", kind)
    model = None
    with contextlib.suppress(ValueError, AttributeError):
        model = json.loads(raw).get("model")
    return json.dumps(
        {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model if isinstance(model, str) else "unknown",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply.content},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 120, "completion_tokens": 24, "total_tokens": 144},
        }
    ).encode()


def _error_body(message: str, kind: str) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": None}}
    ).encode()
