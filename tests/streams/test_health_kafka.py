"""/readyz and /livez of a real worker (default RocksDB store) whose span agent fails for real.

Each worker runs `spanguard worker` through a `python -c` wrapper that patches one function
before the command starts:
- the crash: `DecodedStates.write_some` writes the flush's states to the store outside any
  event, which is what the worker once did; Faust's RocksDB store then raises
  `assert event is not None`;
- the stall: sends to the kill topic never return (a broker connection that hangs), so the
  span agent waits for ever on its first kill without raising.

`--dead-after 8` instead of the shipped 60 s, so that liveness can turn red within a test.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.support.kafka_harness import Topics, WorkerProcess, ensure_broker, producer
from tests.support.spans import AgentRecorder, encode

pytestmark = pytest.mark.kafka

DEAD_AFTER = 8.0

RUN_CLI = """
import sys
from spanguard.cli.main import main
sys.exit(main())
"""

CRASH_ON_FLUSH = (
    """
from faust.streams import _current_event
from spanguard.streams.decoded_states import DecodedStates

def write_some(self, seconds):
    # The store write the worker once made outside any event. Its table then sent changelog
    # records to the partitioner's partition, so the store's own check was the first to fail;
    # it is reached here through the store.
    writing, self._writing = self._writing, {}
    token = _current_event.set(None)
    try:
        for trace_id, (state, _event) in writing.items():
            self.table.data[trace_id.encode()] = state.to_bytes()
    finally:
        _current_event.reset(token)
    return True

DecodedStates.write_some = write_some
"""
    + RUN_CLI
)

HANG_ON_KILL_SEND = (
    """
import asyncio, os
from faust.topics import Topic

original = Topic.send

async def send(self, *args, **kwargs):
    if self.get_topic_name() == os.environ["HANG_TOPIC"]:
        await asyncio.Event().wait()  # never acked, never failed
    return await original(self, *args, **kwargs)

Topic.send = send
"""
    + RUN_CLI
)


def patched_worker(topics: Topics, data_dir, code: str, **env: str) -> WorkerProcess:
    worker = WorkerProcess(
        topics,
        data_dir,
        extra=["--dead-after", str(DEAD_AFTER)],
        env={**env, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert worker.args[1:3] == ["-m", "spanguard.cli"]
    worker.args[1:3] = ["-c", code]
    return worker.start()


def stop_broken(worker: WorkerProcess) -> None:
    """SIGKILL: the agent broken on purpose keeps the worker from its clean stop, so SIGTERM
    would only wait out WorkerProcess.stop's timeout before the same SIGKILL."""
    worker.stop(signal.SIGKILL)


def probe(worker: WorkerProcess, path: str) -> tuple[int, dict]:
    try:
        url = f"http://127.0.0.1:{worker.port}{path}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def send_loop(topic: str, agent: AgentRecorder, calls: int) -> None:
    out = producer()
    for _ in range(calls):
        span = agent.tool("search_docs", {"query": "refund policy"})
        out.produce(topic, key=agent.trace_id.encode(), value=encode([span]).SerializeToString())
    assert out.flush(20) == 0


def wait_for_status(worker: WorkerProcess, path: str, code: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe(worker, path)[0] == code:
            return time.monotonic()
        time.sleep(0.2)
    raise TimeoutError(f"{path} never {code}: {probe(worker, path)}\n{worker.log_tail()}")


def test_the_rocksdb_crash_turns_readiness_red_and_liveness_after_dead_after(tmp_path):
    ensure_broker()
    topics = Topics()
    worker = patched_worker(topics, tmp_path / "w", CRASH_ON_FLUSH)
    try:
        assert probe(worker, "/readyz")[0] == 200
        send_loop(topics.input, AgentRecorder(), 1)
        crashed = wait_for_status(worker, "/readyz", 503, 30)
        body = probe(worker, "/readyz")[1]
        assert "AssertionError" in body["last_error"], body
        assert "assert event is not None" in worker.log_text()
        # Faust restarts the agent, which crashes again on the next message: the same outage.
        time.sleep(DEAD_AFTER / 2)
        send_loop(topics.input, AgentRecorder(), 1)
        deadline = time.monotonic() + 20
        while probe(worker, "/readyz")[1]["crashes"] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert probe(worker, "/readyz")[1]["crashes"] >= 2
        dead = wait_for_status(worker, "/livez", 503, DEAD_AFTER + 15)
        # Live until dead_after from the first crash, not from the latest one.
        assert DEAD_AFTER - 1 <= dead - crashed <= DEAD_AFTER + 3, dead - crashed
    finally:
        stop_broken(worker)
        topics.delete()


def test_a_crashed_worker_stops_on_sigterm_and_commits_nothing_past_the_crash(tmp_path):
    """The crash leaves the batch's messages unacked for good. Faust waits for every message it
    handed out before a stop goes on (SIGTERM waited for the orchestrator's SIGKILL), and acks
    some later ones itself (a batch refused, a stream stopping), whose commit would pass the
    crashed ones. Nothing is committed past them: the next worker decides all 3 calls."""
    ensure_broker()
    topics = Topics()
    worker = patched_worker(topics, tmp_path / "w", CRASH_ON_FLUSH)
    restarted = None
    try:
        send_loop(topics.input, AgentRecorder(), 3)  # the 3rd trips; its flush crashes
        wait_for_status(worker, "/readyz", 503, 30)
        worker.stop(signal.SIGTERM, timeout=25)
        log = worker.log_text()
        assert "messages left unacked by the failure" in log
        assert "wait_empty: Waiting for tasks" not in log, worker.log_tail()
        assert "[^Worker]: Closing event loop" in log, worker.log_tail()
        restarted = WorkerProcess(topics, tmp_path / "w2").start()
        restarted.wait_for("spanguard_tool_calls_observed_total", 3)
    finally:
        stop_broken(worker)
        if restarted is not None:
            restarted.stop()
        topics.delete()


def test_a_span_agent_stuck_with_records_waiting_turns_liveness_red(tmp_path):
    ensure_broker()
    topics = Topics()
    worker = patched_worker(topics, tmp_path / "w", HANG_ON_KILL_SEND, HANG_TOPIC=topics.kills)
    try:
        # Idle with nothing waiting is not stuck: still live well past dead_after.
        send_loop(topics.input, AgentRecorder(), 1)
        worker.wait_for("spanguard_tool_calls_observed_total", 1)
        time.sleep(DEAD_AFTER + 2)
        assert probe(worker, "/livez")[0] == 200
        send_loop(topics.input, AgentRecorder(), 6)  # trips at the 3rd call: its kill hangs
        stuck = time.monotonic()
        wait_for_status(worker, "/livez", 503, DEAD_AFTER + 15)
        assert time.monotonic() - stuck >= DEAD_AFTER - 1
        body = probe(worker, "/livez")[1]
        assert body["stalled"] and body["pending"] > 0, body
        assert probe(worker, "/readyz")[0] == 200  # nothing crashed
    finally:
        stop_broken(worker)
        topics.delete()
