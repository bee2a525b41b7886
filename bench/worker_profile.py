"""Where a `spanguard worker` process spends its CPU: py-spy samples, summed by part.

`bench/bench_pipeline.py --profile DIR` samples the first worker with py-spy over its drains
(the synthetic producer's, the Collector's) and prints this summary of each; `python -m bench.worker_profile FILE` prints it
again from the raw samples kept in DIR. Only the thread holding the GIL is sampled, so the
shares are of the process's Python work (C code that lets the GIL go, RocksDB's writes and
the sockets' reads, is not counted). py-spy comes with the dev extra (`make install`); another
one is named by `PY_SPY`. Sampling stops the process for each sample, so the
profiled drain is slower than an unprofiled one; the shares are what is read from it.

Each sample is put in the first part, in the order of PARTS, that one of its frames belongs to:
the most specific parts come first (the detection core inside the pipeline inside the batch).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PARTS", "STAGES", "Profiler", "summarize"]


def _in(path: str, *functions: str) -> Callable[[str, str], bool]:
    """A frame of one of `functions` (any if none) in a file whose path ends with `path`."""

    def match(function: str, filename: str) -> bool:
        # py-spy names methods Class.method
        name = function.rsplit(".", 1)[-1]
        return filename.endswith(path) and (not functions or name in functions)

    return match


def _under(fragment: str) -> Callable[[str, str], bool]:
    """A frame of any file whose path holds `fragment`."""
    return lambda function, filename: fragment in filename


# (part, frame tests): a sample belongs to the first part one of whose tests a frame passes.
PARTS: list[tuple[str, list[Callable[[str, str], bool]]]] = [
    (
        "metrics scrapes (/metrics)",
        [_in("streams/health.py", "metrics"), _under("prometheus_client/")],
    ),
    ("detection core (guard, rules)", [_in("detection/guard.py", "process_view", "process")]),
    (
        "conversation / agent-window records",
        [_under("streams/conversations.py"), _under("streams/agent_windows.py")],
    ),
    (
        "split by trace (Collector batches)",
        [_in("detection/pipeline.py", "_split"), _in("schemas/otlp.py")],
    ),
    (
        "pipeline, outside the core: parse, checks, trace ids (every record)",
        [_in("detection/pipeline.py", "handle")],
    ),
    ("repartition packing", [_in("streams/delivery.py", "repartition_sends", "_pack")]),
    ("kill signals and detections (sign, JSON)", [_in("streams/delivery.py", "sends_for")]),
    ("sends: producer calls, ack awaits", [_in("streams/delivery.py", "send_all")]),
    (
        "state flush: encode, table write, changelog send",
        [_in("streams/decoded_states.py", "flush"), _in("streams/write_back.py", "flush")],
    ),
    ("eviction", [_in("streams/decoded_states.py", "evict_idle")]),
    (
        "Faust tables (changelog, store)",
        [_under("faust/tables/"), _under("faust/stores/"), _under("rocksdict")],
    ),
    (
        "Faust stream and agent (per record)",
        [
            _under("faust/streams.py"),
            _under("faust/agents/"),
            _under("faust/transport/consumer.py"),
            _under("faust/transport/conductor.py"),
            _under("faust/events.py"),
        ],
    ),
    (
        "aiokafka producer",
        [
            _under("aiokafka/producer/"),
            _under("faust/transport/producer.py"),
            _under("faust/transport/drivers/aiokafka.py"),
        ],
    ),
    (
        "aiokafka consumer: fetch, decode",
        [_under("aiokafka/consumer/"), _under("aiokafka/record/")],
    ),
    ("aiokafka client: network, protocol", [_under("aiokafka/")]),
    ("asyncio event loop, other", [_under("asyncio/")]),
]


# The same samples by the stage of a span's way through the worker, each in the first stage one
# of its frames belongs to: state (reads inside the rules too) before rules, and the split of a
# Collector batch is its decode.
STAGES: list[tuple[str, list[Callable[[str, str], bool]]]] = [
    (
        "state",
        [
            _under("streams/decoded_states.py"),
            _under("streams/state_table.py"),
            _in("streams/write_back.py", "flush_states"),
            _under("faust/tables/"),
            _under("faust/stores/"),
            _under("rocksdict"),
        ],
    ),
    ("rules", [_in("detection/guard.py", "process_view", "process")]),
    ("decode", [_in("detection/pipeline.py", "handle"), _under("schemas/otlp")]),
    (
        "produce",
        [
            _under("streams/delivery.py"),
            _under("aiokafka/producer/"),
            _under("faust/transport/producer.py"),
            _under("streams/conversations.py"),
            _under("streams/agent_windows.py"),
        ],
    ),
    (
        "fetch",
        [
            _under("aiokafka/consumer/"),
            _under("aiokafka/record/"),
            _under("faust/streams.py"),
            _under("faust/agents/"),
            _under("faust/transport/consumer.py"),
            _under("faust/transport/conductor.py"),
            _under("faust/events.py"),
        ],
    ),
]
STAGE_NAMES = [name for name, _ in STAGES] + ["other"]


# Leaf frames of a thread waiting, not working: the event loop's select, a thread's wait, the
# release reader's poll of the kill topic (its own thread, in librdkafka).
IDLE: list[Callable[[str, str], bool]] = [
    _in("selectors.py", "select"),
    _in("threading.py", "wait"),
    _in("connectors/releases.py", "_consume"),
]


@dataclass
class Summary:
    samples: int  # busy samples: the shares are of these
    idle: int  # samples of threads waiting (IDLE), left out
    shares: list[tuple[str, float]]  # (part, share of busy samples), largest first
    top_frames: list[tuple[str, float]]  # busy leaf frames, share of busy samples
    # (stage, share of busy samples) in STAGE_NAMES' order; other: the event loop, the Kafka
    # client's I/O both ways, metrics scrapes, logging.
    stages: list[tuple[str, float]] = field(default_factory=list)

    def text(self) -> str:
        lines = [
            f"worker profile: {self.samples:,} busy samples (py-spy; {self.idle:,} more of"
            " threads waiting), by part:"
        ]
        lines += [f"  {share:6.1%}  {part}" for part, share in self.shares]
        lines.append("  busiest leaf frames:")
        lines += [f"  {share:6.1%}  {frame}" for frame, share in self.top_frames]
        return "\n".join(lines)


def _frame(text: str) -> tuple[str, str]:
    """`function (file:line)` -> (function, file)."""
    function, _, rest = text.partition(" (")
    return function, rest.rsplit(":", 1)[0]


def summarize(raw: Path, top: int = 12) -> Summary:
    """py-spy's raw output (one `frame;frame;... count` line per stack) summed by part."""
    parts: Counter[str] = Counter()
    stages: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    total = idle = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame(text) for text in stack.split(";") if " (" in text]
        if frames and any(test(*frames[-1]) for test in IDLE):
            idle += count
            continue
        total += count
        part = _first(PARTS, frames)
        parts[part] += count
        stages[_first(STAGES, frames)] += count
        if frames:
            function, filename = frames[-1]
            leaves[f"{function} ({_short(filename)})"] += count
    total = max(total, 1)
    return Summary(
        samples=total,
        idle=idle,
        shares=[(part, n / total) for part, n in parts.most_common()],
        top_frames=[(frame, n / total) for frame, n in leaves.most_common(top)],
        stages=[(name, stages[name] / total) for name in STAGE_NAMES],
    )


