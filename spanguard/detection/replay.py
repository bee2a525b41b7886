"""`spanguard replay`: the detection core over files, in the order a stream would see the spans."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TextIO

from spanguard.detection.guard import Guard
from spanguard.detection.report import TimelineGuard, render_html
from spanguard.errors import ReplayInputError
from spanguard.schemas.otlp import (
    ExportTraceServiceRequest,
    OtlpDecodeError,
    decode_json_line,
    decode_protobuf,
)
from spanguard.schemas.policy import Policy

__all__ = ["ReplayInputError", "replay"]

PROTOBUF_SUFFIXES = (".pb", ".binpb")


@dataclass
class _Progress:
    """A one-line progress bar on stderr, shown only when stderr is a terminal."""

    stream: TextIO
    total_bytes: int
    enabled: bool
    guard: Guard
    done_bytes: int = 0
    _last_draw: float = 0.0

    def advance(self, nbytes: int) -> None:
        self.done_bytes += nbytes
        now = time.monotonic()
        if not self.enabled or now - self._last_draw < 0.2:
            return
        self._last_draw = now
        share = self.done_bytes / self.total_bytes if self.total_bytes else 0.0
        filled = int(share * 30)
        stats = self.guard.stats
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (30 - filled)}] {share:4.0%}"
            f"  {stats.spans:,} spans  {sum(stats.decisions.values())} decisions"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._last_draw:
            self.stream.write("\r" + " " * 79 + "\r")
            self.stream.flush()


def _read_inputs(
    paths: list[str], stdin: IO[bytes], errors: TextIO
) -> Iterator[tuple[ExportTraceServiceRequest | None, int]]:
    """(request or None for a skipped input, bytes it took) in file order.

    Broken lines and files are reported on `errors` with their line number and skipped."""
    for path in paths:
        if path != "-" and path.endswith(PROTOBUF_SUFFIXES):
            try:
                data = Path(path).read_bytes()
            except OSError as exc:
                raise ReplayInputError(f"{path}: {exc.strerror}") from None
            try:
                yield decode_protobuf(data), len(data)
            except OtlpDecodeError as exc:
                errors.write(f"{path}: skipped: {exc}\n")
                yield None, len(data)
            continue
        handle: IO[bytes]
        if path == "-":
            handle = stdin
        else:
            try:
                handle = open(path, "rb")  # noqa: SIM115 - closed below, after the generator
            except OSError as exc:
                raise ReplayInputError(f"{path}: {exc.strerror}") from None
        try:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    yield None, len(line)
                    continue
                try:
                    yield decode_json_line(line), len(line)
                except OtlpDecodeError as exc:
                    errors.write(f"{path}:{number}: skipped: {exc}\n")
                    yield None, len(line)
        finally:
            if handle is not stdin:
                handle.close()


def replay(
    paths: list[str],
    policy: Policy | None = None,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    stdin: IO[bytes] | None = None,
    html: str | None = None,
) -> Guard:
    """Print one JSON decision per line on stdout and a one-line summary on stderr; with
    `html`, also write that file: a timeline per tripped trace (spanguard/detection/report.py)."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    source = stdin or sys.stdin.buffer
    total = sum(os.path.getsize(p) for p in paths if p != "-" and os.path.isfile(p))
    guard = TimelineGuard(policy) if html else Guard(policy)
    progress = _Progress(err, total, enabled=err.isatty() and total > 1_000_000, guard=guard)
    requests = 0
    started = time.monotonic()
    try:
        for request, nbytes in _read_inputs(paths, source, err):
            if request is not None:
                requests += 1
                for decision in guard.process(request):
                    out.write(decision.to_json() + "\n")
            progress.advance(nbytes)
    finally:
        progress.close()
        out.flush()
    stats = guard.stats
    by_rule = ", ".join(
        f"{rule}/{action}={n}" for (rule, action), n in sorted(stats.decisions.items())
    )
    err.write(
        f"replay: {requests:,} requests, {stats.spans:,} spans, {stats.tool_calls:,} tool calls,"
        f" {sum(stats.decisions.values())} decisions ({by_rule or 'none'}),"
        f" {stats.missing_arguments:,} tool spans without arguments skipped,"
        f" {stats.duplicate_spans + stats.repeated_call_ids:,} repeats ignored"
        f" in {time.monotonic() - started:.1f}s\n"
    )
    if html and isinstance(guard, TimelineGuard):
        try:
            Path(html).write_text(render_html(guard, paths), encoding="utf-8")
        except OSError as exc:
            raise ReplayInputError(f"{html}: cannot write the page: {exc.strerror}") from None
        err.write(f"replay: wrote {html} ({len(guard.tripped())} tripped traces)\n")
    return guard
