"""/livez and /readyz over real HTTP: red while the span agent is crashed, green once it moves."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry

from spanguard.streams.health import Health, serve_http


def status(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_crashed_span_agent_turns_readiness_then_liveness_red() -> None:
    now = [100.0]
    health = Health(dead_after=60.0, clock=lambda: now[0])

    async def scenario() -> list[tuple[str, int]]:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        runner = await serve_http(health, CollectorRegistry(), "127.0.0.1", port)
        seen = []

        async def probe(label: str, path: str) -> None:
            code, body = await asyncio.to_thread(status, port, path)
            seen.append((label, code))
            if label == "crashed-ready":
                assert "AssertionError" in body["last_error"]

        try:
            await probe("fresh-ready", "/readyz")
            health.crashed(AssertionError("store write outside an event"))
            await probe("crashed-ready", "/readyz")
            await probe("crashed-live", "/livez")
            now[0] += 61
            await probe("stuck-live", "/livez")
            health.progressed()
            await probe("recovered-ready", "/readyz")
            await probe("recovered-live", "/livez")
        finally:
            await runner.cleanup()
        return seen

    assert asyncio.run(scenario()) == [
        ("fresh-ready", 200),
        ("crashed-ready", 503),
        ("crashed-live", 200),
        ("stuck-live", 503),
        ("recovered-ready", 200),
        ("recovered-live", 200),
    ]


def test_a_crash_loop_counts_from_its_first_crash() -> None:
    now = [0.0]
    health = Health(dead_after=60.0, clock=lambda: now[0])
    health.crashed(AssertionError("first"))
    now[0] = 50.0
    health.crashed(AssertionError("again, after a restart"))
    now[0] = 61.0
    assert not health.live
    assert health.crashes == 2


def test_records_waiting_without_progress_turn_liveness_red() -> None:
    now = [0.0]
    health = Health(dead_after=60.0, clock=lambda: now[0])
    health.observe_pending(0)
    now[0] = 100.0
    assert health.live  # idle and caught up is not stuck
    health.observe_pending(5)
    now[0] = 159.0
    health.observe_pending(9)
    assert health.live
    now[0] = 160.0
    assert not health.live and health.ready
    health.progressed()
    assert health.live
    health.observe_pending(3)  # still behind, but it moves: the clock starts again
    now[0] = 219.0
    assert health.live