def _first(
    kinds: list[tuple[str, list[Callable[[str, str], bool]]]], frames: list[tuple[str, str]]
) -> str:
    """The first kind one of whose tests a frame passes, "other" if none."""
    return next(
        (
            name
            for name, tests in kinds
            if any(test(function, filename) for function, filename in frames for test in tests)
        ),
        "other",
    )


def _short(filename: str) -> str:
    for marker in ("site-packages/", "/lib/python3"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return "/".join(Path(filename).parts[-2:])


def find_py_spy() -> str | None:
    """py-spy named by PY_SPY, else beside this Python (the dev extra installs it), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return os.environ.get("PY_SPY") or (str(beside) if beside.exists() else shutil.which("py-spy"))


def py_spy() -> str:
    found = find_py_spy()
    if not found:
        raise RuntimeError("--profile needs py-spy: `make install` (the dev extra), or PY_SPY")
    return found


class Profiler:
    """py-spy record of one process into DIR, from start() to stop()."""

    def __init__(self, directory: Path, name: str = "worker-drain.txt", rate: int = 100) -> None:
        self.directory = directory
        self.rate = rate
        self.executable = py_spy()
        directory.mkdir(parents=True, exist_ok=True)
        self.raw = directory / name

    def start(self, pid: int) -> subprocess.Popen:
        command = [self.executable, "record", "--pid", str(pid), "--format", "raw"]
        command += ["--rate", str(self.rate), "--full-filenames", "--output", str(self.raw)]
        # Only the thread holding the GIL: what the process computes in Python, not the
        # consumer thread waiting for it (Faust reads Kafka in a thread of its own).
        command.append("--gil")
        with open(self.directory / "py-spy.log", "wb") as log:  # the child keeps its copy
            return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)

    def stop(self, process: subprocess.Popen) -> Summary | None:
        """Stop sampling (py-spy writes its file on SIGINT); the summary, None without one."""
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if not self.raw.exists():
            log = (self.directory / "py-spy.log").read_text(errors="replace")[-1000:]
            print(f"py-spy wrote no samples:\n{log}")
            return None
        summary = summarize(self.raw)
        print(summary.text())
        return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", type=Path, help="py-spy record --format raw output")
    parser.add_argument("--top", type=int, default=12, help="leaf frames listed")
    args = parser.parse_args()
    print(summarize(args.raw, args.top).text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
