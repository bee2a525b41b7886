"""The one door to Faust's, mode's and aiokafka's private parts.

The worker reads and patches a few members these libraries do not make public: the stream's
current event, the RocksDB store's per-partition databases, the consumer's unacked messages and
read offsets, aiokafka's fetcher and group coordinator, and three methods it wraps. Each such
access is a small named function here, and no other module touches a private attribute of
those libraries (tests/streams/test_faust_internals.py reads the source to hold that). So an
upgrade of faust-streaming, mode-streaming or aiokafka is reviewed in this one file.

They are written for the versions in `WRITTEN_FOR` (constraints.txt pins the same, and a test
compares the two). Importing this module with any other version installed raises
`UntestedLibraryVersions`, naming what is installed, what is expected and what to do: the
worker does not start on internals it was not written for, where a renamed member would fail
silently (a patch no longer called, a set no longer the one Faust waits on).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from importlib import metadata
from typing import Any

__all__ = [
    "ALLOW_UNTESTED",
    "WRITTEN_FOR",
    "UntestedLibraryVersions",
    "aiokafka_consumer",
    "call_in_consumer_thread",
    "check_versions",
    "commit_refresh_task",
    "committed_offset",
    "event_context",
    "faust_partition_set",
    "fetch_positions",
    "fetcher_assignment",
    "fetcher_summary",
    "fetcher_tasks",
    "flow_control_queues",
    "freeze_commits",
    "group_coordinator",
    "heartbeat_rejoining",
    "partition_fetch_state",
    "queued_items",
    "read_offset",
    "requeue",
    "restart_commit_refresh",
    "set_fetch_max_wait",
    "set_read_offset",
    "stop_waiting_for",
    "stop_waiting_for_topics",
    "store_databases",
    "store_index_key",
    "store_write",
    "store_write_batch",
    "store_writes_per_partition",
    "stored_items",
    "unacked_messages",
    "wanted_partitions",
    "wrap_consumer_wait_empty",
    "wrap_flow_control_resume",
    "wrap_heartbeat",
    "wrap_rebalance_start",
]

# The distributions whose private members this module reads, at the versions it was written
# and tested for (the pins of constraints.txt).
WRITTEN_FOR = {
    "faust-streaming": "0.15.3",
    "mode-streaming": "0.7.1",
    "aiokafka": "0.14.0",
}


# Set to 1, the worker starts on other versions, with a warning (docs/operating.md, "Installing").
ALLOW_UNTESTED = "SPANGUARD_ALLOW_UNTESTED_FAUST"

log = logging.getLogger("spanguard.worker")


class UntestedLibraryVersions(RuntimeError):
    """Faust, mode or aiokafka is installed at a version this module was not written for."""


def installed_version(distribution: str) -> str | None:
    """The installed version of `distribution`, None if it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def check_versions(
    version_of: Callable[[str], str | None] = installed_version,
    environ: Mapping[str, str] = os.environ,
) -> None:
    """Raise UntestedLibraryVersions unless every distribution of WRITTEN_FOR is installed at
    the version written there; with ALLOW_UNTESTED=1 in `environ`, log a warning instead."""
    wrong = {
        name: version_of(name)
        for name, expected in WRITTEN_FOR.items()
        if version_of(name) != expected
    }
    if not wrong:
        return
    found = ", ".join(f"{name} {version or 'not installed'}" for name, version in wrong.items())
    wanted = ", ".join(f"{name}=={WRITTEN_FOR[name]}" for name in wrong)
    said = (
        f"the worker reads private members of Faust, mode and aiokafka and was written for"
        f" {wanted}, but found {found}"
    )
    if environ.get(ALLOW_UNTESTED) == "1":
        log.warning(f"{said}; going on untested, as {ALLOW_UNTESTED}=1 asks")
        return
    raise UntestedLibraryVersions(
        f"{said}. Install the pinned versions (pip install -c constraints.txt ...; the worker"
        f" image does). Upgrading them, review every access in"
        f" spanguard/streams/faust_internals.py against the new versions, run tests/streams, and"
        f" update WRITTEN_FOR and constraints.txt together. To run them untested meanwhile, set"
        f' {ALLOW_UNTESTED}=1 (docs/operating.md, "Installing").'
    )


