"""The agent tree of one trace: which agents ran, which ran inside which, and the handoffs.

Read from the agents' own spans (`AgentRun`: an `invoke_agent` span, OpenInference's AGENT
kind), the handoff calls, and the parent of every span of the trace once it has an agent
(`links`). Spans are exported when they end, so an agent's span arrives after the spans of the
agents it called, and the spans between the two (the tool span of an agent called as a tool,
OpenInference's turn spans) before its own: a run is placed under another when its chain of
parent spans leads to that run's span (AgentTree.inside). Where no span above a run came (not
exported), the run is under another whose span contains it in time. So depth grows from the
bottom as the outer agents end; the number of runs is known as each one ends.

Bounded whatever the spans say: at most MAX_RUNS runs are placed (the others are only
counted, in `dropped`) and MAX_LINKS parents kept (`links_dropped`), each placement costs
O(MAX_RUNS * MAX_WALK), so parents that never arrive, span parents in a cycle and chains
10,000 deep cost nothing more. Agent names are bounded by the adapter (MAX_TEXT_CHARS).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spanguard.detection.conventions.events import AgentRun
    from spanguard.detection.trace_state import CallKey

__all__ = ["MAX_HANDOFFS", "MAX_LINKS", "MAX_NAMED", "MAX_RUNS", "AgentTree", "PlacedRun"]

# Runs placed in the tree: far more than a healthy trace starts, few enough to place each in
# O(MAX_RUNS).
MAX_RUNS = 256
# Spans of the trace kept with their parent span once it has an agent: the spans between a
# healthy trace's agents, few enough to keep in its state.
MAX_LINKS = 1024
# Parent spans walked up from a run to see whether another contains it: beyond, time decides.
MAX_WALK = 64
# Handoffs remembered since the last new work (handoff_cycle compares the newest).
MAX_HANDOFFS = 64
# Agent names a decision lists at most.
MAX_NAMED = 50
_UNNAMED = "?"


class PlacedRun:
    """One agent run in the tree: its span, its parent span, the agent, when it ran (ns), the
    longest chain of runs nested down from it (itself counted) with the run below it on that
    chain (its index; -1: none), and what names the run across its spans ("": its span)."""

    __slots__ = ("below", "chain", "end", "key", "name", "parent", "span", "start")

    def __init__(
        self,
        span: bytes,
        parent: bytes,
        name: str,
        start: int,
        end: int,
        chain: int,
        below: int,
        key: str = "",
    ) -> None:
        self.key = key
        self.span = span
        self.parent = parent
        self.name = name
        self.start = start
        self.end = end
        self.chain = chain
        self.below = below

    def contains(self, inner: PlacedRun) -> bool:
        """Whether `inner` ran inside this run: this run's span is its parent, or its time is
        within this run's and the two are not siblings (children of one span: parallel workers
        run in threads, one inside another's time)."""
        if inner.parent == self.span:
            return self.parent != inner.span  # two spans each other's parent: neither
        if inner.parent and inner.parent == self.parent:
            return False  # siblings (parallel workers): overlapping in time is not nesting
        start, end = self.start, self.end
        if not start or not end or not inner.start or not inner.end:
            return False
        if start == inner.start and end == inner.end:
            return False
        return start <= inner.start and inner.end <= end


