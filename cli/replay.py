"""`spanguard replay`: the detection core over files, in the order a stream would see the spans.

A broken input costs only itself: a line (or a .pb file) that is not an OTLP trace request, or
that the core cannot decide on, is reported on stderr with its file and line number and
skipped, and the result counts it, so the command's exit code can say that something was
skipped (1) rather than read in full (0)."""

from __future__ import annotations

import gzip
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO

from spanguard.cli.report import render_html
from spanguard.detection.agent_budget import AgentBudgetGuard
from spanguard.detection.conversation import ConversationGuard
from spanguard.detection.fleet import FleetGuard
from spanguard.detection.guard import Guard
from spanguard.detection.timelines import Timelines
from spanguard.errors import OtlpDecodeError, ReplayInputError
from spanguard.progress import ProgressLine
from spanguard.schemas.otlp import ExportTraceServiceRequest, decode_json_line, decode_protobuf
from spanguard.schemas.policy import Policy

__all__ = ["MAX_LINE_BYTES", "ReplayResult", "replay"]

PROTOBUF_SUFFIXES = (".pb", ".binpb")
GZIP_SUFFIX = ".gz"
# One OTLP/JSON line (one export request) larger than this is skipped unread, not held in
# memory: the Collector's file exporter writes batches of a few MB.
MAX_LINE_BYTES = 64 * 1024 * 1024


@dataclass
class ReplayResult:
    """What a replay read: the guard (its stats and state), and how many inputs it skipped."""

    guard: Guard
    requests: int = 0
    skipped: int = 0  # broken lines and .pb files, each reported on stderr
    # Every decision printed, by (rule, action): the trace's and its scopes' (conversation,
    # agent, tool), which the guard's own counts leave out.
    decided: Counter[tuple[str, str]] = field(default_factory=Counter)


@dataclass
class _Input:
    """One request read, or one input skipped with the reason; `where` names it (file:line)."""

    where: str
    nbytes: int
    request: ExportTraceServiceRequest | None = None
    error: str | None = None


class _Progress(ProgressLine):
    """A one-line progress bar on stderr, shown only when stderr is a terminal."""

    def __init__(self, stream: TextIO, total_bytes: int, enabled: bool, guard: Guard) -> None:
        super().__init__(stream, enabled, every=0.2)
        self.total_bytes = total_bytes
        self.guard = guard
        self.done_bytes = 0

    def advance(self, nbytes: int) -> None:
        self.done_bytes += nbytes
        if not self.due():
            return
        share = self.done_bytes / self.total_bytes if self.total_bytes else 0.0
        filled = int(share * 30)
        stats = self.guard.stats
        self.draw(
            f"[{'#' * filled}{'.' * (30 - filled)}] {share:4.0%}"
            f"  {stats.spans:,} spans  {sum(stats.decisions.values())} decisions"
        )