check_versions()

# Imported after the check: a version that fails it may not even have these.
from faust.streams import _current_event  # noqa: E402
from faust.transport.drivers import aiokafka as faust_aiokafka  # noqa: E402

# -- the stream's current event (faust.streams) -----------------------------------------------


@contextlib.contextmanager
def event_context(event: Any) -> Iterator[None]:
    """Make `event` the stream's current event, as Faust does while an agent handles it: the
    stores and the changelog find a write's partition through it."""
    token = _current_event.set(weakref.ref(event))
    try:
        yield
    finally:
        _current_event.reset(token)


# -- table stores (faust.stores.rocksdb.Store, faust.stores.memory.Store) ---------------------


def store_writes_per_partition(store: Any) -> bool:
    """The store keeps one database per partition (Faust's RocksDB store), which the direct
    write path (`put_states` of the trace table) writes to."""
    return hasattr(store, "_db_for_partition")


def store_databases(store: Any) -> list[Any]:
    """The databases Faust's RocksDB store has open, one per partition; a memory store has
    none."""
    return list(getattr(store, "_dbs", {}).values())


def store_write_batch(store: Any) -> Any:
    """An empty write batch of Faust's RocksDB store, of whichever binding it runs on."""
    if store.use_rocksdict:
        import rocksdict

        return rocksdict.WriteBatch(raw_mode=True)
    import rocksdb  # type: ignore[import-not-found]

    return rocksdb.WriteBatch()


def store_index_key(store: Any, key: bytes, partition: int) -> None:
    """Tell the RocksDB store which partition's database holds `key` (its reads look there)."""
    store._key_index[key] = partition


def store_write(store: Any, partition: int, batch: Any) -> None:
    """Write `batch` to the RocksDB store's database of `partition`."""
    store._db_for_partition(partition).write(batch)


def stored_items(store: Any, partition: int) -> Iterator[tuple[bytes, bytes]]:
    """The (key, value) pairs a Faust store holds for one partition, read lazily.

    Faust has no public per-partition iterator; these are the stores' own members
    (faust-streaming 0.15): RocksDB keeps a database per partition, the memory store the
    partition of every key it recovered from the changelog."""
    if store_writes_per_partition(store):
        yield from store._visible_items(store._db_for_partition(partition))
        return
    keys = [key for key, owner in store._key_partition.items() if owner == partition]
    for key in keys:
        value = store.data.get(key)
        if value is not None:
            yield key, value


# -- Faust's consumer (faust.transport.drivers.aiokafka.Consumer) -----------------------------


def unacked_messages(app: Any) -> set[Any]:
    """The messages Faust waits on to be acked before a rebalance or a stop goes on (the
    live set: read it, do not change it; `stop_waiting_for` does)."""
    consumer: Any = app.consumer  # the driver's; ConsumerT types no private state
    unacked: set[Any] = consumer._unacked_messages
    return unacked


def stop_waiting_for(app: Any, events: Iterable[Any]) -> int:
    """Make Faust stop waiting for the messages of `events` to be acked (they never will be):
    a rebalance or a stop goes on without them, and none of their offsets is committed.
    Returns how many of them Faust was waiting on."""
    unacked = unacked_messages(app)
    waited_on = [event for event in events if event.message in unacked]
    for event in waited_on:
        unacked.discard(event.message)
    return len(waited_on)


def stop_waiting_for_topics(app: Any, topics: Iterable[str]) -> int:
    """Make Faust stop waiting for every message of `topics` it handed out and is waiting on
    (`stop_waiting_for`, for messages no agent holds: a stream's buffer, a batch refused).
    Returns how many there were."""
    names = set(topics)
    unacked = unacked_messages(app)
    waited_on = [message for message in unacked if message.tp.topic in names]
    for message in waited_on:
        unacked.discard(message)
    return len(waited_on)


def freeze_commits(app: Any, topics: Iterable[str]) -> None:
    """Commit no offset of `topics` from now on. Faust commits the first run of offsets acked
    past the last commit and, with none committed yet, skips any gap ahead of it: messages a
    failure left unacked for good would be committed past once a later one is acked."""
    consumer: Any = app.consumer
    frozen: set[str] | None = getattr(consumer, "_spanguard_frozen_topics", None)
    if frozen is None:
        frozen = consumer._spanguard_frozen_topics = set()
        new_offset = consumer._new_offset

        def new_offset_unless_frozen(tp: Any) -> int | None:
            offset: int | None = None if tp.topic in frozen else new_offset(tp)
            return offset

        consumer._new_offset = new_offset_unless_frozen
    frozen.update(topics)


