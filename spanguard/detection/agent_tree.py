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
# Services told apart in one trace (a remote agent's run is its caller's run of it); runs of
# services beyond are of no known service.
MAX_SERVICES = 16
NO_SERVICE = -1
_UNNAMED = "?"


class PlacedRun:
    """One agent run in the tree: its span, its parent span, the agent, when it ran (ns), the
    longest chain of runs nested down from it (itself counted) with the run below it on that
    chain (its index; -1: none), what names the run across its spans ("": its span), its
    service (an index of the tree's `services`), whether it is the other span of a run
    of another service (`twin`: a remote agent's, AgentTree._remote_twin), and whether it is
    a service's answer to a request, named after the service (`handler`: a2a-sdk's)."""

    __slots__ = (
        "below",
        "chain",
        "end",
        "handler",
        "key",
        "name",
        "parent",
        "service",
        "span",
        "start",
        "twin",
    )

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
        service: int = 0,
        twin: bool = False,
        handler: bool = False,
    ) -> None:
        self.key = key
        self.service = service
        self.twin = twin
        self.handler = handler
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
        "services",
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
        # (call key, the agent handing, the first other agent seen since: the one handed to)
        # of the last transfer that named no agent to hand to.
        self.unresolved: tuple[CallKey, str, str | None] | None = None
        self.services: list[str] = []  # the services of the runs, in the order first seen

    def add_run(self, run: AgentRun, service: str | None = None) -> bool:
        """Place one agent run of `service` (None: not known); False when it is placed already
        (a redelivery) or the tree is full (the run is only counted). A remote agent's other
        span (`_remote_twin`) is placed, one level with its twin, and not counted again. Spans
        of one run (one `run_key`) are one run: the first of them stands for it. A service's
        answer to a request and its agent's run directly inside it are one run too
        (`_served`): the agent's stands for it."""
        run_key = run.run_key or ""
        for placed in self.runs:
            if placed.span == run.span_id or (run_key and placed.key == run_key):
                return False
        self.add_link(run.span_id, run.parent_span_id)
        new = PlacedRun(
            run.span_id,
            run.parent_span_id,
            run.agent_name or _UNNAMED,
            run.start_time_unix_nano,
            run.end_time_unix_nano,
            1,
            -1,
            run_key,
            self._service_index(service),
            handler=run.by_service,
        )
        if self._served(new):
            return False
        new.twin = self._remote_twin(new)
        if not new.twin:
            self.started += 1
        if len(self.runs) >= MAX_RUNS:
            self.dropped += 0 if new.twin else 1
            return False
        self._place(new)
        return True

    def _service_index(self, service: str | None) -> int:
        services = self.services
        if service is None:
            return NO_SERVICE
        if service in services:
            return services.index(service)
        if len(services) >= MAX_SERVICES:
            return NO_SERVICE
        services.append(service)
        return len(services) - 1

    def _served(self, new: PlacedRun) -> bool:
        """Whether `new` and a run placed already are a service's answer to one request
        (a2a-sdk's handler, named after the service) and its agent's run directly inside it
        (Google ADK's `to_a2a`): one run, not two nested, named by the agent. A handler coming
        after its agent's run is left out; one placed first takes the agent's name."""
        if new.service == NO_SERVICE:
            return False
        inside = self.inside
        for other in self.runs:
            if other.service != new.service or other.handler == new.handler:
                continue
            outer, inner = (new, other) if new.handler else (other, new)
            if not inside(outer, inner):
                continue
            between = (
                run
                for run in self.runs
                if run is not other and inside(outer, run) and inside(run, inner)
            )
            if next(between, None) is not None:
                continue
            if other.handler:
                other.name, other.handler = new.name, False
            return True
        return False

    def _remote_twin(self, new: PlacedRun) -> bool:
        """Whether `new` is the other span of a run placed already: an agent called across
        services (A2A) has a span in its caller's service (the remote agent's proxy) and one in
        its own, the one directly inside the other, with the same agent name. Each hop is one
        run, not two: one sub-agent, one level."""
        if new.name == _UNNAMED or new.service == NO_SERVICE:
            return False
        inside = self.inside
        for other in self.runs:
            if other.twin or other.name != new.name or other.service in (new.service, NO_SERVICE):
                continue
            if inside(new, other):
                outer, inner = new, other
            elif inside(other, new):
                outer, inner = other, new
            else:
                continue
            between = (
                run
                for run in self.runs
                if run is not other and inside(outer, run) and inside(run, inner)
            )
            if next(between, None) is None:
                return True
        return False

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
        `outer`. Where nothing above `inner` has come, one service's runs are beside each
        other (its library exports in the order its spans end); across services (spans
        between not exported, or sent in another order) and for a2a-sdk's handler spans time
        says (PlacedRun.contains), and between two services' answers (`handler` runs) where
        the chain stops at a span not kept."""
        parent = inner.parent
        links = self.links
        if parent == outer.span:
            return outer.contains(inner)
        if parent not in links:
            if (
                parent
                and outer.service == inner.service != NO_SERVICE
                and not (outer.handler or inner.handler)
            ):
                # One library exports a span after the spans below it, so a span between the
                # two would have come before the later of them, and been kept (the trace had
                # an agent once `inner` came): a parent not come yet is above or beside both.
                # VoltAgent's sub-agents run at once, each below a tool span of its own that
                # ends after them all: time would stack them. (An OTLP request groups spans by
                # scope: a2a-sdk's handler may come before the agent's run inside it.)
                return False
            return outer.contains(inner)
        span = outer.span
        for _ in range(MAX_WALK):
            if parent == span:
                return True
            parent = links.get(parent, b"")
            if not parent:
                # Between two services' answers are the HTTP spans of the call, which an
                # exporter may send before the handler's (grouped by scope): come already,
                # before the trace had an agent, so not kept. Time says for those.
                return outer.handler and inner.handler and outer.contains(inner)
        return outer.contains(inner)

    def _place(self, placed: PlacedRun) -> None:
        index = len(self.runs)
        outer: list[tuple[int, int]] = []  # (duration, index) of the runs it ran inside
        inside = self.inside
        for at, other in enumerate(self.runs):
            if inside(placed, other):
                if other.chain + _level(placed, other) > placed.chain:
                    placed.chain = other.chain + _level(placed, other)
                    placed.below = at
            elif inside(other, placed):
                outer.append((other.end - other.start, at))
        self.runs.append(placed)
        deepest = placed.chain
        # Outer runs that arrived first (rare: export order puts them last): inner ones first.
        below, chain = index, placed.chain
        for _duration, at in sorted(outer):
            other = self.runs[at]
            if chain + _level(other, self.runs[below]) > other.chain:
                other.chain = chain + _level(other, self.runs[below])
                other.below = below
            below, chain = at, other.chain
            deepest = max(deepest, chain)
        self.deepest = max(self.deepest, deepest)

    def deepest_chain(self) -> list[str]:
        """The agents of the deepest chain, outermost first (at most MAX_NAMED)."""
        top = max(range(len(self.runs)), key=lambda at: self.runs[at].chain, default=-1)
        runs = self.runs
        names: list[str] = []
        for _ in range(len(runs)):
            if not 0 <= top < len(runs) or len(names) >= MAX_NAMED:
                break
            run = runs[top]
            # A remote agent's two spans, next to each other on the chain, are one agent.
            named_by_twin = (names and names[-1] == run.name) or (
                0 <= run.below < len(runs) and runs[run.below].name == run.name
            )
            if not (run.twin and named_by_twin):
                names.append(run.name)
            top = run.below
        return names

    def agent_names(self) -> list[str]:
        """The agents placed, in the order their runs ended, each once (at most MAX_NAMED)."""
        return list(dict.fromkeys(run.name for run in self.runs))[:MAX_NAMED]

    def add_handoff(self, key: CallKey, to_agent: str) -> None:
        handoffs = self.handoffs
        handoffs.append((key, to_agent))
        if len(handoffs) > MAX_HANDOFFS:
            del handoffs[: len(handoffs) - MAX_HANDOFFS]

    def saw_agent(self, name: str) -> None:
        """A span of agent `name`: the first agent other than the one that made a transfer
        naming no agent, seen after that transfer, is the agent it handed to."""
        unresolved = self.unresolved
        if unresolved is not None and unresolved[2] is None and name != unresolved[1]:
            self.unresolved = (unresolved[0], unresolved[1], name)

    def add_transfer(self, key: CallKey, from_agent: str) -> CallKey | None:
        """A transfer that names no agent (Google ADK without content capture): the agent it
        hands to is the first other agent seen after it (`saw_agent`), else the one making the
        next transfer; the one before this one is placed now as "handoff to <that agent>",
        keyed by both agents. Returns that handoff's key, or None. A host routing each turn
        makes every transfer itself: the agent its transfer reached is the one seen between.
        One whose agent is not known (no other agent seen, the same agent transferring
        again) is no handoff, and the handoffs before it are no loop."""
        before, self.unresolved = self.unresolved, (key, from_agent, None)
        if before is None:
            return None
        (_tool, digest, result), by_agent, seen = before
        to_agent = seen or from_agent
        if to_agent == by_agent:
            self.handoffs.clear()
            return None
        resolved = (f"handoff to {to_agent}", digest, result)
        self.add_handoff(resolved, to_agent)
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
                    *_run_tail(run),
                ]
                for run in self.runs
            ],
            **({"services": self.services} if self.services else {}),
            "handoffs": [[list(key), to_agent] for key, to_agent in self.handoffs],
            **(
                {
                    "links": [[span.hex(), parent.hex()] for span, parent in self.links.items()],
                    "links_dropped": self.links_dropped,
                }
                if self.links
                else {}
            ),
            **self._unresolved_record(),
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> AgentTree:
        tree = cls()
        tree.started = int(record["started"])
        tree.dropped = int(record["dropped"])
        tree.deepest = int(record["deepest"])
        tree.services = [str(service) for service in record.get("services", ())][:MAX_SERVICES]
        for span, parent, name, start, end, chain, below, *rest in record["runs"][:MAX_RUNS]:
            service = int(rest[1]) if len(rest) > 1 else 0
            twin = len(rest) > 2 and bool(rest[2])
            handler = len(rest) > 3 and bool(rest[3])
            tree.runs.append(
                PlacedRun(
                    bytes.fromhex(span), bytes.fromhex(parent), str(name), int(start), int(end),
                    int(chain), int(below) if -1 <= int(below) < MAX_RUNS else -1,
                    str(rest[0]) if rest else "",
                    service if 0 <= service < len(tree.services) else NO_SERVICE, twin,
                    handler,
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
            seen = record.get("unresolved_to")
            to_agent = str(seen) if seen is not None else None
            tree.unresolved = ((str(tool), digest, result), str(from_agent), to_agent)
        return tree

    def _unresolved_record(self) -> dict[str, Any]:
        """The unresolved transfer, and the agent seen after it under a key of its own (a
        worker that does not know it reads the rest)."""
        if self.unresolved is None:
            return {}
        key, from_agent, seen = self.unresolved
        record: dict[str, Any] = {"unresolved": [list(key), from_agent]}
        if seen is not None:
            record["unresolved_to"] = seen
        return record


def _level(outer: PlacedRun, inner: PlacedRun) -> int:
    """The levels `inner` adds below `outer`: none where the two are one run's two spans (a
    remote agent's proxy and its own: AgentTree._remote_twin)."""
    twins = outer.twin or inner.twin
    return 0 if twins and outer.name == inner.name and outer.service != inner.service else 1


def _run_tail(run: PlacedRun) -> tuple[Any, ...]:
    """A run's record fields after `below`: most runs are their span (no key) of the tree's
    first service, and no twin, so nothing."""
    if run.handler:
        return (run.key, run.service, int(run.twin), 1)
    if run.twin:
        return (run.key, run.service, 1)
    if run.service:
        return (run.key, run.service)
    return (run.key,) if run.key else ()
