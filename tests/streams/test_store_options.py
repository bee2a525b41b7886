"""RocksDB's memory per table partition is the worker's setting, on every table it keeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from spanguard.config.settings import SettingsError, WorkerSettings
from spanguard.schemas.policy import Policy
from spanguard.streams.app import (
    agent_window_states,
    build_worker,
    conversation_states,
    faust_app,
)

KEY = "k" * 32
MIB = 1024 * 1024


def test_every_table_opens_rocksdb_with_the_settings_memory(tmp_path: Path) -> None:
    settings = WorkerSettings.from_sources(
        {"data_dir": str(tmp_path), "signing_key": KEY},
        {"SPANGUARD_ROCKSDB_WRITE_BUFFER_MB": "8", "SPANGUARD_ROCKSDB_BLOCK_CACHE_MB": "32"},
    )
    app = faust_app(settings)
    build_worker(app, settings, Policy(), None, None, None)  # the trace and delivery tables
    conversation_states(app, settings)  # made when a policy turns the scopes on
    agent_window_states(app, settings)
    assert len(app.tables) >= 4
    for table in app.tables.values():
        options = table.data.rocksdb_options  # the store Faust made for the table
        sizes = (options.write_buffer_size, options.block_cache_size)
        assert sizes == (8 * MIB, 32 * MIB), table.name


def test_the_defaults_bound_memory_and_memory_stores_take_none(tmp_path: Path) -> None:
    rocksdb = WorkerSettings(data_dir=str(tmp_path), signing_key=KEY)
    # Below Faust's own 64 MiB and 2 GiB: with those a worker's RSS grew ~20 MiB a minute
    # through a 12-minute soak (docs/operating.md, "The soak").
    assert rocksdb.store_options == {"write_buffer_size": 16 * MIB, "block_cache_size": 64 * MIB}
    assert (
        WorkerSettings(data_dir=str(tmp_path), signing_key=KEY, store="memory").store_options
        is None
    )


def test_a_memory_size_below_one_mib_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="rocksdb_write_buffer_mb"):
        WorkerSettings.from_sources(
            {"data_dir": str(tmp_path), "signing_key": KEY},
            {"SPANGUARD_ROCKSDB_WRITE_BUFFER_MB": "0"},
        )