class AgentTree:
    """One trace's agents: the runs placed (`runs`), how many ran (`started`), the deepest
    chain of runs nested in one another, and the handoffs since the last new work."""

    __slots__ = (
        "deepest",
        "dropped",
        "handoffs",
        "links",
        "links_dropped",
        "runs",
        "started",
        "unresolved",
    )

    def __init__(self) -> None:
        self.runs: list[PlacedRun] = []
        self.started = 0  # agent runs seen, placed or not
        self.dropped = 0  # runs seen beyond MAX_RUNS: counted, not placed
        self.deepest = 0  # the longest chain of runs nested in one another
        # {span: its parent span} of the spans seen since the first agent run (add_link).
        self.links: dict[bytes, bytes] = {}
        self.links_dropped = 0  # spans beyond MAX_LINKS: not kept
        # (call key, the agent handed to) of the handoffs since the last new work, oldest first.
        self.handoffs: list[tuple[CallKey, str]] = []
        # (call key, the agent handing) of the last transfer that named no agent to hand to.
        self.unresolved: tuple[CallKey, str] | None = None

    def add_run(self, run: AgentRun) -> bool:
        """Place one agent run; False when it is placed already (a redelivery) or the tree is
        full (the run is only counted). Spans of one run (one `run_key`) are one run: the
        first of them stands for it."""
        run_key = run.run_key or ""
        for placed in self.runs:
            if placed.span == run.span_id or (run_key and placed.key == run_key):
                return False
        self.started += 1
        self.add_link(run.span_id, run.parent_span_id)
        if len(self.runs) >= MAX_RUNS:
            self.dropped += 1
            return False
        self._place(
            PlacedRun(
                run.span_id,
                run.parent_span_id,
                run.agent_name or _UNNAMED,
                run.start_time_unix_nano,
                run.end_time_unix_nano,
                1,
                -1,
                run_key,
            )
        )
        return True

    def add_link(self, span: bytes, parent: bytes) -> bool:
        """Keep one span's parent; False when the links are full (MAX_LINKS)."""
        links = self.links
        if span in links:
            return True
        if len(links) >= MAX_LINKS:
            self.links_dropped += 1
            return False
        links[span] = parent
        return True

    def inside(self, outer: PlacedRun, inner: PlacedRun) -> bool:
        """Whether `inner` ran inside `outer`. Where the span above `inner` has come, its
        chain of parents says: spans end before the spans above them, so when `outer` has
        ended every span between the two has come, and a chain that stops at a span not
        come yet (one still running above both: parallel workers' graph) passes beside
        `outer`. Where nothing above `inner` has come (spans between not exported), time
        says (PlacedRun.contains)."""
        parent = inner.parent
        links = self.links
        if parent == outer.span or parent not in links:
            return outer.contains(inner)
        span = outer.span
        for _ in range(MAX_WALK):
            if parent == span:
                return True
            parent = links.get(parent, b"")
            if not parent:
                return False
        return outer.contains(inner)

    def _place(self, placed: PlacedRun) -> None:
        index = len(self.runs)
        outer: list[tuple[int, int]] = []  # (duration, index) of the runs it ran inside
        inside = self.inside
        for at, other in enumerate(self.runs):
            if inside(placed, other):
                if other.chain + 1 > placed.chain:
                    placed.chain = other.chain + 1
                    placed.below = at
            elif inside(other, placed):
                outer.append((other.end - other.start, at))
        self.runs.append(placed)
        deepest = placed.chain
        # Outer runs that arrived first (rare: export order puts them last): inner ones first.
        below, chain = index, placed.chain
        for _duration, at in sorted(outer):
            other = self.runs[at]
            if chain + 1 > other.chain:
                other.chain = chain + 1
                other.below = below
            below, chain = at, other.chain
            deepest = max(deepest, chain)
        self.deepest = max(self.deepest, deepest)

    def deepest_chain(self) -> list[str]:
        """The agents of the deepest chain, outermost first (at most MAX_NAMED)."""
        top = max(range(len(self.runs)), key=lambda at: self.runs[at].chain, default=-1)
        names: list[str] = []
        while 0 <= top < len(self.runs) and len(names) < min(MAX_NAMED, len(self.runs)):
            names.append(self.runs[top].name)
            top = self.runs[top].below
        return names

    def agent_names(self) -> list[str]:
        """The agents placed, in the order their runs ended, each once (at most MAX_NAMED)."""
        return list(dict.fromkeys(run.name for run in self.runs))[:MAX_NAMED]

    def add_handoff(self, key: CallKey, to_agent: str) -> None:
        handoffs = self.handoffs
        handoffs.append((key, to_agent))
        if len(handoffs) > MAX_HANDOFFS:
            del handoffs[: len(handoffs) - MAX_HANDOFFS]

    def add_transfer(self, key: CallKey, from_agent: str) -> CallKey | None:
        """A transfer that names no agent (Google ADK without content capture): the agent it
        hands to is the one making the next transfer, so the one before it is placed now as
        "handoff to <this agent>", keyed by both agents. Returns that handoff's key, or None."""
        before, self.unresolved = self.unresolved, (key, from_agent)
        if before is None:
            return None
        (_tool, digest, result), _from = before
        resolved = (f"handoff to {from_agent}", digest, result)
        self.add_handoff(resolved, from_agent)
        return resolved

    def call_without_content(self) -> None:
        """A call whose arguments were not recorded: between transfers worked out without
        content (add_transfer) it may be new work, so the handoffs before it are no loop."""
        if self.handoffs and self.unresolved is not None:
            self.handoffs.clear()

    def repeated_handoffs(self, cycles: int) -> int:
        """The shortest period of handoffs repeated `cycles` times at the end, or 0."""
        handoffs = self.handoffs
        for period in range(1, len(handoffs) // cycles + 1):
            tail = handoffs[len(handoffs) - period * cycles :]
            if all(tail[at][0] == tail[at % period][0] for at in range(period, len(tail))):
                return period
        return 0

    def levels(self) -> list[tuple[int, str]]:
        """The placed runs as (depth, name) in tree order, for `spanguard explain`."""
        children: dict[int, list[int]] = {}
        tops: list[int] = []
        for at in range(len(self.runs)):
            parent = self._innermost_outer(at)
            (tops if parent < 0 else children.setdefault(parent, [])).append(at)
        lines: list[tuple[int, str]] = []
        stack = [(0, at) for at in reversed(sorted(tops, key=self._start_of))]
        while stack and len(lines) < MAX_RUNS:
            depth, at = stack.pop()
            lines.append((depth, self.runs[at].name))
            for child in sorted(children.get(at, ()), key=self._start_of, reverse=True):
                stack.append((depth + 1, child))
        return lines

    def _start_of(self, at: int) -> int:
        return self.runs[at].start

    def _innermost_outer(self, at: int) -> int:
        run = self.runs[at]
        best, best_span = -1, 0
        for other_at, other in enumerate(self.runs):
            if other_at != at and self.inside(other, run):
                span = other.end - other.start
                if best < 0 or span < best_span:
                    best, best_span = other_at, span
        return best

    # -- the state record's section ------------------------------------------------------

    def to_record(self) -> dict[str, Any]:
        return {
            "started": self.started,
            "dropped": self.dropped,
            "deepest": self.deepest,
            "runs": [
                [
                    run.span.hex(),
                    run.parent.hex(),
                    run.name,
                    run.start,
                    run.end,
                    run.chain,
                    run.below,
                    *((run.key,) if run.key else ()),  # most runs are their span: no key
                ]
                for run in self.runs
            ],
            "handoffs": [[list(key), to_agent] for key, to_agent in self.handoffs],
            **(
                {
                    "links": [[span.hex(), parent.hex()] for span, parent in self.links.items()],
                    "links_dropped": self.links_dropped,
                }
                if self.links
                else {}
            ),
            **(
                {"unresolved": [list(self.unresolved[0]), self.unresolved[1]]}
                if self.unresolved is not None
                else {}
            ),
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> AgentTree:
        tree = cls()
        tree.started = int(record["started"])
        tree.dropped = int(record["dropped"])
        tree.deepest = int(record["deepest"])
        for span, parent, name, start, end, chain, below, *key in record["runs"][:MAX_RUNS]:
            tree.runs.append(
                PlacedRun(
                    bytes.fromhex(span), bytes.fromhex(parent), str(name), int(start), int(end),
                    int(chain), int(below) if -1 <= int(below) < MAX_RUNS else -1,
                    str(key[0]) if key else "",
                )
            )  # fmt: skip
        for key, to_agent in record["handoffs"][-MAX_HANDOFFS:]:
            tool, digest, result = key
            tree.handoffs.append(((str(tool), digest, result), str(to_agent)))
        for span, parent in record.get("links", ())[:MAX_LINKS]:
            tree.links[bytes.fromhex(span)] = bytes.fromhex(parent)
        tree.links_dropped = int(record.get("links_dropped", 0))
        if "unresolved" in record:
            (tool, digest, result), from_agent = record["unresolved"]
            tree.unresolved = ((str(tool), digest, result), str(from_agent))
        return tree