def wanted_partitions(consumer: Any) -> set[Any]:
    """The partitions Faust wants fetched now (active, neither paused nor buffered)."""
    return set(consumer._active_partitions or ())


def committed_offset(consumer: Any, tp: Any) -> int | None:
    """The offset Faust last committed for `tp`, None if none."""
    offset: int | None = consumer._committed_offset.get(tp)
    return offset


def read_offset(consumer: Any, tp: Any) -> int | None:
    """Faust's read offset of `tp`: the fetcher drops a record below it as read already."""
    offset: int | None = consumer._read_offset.get(tp)
    return offset


def set_read_offset(consumer: Any, tp: Any, offset: int) -> None:
    consumer._read_offset[tp] = offset


def faust_partition_set(consumer: Any, tp: Any) -> str:
    """Which of Faust's partition sets `tp` is in: active, paused, buffered or none."""
    if tp in consumer._active_partitions:
        return "active"
    if tp in consumer._paused_partitions:
        return "paused"
    if tp in consumer._buffered_partitions:
        return "buffered"
    return "none"


async def call_in_consumer_thread(consumer: Any, function: Callable[..., Any], *args: Any) -> Any:
    """Await `function(aiokafka consumer, *args)` run in the consumer's own thread (aiokafka's
    fetcher is not thread-safe)."""
    thread = consumer._thread
    return await thread.call_thread(function, thread._ensure_consumer(), *args)


def aiokafka_consumer(app: Any) -> Any:
    """The aiokafka consumer under the app's Faust consumer (None before it started)."""
    consumer: Any = app.consumer
    return consumer._thread._consumer


# -- aiokafka's group coordinator (aiokafka.consumer.group_coordinator.GroupCoordinator) ------


def group_coordinator(app: Any) -> Any:
    """The worker consumer's group coordinator: it sends the heartbeats."""
    return aiokafka_consumer(app)._coordinator


def wrap_heartbeat(
    coordinator: Any, wrap: Callable[[Callable[[], Awaitable[bool]]], Callable[[], Awaitable[bool]]]
) -> None:
    """Replace the coordinator's one heartbeat (`_do_heartbeat`, which its heartbeat routine
    calls for each one) by `wrap(heartbeat)`."""
    coordinator._do_heartbeat = wrap(coordinator._do_heartbeat)


def heartbeat_rejoining(coordinator: Any) -> bool:
    """The coordinator was told to rejoin the group (a rebalance): a heartbeat answered now
    does not say this member keeps its partitions."""
    return bool(coordinator._rejoin_needed_fut.done())


def commit_refresh_task(aio: Any) -> Any:
    """The coordinator's task refreshing the committed offsets (offset resets wait on it)."""
    return aio._coordinator._commit_refresh_task


def restart_commit_refresh(aio: Any, assignment: Any) -> None:
    aio._coordinator.start_commit_offsets_refresh_task(assignment)


# -- aiokafka's fetcher (aiokafka.consumer.fetcher.Fetcher), in the consumer's thread ----------


def fetcher_assignment(aio: Any) -> Any:
    """The fetcher's current assignment (aiokafka's Assignment), None if none."""
    return aio._fetcher._subscriptions.subscription.assignment


def fetcher_tasks(aio: Any) -> list[Any]:
    """The fetcher's pending tasks (fetches, offset resets)."""
    return list(aio._fetcher._pending_tasks)


def fetch_positions(aio: Any, tps: Iterable[Any]) -> dict[Any, int | None]:
    """The fetch position of each of `tps` (None: none yet)."""
    assignment = fetcher_assignment(aio)
    positions: dict[Any, int | None] = {}
    for tp in tps:
        state = assignment.state_value(tp)
        positions[tp] = state.position if state is not None and state.has_valid_position else None
    return positions


