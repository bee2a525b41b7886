"""What the tests' local HTTPS receivers share (the Events API in pagerduty_server.py, the
webhooks in webhook_server.py): a throwaway CA, 127.0.0.1 on a random port, a queue of scripted
faults served before normal answers, and every request kept as it was received.

A receiver subclasses `HttpsReceiver` with its handler class (a `ReceiverHandler` that answers
`do_POST`); `with Receiver() as server:` starts it and stops it, cutting open connections.
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
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

import trustme


@dataclass(frozen=True)
class Fault:
    """One scripted response. A receiver's normal status with no body: answer normally (after
    `delay`). `drop`: close the connection without answering. `drip`: send the body one byte per
    `drip` seconds (a server that never stops answering); `drip_headers`: the status line too."""

    status: int = 503
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    drop: bool = False
    drip: float = 0.0
    drip_headers: bool = False  # with `drip`: the status line and headers dripped too


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    raw: bytes
    status: int = 0  # what the server answered (0: dropped)

    @property
    def body(self) -> Any:
        return json.loads(self.raw)


class HttpsReceiver:
    """The server side; `handler` answers each request (its `server.owner` is this object)."""

    def __init__(self, handler: type[ReceiverHandler], prefix: str = "https-receiver-") -> None:
        self._lock = threading.Lock()
        self._script: list[Fault] = []
        self.requests: list[Received] = []
        self.handler_errors: list[BaseException] = []
        self._dir = tempfile.TemporaryDirectory(prefix=prefix)
        ca = trustme.CA()
        self.ca_bundle = str(Path(self._dir.name) / "ca.pem")
        ca.cert_pem.write_to_path(self.ca_bundle)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
        self._httpd = TlsServer(("127.0.0.1", 0), handler, context, self)
        self.port = self._httpd.server_address[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self._thread: threading.Thread | None = None

    def start(self) -> Self:
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

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def script(self, *responses: int | Fault) -> None:
        """Queue the next responses, in order; after them the server answers normally."""
        with self._lock:
            self._script.extend(r if isinstance(r, Fault) else Fault(status=r) for r in responses)

    @property
    def pending_script(self) -> int:
        with self._lock:
            return len(self._script)

    def next_fault(self) -> Fault | None:
        with self._lock:
            return self._script.pop(0) if self._script else None

    def record(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> Received:
        received = Received(method, path, headers, raw)
        with self._lock:
            self.requests.append(received)
        return received


class TlsServer(ThreadingHTTPServer):
    # Handler threads are joined by server_close(), after stop() has cut their connections.
    daemon_threads = False
    block_on_close = True

    def __init__(self, address, handler, context: ssl.SSLContext, owner: HttpsReceiver):
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


class ReceiverHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 10  # an idle kept-alive connection ends on its own
    server: TlsServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def receive(self) -> Received:
        """The request's body read and kept by the receiver."""
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        return self.server.owner.record(self.command, self.path, dict(self.headers.items()), raw)

    def reply(
        self,
        status: int,
        data: bytes,
        content_type: str,
        headers: dict[str, str] | None = None,
        drip: float = 0.0,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
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
