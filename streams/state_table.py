"""The Faust table that holds encoded states (the traces', the conversations', the agent
windows'): it keeps its changelog records' acks for the flush, writes a flush's states directly
to RocksDB, and tells its DecodedStates when partitions come and go."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, NamedTuple

import faust
from faust.types import TP
from faust.types.enums import ProcessingGuarantee

from spanguard.streams.faust_internals import (
    store_index_key,
    store_write,
    store_write_batch,
    store_writes_per_partition,
    stored_items,
)

if TYPE_CHECKING:
    from spanguard.streams.decoded_states import DecodedStates

__all__ = ["StateTable", "StateWrite"]


class StateWrite(NamedTuple):
    """One state to write: its key and encoded value, and the event whose partition it goes to."""

    event: Any
    key: bytes
    value: bytes


class StateTable(faust.Table):
    """A table of encoded states keyed by id (the trace table, the conversation table and the
    agent-window table are each one): tells its DecodedStates when partitions come and go.

    A revoked partition's indexes are dropped (another worker may change its traces while it
    is away); a partition owned after recovery is indexed from what the store holds, the
    traces recovered from the changelog and those already on local disk."""

    states: DecodedStates | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        # Changelog records sent and not yet handed to whoever waits for their acks.
        self.unconfirmed: list[Any] = []
        # Changelog records (partition, key, value or None) stored and not yet sent.
        self.pending: list[tuple[int, bytes, bytes | None]] = []

    def send_changelog(self, *args: Any, **kwargs: Any) -> Any:
        """Keep each changelog record's future: the span agent waits for the broker's ack of
        a flush's writes before it lets their messages' offsets be committed."""
        future = super().send_changelog(*args, **kwargs)
        self.unconfirmed.append(future)
        return future

    def writes_directly(self) -> bool:
        """At least once on a RocksDB store, changelog records are sent straight to the
        producer, in order, from `pending`, and a flush's states stored in one write batch per
        partition: Faust's own path (a send through its buffer and a persisted offset per
        record) costs several times as much per state, before its send and after, while every batch
        waited (docs/performance.md). In Kafka transactions (exactly once) the transaction's
        producer must send them, so Faust's path does."""
        # (Faust's setting descriptor types the value as the enum class; it is a member.)
        guarantee: ProcessingGuarantee = self.app.conf.processing_guarantee  # type: ignore[assignment]
        return guarantee is ProcessingGuarantee.AT_LEAST_ONCE and store_writes_per_partition(
            self.data
        )

    def on_key_set(self, key: Any, value: Any) -> None:
        if not self.writes_directly():
            super().on_key_set(key, value)
            return
        # Declared without use_partitioner, the table names the arriving record's partition.
        self.pending.append((self.partition_for_key(key), key, value))  # type: ignore[arg-type]

    def on_key_del(self, key: Any) -> None:
        if not self.writes_directly():
            super().on_key_del(key)
            return
        self.pending.append((self.partition_for_key(key), key, None))  # type: ignore[arg-type]

    def put_states(self, writes: list[StateWrite]) -> None:
        """Store a flush's states, their changelog records left in `pending` (when
        `writes_directly`)."""
        store: Any = self.data  # a RocksDB store (writes_directly): its index and DBs
        batches: dict[int, Any] = {}
        for write in writes:
            partition = write.event.message.partition
            batch = batches.get(partition)
            if batch is None:
                batch = batches[partition] = store_write_batch(store)
            batch.put(write.key, write.value)
            store_index_key(store, write.key, partition)
            self.pending.append((partition, write.key, write.value))
        for partition, batch in batches.items():
            store_write(store, partition, batch)

    async def send_pending(self) -> None:
        """Send the changelog records of what was stored since the last call, in the order it
        was stored: the same bytes to the same partition as Faust's path; each record's ack is
        kept for the flush to await, and the last of each partition's, once acked, is the
        store's persisted offset (recovery reads the changelog after it), as Faust keeps."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        producer, topic = self.app.producer, self.changelog_topic.get_topic_name()
        last: dict[int, Any] = {}
        for partition, key, value in pending:
            future = await producer.send(topic, key, value, partition, None, None)
            self.unconfirmed.append(future)
            last[partition] = future
        for future in last.values():
            future.add_done_callback(self._persist_offset)

    def _persist_offset(self, future: asyncio.Future[Any]) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # the flush raises; recovery reads from the last offset persisted
        metadata = future.result()
        self.data.set_persisted_offset(metadata.topic_partition, metadata.offset)

    def take_unconfirmed(self) -> list[Any]:
        """The changelog records sent since the last call (their futures)."""
        taken, self.unconfirmed = self.unconfirmed, []
        return taken

    async def on_rebalance(
        self, assigned: set[TP], revoked: set[TP], newly_assigned: set[TP], generation_id: int = 0
    ) -> None:
        await super().on_rebalance(assigned, revoked, newly_assigned, generation_id)
        if self.states is not None:
            # Any revoked topic of a partition drops its index: at worst a rescan, never stale.
            self.states.revoke({tp.partition for tp in revoked})

    async def on_recovery_completed(self, active_tps: set[TP], standby_tps: set[TP]) -> None:
        await super().on_recovery_completed(active_tps, standby_tps)
        if self.states is not None:
            for partition in sorted({tp.partition for tp in active_tps}):
                self.states.assigned(partition, stored_items(self.data, partition))