def partition_fetch_state(aio: Any, consumer: Any, tp: Any) -> dict[str, Any]:
    """What aiokafka and Faust hold of one assigned partition, for a log line."""
    state = fetcher_assignment(aio).state_value(tp)
    record = aio._fetcher._records.get(tp)
    return {
        "leader": aio._client.cluster.leader_for_partition(tp),
        "position": state._position,
        "status": state._status.name,
        "reset": state._reset_strategy,
        "paused": state.paused,
        "committed_waiters": len(state._committed_futs),
        "highwater": state.highwater,
        "buffered": None if record is None else type(record).__name__,
        "read_offset": read_offset(consumer, tp),
        "committed": committed_offset(consumer, tp),
        "faust": faust_partition_set(consumer, tp),
    }


def fetcher_summary(aio: Any) -> dict[str, Any]:
    """The fetcher's nodes in flight, its fetch task and the group generation, for a log
    line (the tasks as they are: the caller describes them)."""
    return {
        "in_flight": sorted(aio._fetcher._in_flight),
        "fetch_task": aio._fetcher._fetch_task,
        "generation": aio._coordinator.generation,
    }


# -- wrapped methods of the app and the worker consumer's thread ------------------------------


def set_fetch_max_wait(milliseconds: int) -> None:
    """Make every worker consumer built from now on wait at most `milliseconds` per fetch: a
    Faust setting that Faust does not expose.

    faust-streaming 0.15.3 builds its aiokafka consumer with `fetch_max_wait_ms=1500`
    hard-coded. The worker reads the busy input partitions and several nearly idle ones
    (repartition, detections, goal checks, changelogs, Faust's leader topic), and aiokafka keeps
    one fetch in flight per broker: when every busy partition still has records buffered, the
    next fetch names only idle ones and the broker holds it for the full 1.5 s while new spans
    wait behind it. A wait of 20 ms keeps those stalls out of the detection latency
    (bench/bench_pipeline.py's figures for both waits: docs/performance.md, "Figures behind the
    code")."""
    global _fetch_max_wait_ms
    _fetch_max_wait_ms = milliseconds
    faust_aiokafka.AIOKafkaConsumerThread._create_worker_consumer = _create_worker_consumer  # type: ignore[method-assign]  # patched on purpose


_original_create_worker_consumer = faust_aiokafka.AIOKafkaConsumerThread._create_worker_consumer
_fetch_max_wait_ms: int | None = None


def _create_worker_consumer(self: Any, transport: Any) -> Any:
    consumer = _original_create_worker_consumer(self, transport)
    if _fetch_max_wait_ms is not None:
        # aiokafka reads this attribute when the consumer starts, after construction.
        consumer._fetch_max_wait_ms = _fetch_max_wait_ms
    return consumer


def wrap_consumer_wait_empty(
    app: Any, wrap: Callable[[Callable[..., Awaitable[None]]], Callable[..., Awaitable[None]]]
) -> None:
    """Replace `App._consumer_wait_empty` by `wrap(it)`: a rebalance and a stop both wait
    there until every message taken is acked."""
    app._consumer_wait_empty = wrap(app._consumer_wait_empty)


def wrap_rebalance_start(
    app: Any, wrap: Callable[[Callable[[], None]], Callable[[], None]]
) -> None:
    """Replace `App.on_rebalance_start` (called in the consumer's thread as this member
    rejoins the group) by `wrap(it)`."""
    app.on_rebalance_start = wrap(app.on_rebalance_start)


def wrap_flow_control_resume(
    app: Any, wrap: Callable[[Callable[[], None]], Callable[[], None]]
) -> None:
    """Replace the app's `flow_control.resume` (which empties every queue it manages) by
    `wrap(it)`."""
    flow = app.flow_control
    flow.resume = wrap(flow.resume)


def flow_control_queues(app: Any) -> list[Any]:
    """The queues the app's flow control manages (the agents' and the table restore's)."""
    return list(app.flow_control._queues)


def queued_items(queue: Any) -> list[Any]:
    """What an asyncio queue (mode's FlowControlQueue) holds, in order, left in it."""
    return list(getattr(queue, "_queue", ()))


def requeue(queue: Any, items: list[Any]) -> None:
    """Put `items` back at the end of `queue`, synchronously, waking no getter."""
    queue._queue.extend(items)