def _read_inputs(paths: list[str], stdin: IO[bytes]) -> Iterator[_Input]:
    """Every request of every input, in file order; a broken one comes with its error."""
    for path in paths:
        gzipped = path != "-" and path.endswith(GZIP_SUFFIX)
        bare = path[: -len(GZIP_SUFFIX)] if gzipped else path
        if path != "-" and bare.endswith(PROTOBUF_SUFFIXES):
            try:
                # Bounded, compressed or not: 1.5 MB of .pb.gz can expand to gigabytes.
                with gzip.open(path, "rb") if gzipped else open(path, "rb") as whole:
                    data = whole.read(MAX_LINE_BYTES + 1)
            except (OSError, EOFError) as exc:
                raise ReplayInputError(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
            if len(data) > MAX_LINE_BYTES:
                yield _Input(path, len(data), error=f"larger than {MAX_LINE_BYTES} bytes")
                continue
            try:
                yield _Input(path, len(data), request=decode_protobuf(data))
            except OtlpDecodeError as exc:
                yield _Input(path, len(data), error=str(exc))
            continue
        handle: IO[bytes]
        if path == "-":
            handle = stdin
        else:
            try:
                # Closed below, after the generator.
                # (A GzipFile reads bytes like any binary file; typeshed does not call it IO.)
                handle = gzip.open(path, "rb") if gzipped else open(path, "rb")  # type: ignore[assignment]  # noqa: SIM115
            except OSError as exc:
                raise ReplayInputError(f"{path}: {exc.strerror}") from None
        try:
            yield from _read_lines(path, handle)
        except (OSError, EOFError) as exc:  # a damaged .gz file
            raise ReplayInputError(f"{path}: {exc}") from None
        finally:
            if handle is not stdin:
                handle.close()


def _read_lines(path: str, handle: IO[bytes]) -> Iterator[_Input]:
    number = 0
    while True:
        blank_lines, nbytes = _skip_blank_lines(handle)
        if blank_lines:
            number += blank_lines
            yield _Input(f"{path}:{number}", nbytes)
        line = handle.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        number += 1
        where = f"{path}:{number}"
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            skipped = len(line) + _skip_rest_of_line(handle)
            yield _Input(where, skipped, error=f"longer than {MAX_LINE_BYTES} bytes")
            continue
        if not line.strip():
            yield _Input(where, len(line))
            continue
        try:
            yield _Input(where, len(line), request=decode_json_line(line))
        except OtlpDecodeError as exc:
            yield _Input(where, len(line), error=str(exc))


def _skip_blank_lines(handle: Any) -> tuple[int, int]:
    """Skip a run of blank lines a buffer at a time (a line at a time, 300 kB of gzipped
    newlines kept a replay busy for minutes); (lines skipped, bytes skipped)."""
    lines = nbytes = 0
    if not hasattr(handle, "peek"):  # e.g. a BytesIO: its blank lines are read one by one
        return lines, nbytes
    while True:
        ahead = handle.peek(64 * 1024)
        if not ahead:
            return lines, nbytes
        rest = ahead.lstrip(b" \t\r\n")
        # Up to the last newline of the blank run; a line's leading blanks stay with it.
        cut = ahead.rfind(b"\n", 0, len(ahead) - len(rest)) + 1
        if cut == 0:
            return lines, nbytes
        lines += ahead.count(b"\n", 0, cut)
        nbytes += len(handle.read(cut))


def _skip_rest_of_line(handle: IO[bytes]) -> int:
    skipped = 0
    while True:
        chunk = handle.readline(1024 * 1024)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


def replay(
    paths: list[str],
    policy: Policy | None = None,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    stdin: IO[bytes] | None = None,
    html: str | None = None,
) -> ReplayResult:
    """Print one JSON decision per line on stdout, each skipped input and a one-line summary
    on stderr; with `html`, also write that file: a timeline per tripped trace
    (cli/report.py)."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    source = stdin or sys.stdin.buffer
    total = sum(os.path.getsize(p) for p in paths if p != "-" and os.path.isfile(p))
    # The page shows each trace's tokens and cost: price usage for it, budget or not.
    guard = _replay_guard(policy or Policy(), price_usage=bool(html))
    timelines = Timelines() if html else None
    if timelines is not None:
        guard.add_observer(timelines)
    progress = _Progress(err, total, enabled=err.isatty() and total > 1_000_000, guard=guard)
    result = ReplayResult(guard)
    started = time.monotonic()
    try:
        for item in _read_inputs(paths, source):
            progress.advance(item.nbytes)
            if item.request is not None:
                try:
                    decisions = guard.process(item.request)
                # A bug must cost one request, never the replay.
                except Exception as exc:  # noqa: BLE001
                    item.error = f"detection failed: {type(exc).__name__}: {exc}"
                else:
                    result.requests += 1
                    for decision in decisions:
                        out.write(decision.to_json() + "\n")
                        result.decided[(decision.rule, decision.action)] += 1
            if item.error is not None:
                result.skipped += 1
                progress.clear()
                err.write(f"{item.where}: skipped: {_one_line(item.error)}\n")
    finally:
        progress.close()
        out.flush()
    err.write(_summary(result, time.monotonic() - started))
    stats = guard.stats
    if html and timelines is not None:
        try:
            Path(html).write_text(
                render_html(timelines, stats, paths, guard.states), encoding="utf-8"
            )
        except OSError as exc:
            raise ReplayInputError(f"{html}: cannot write the page: {exc.strerror}") from None
        err.write(f"replay: wrote {html} ({len(timelines.tripped())} tripped traces)\n")
    return result


def _replay_guard(policy: Policy, *, price_usage: bool) -> Guard:
    """The guard a replay runs: with the conversation scope where a policy entry asks for it
    (every trace of the input is seen here, in the input's order), and the agent scope over
    time where one gives an agent budget (record time), and the tool scope where the policy's
    fleet rules are on (record time: what the worker would have decided)."""
    entries = [policy.defaults, *(rule.policy for rule in policy.rules)]
    conversations = (
        ConversationGuard(policy) if any(e.conversation.enabled for e in entries) else None
    )
    agent_budgets = AgentBudgetGuard(policy)
    return Guard(
        policy,
        price_usage=price_usage,
        conversations=conversations,
        agent_budgets=agent_budgets if agent_budgets.enabled else None,
        tools=FleetGuard(policy) if policy.fleet.enabled else None,
    )


def _summary(result: ReplayResult, elapsed: float) -> str:
    """The one line a replay ends with on stderr."""
    guard, stats = result.guard, result.guard.stats
    by_rule = ", ".join(
        f"{rule}/{action}={n}" for (rule, action), n in sorted(result.decided.items())
    )
    skipped = f", {result.skipped:,} broken inputs skipped" if result.skipped else ""
    if guard.pricer is not None:
        skipped += (
            f", {stats.priced_usage:,} usage spans priced, {stats.unpriced_usage:,} without a price"
        )
    if stats.uncarried_requests:
        skipped += (
            f", {stats.uncarried_requests:,} A2A requests without their caller's trace"
            " (a loop across services through them is not seen as one)"
        )
    if stats.linked_runs:
        followed = (
            "followed into the conversation scope"
            if guard.conversations is not None
            else "not followed: the conversation scope is off"
        )
        skipped += (
            f", {stats.linked_runs:,} agent runs linked to their caller's trace, not carried"
            f" (links {followed})"
        )
    return (
        f"replay: {result.requests:,} requests{skipped}, {stats.spans:,} spans,"
        f" {stats.tool_calls:,} tool calls,"
        f" {result.decided.total()} decisions ({by_rule or 'none'}),"
        f" {stats.missing_arguments:,} tool spans without arguments skipped,"
        f" {stats.duplicate_spans + stats.repeated_call_ids:,} repeats ignored"
        f" in {elapsed:.1f}s\n"
    )


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 500 else text[:500] + "..."
