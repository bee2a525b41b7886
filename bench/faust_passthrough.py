"""Faust's own floor: an agent that reads a topic and does nothing with what it reads.

Built like the worker's app (streams/app.py: the same broker settings, raw codecs, fetch wait,
commit interval, `take_events` batches of the worker's size) minus tables, sends and the
guard, so bench/bench_pipeline.py can print the worker's rate as a share of what Faust itself
moves on the same broker. It reads `--topic` from the beginning under its own consumer group,
counts records, writes one JSON object to `--report` when it has seen `--expect` of them
({"records", "at_2pct", "records_2pct", "done_at"}, monotonic seconds; a file, since Faust's
worker redirects stdout into its logs) and keeps running until it is stopped.

    python -m bench.faust_passthrough --topic T --expect N --app-id ID --data-dir DIR --report F
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import faust

from spanguard.config.settings import WorkerSettings
from spanguard.connectors.kafka_clients import faust_credentials
from spanguard.logs import logging_config
from spanguard.streams.faust_internals import set_fetch_max_wait

RAW: dict[str, Any] = {
    "key_type": bytes,
    "value_type": bytes,
    "key_serializer": "raw",
    "value_serializer": "raw",
}


def build_app(settings: WorkerSettings, topic: str, expect: int, report: Path) -> faust.App:
    set_fetch_max_wait(settings.fetch_max_wait)
    app = faust.App(
        settings.app_id,
        broker=f"kafka://{settings.bootstrap}",
        broker_credentials=faust_credentials(settings.kafka),
        datadir=settings.data_dir,
        web_enabled=False,
        broker_commit_interval=settings.commit_interval,
        broker_session_timeout=settings.session_timeout,
        broker_heartbeat_interval=min(3.0, settings.session_timeout / 3),
        consumer_auto_offset_reset="earliest",
        topic_partitions=settings.partitions,
        producer_acks=-1,
    )
    source = app.topic(topic, **RAW)
    seen: dict[str, Any] = {"records": 0, "at_2pct": None}

    @app.agent(source, name="passthrough")
    async def passthrough(stream: faust.StreamT) -> None:
        # (take_events is Stream's, not on the StreamT interface Faust types it by.)
        async for events in stream.take_events(settings.batch_size, within=0.002):  # type: ignore[attr-defined]
            now = time.monotonic()
            seen["records"] += len(events)
            if seen["at_2pct"] is None and seen["records"] >= 0.02 * expect:
                seen["at_2pct"], seen["records_2pct"] = now, seen["records"]
            if seen["records"] >= expect and "done_at" not in seen:
                seen["done_at"] = now
                report.with_suffix(".tmp").write_text(json.dumps(seen))
                report.with_suffix(".tmp").rename(report)  # the reader sees all of it or none

    return app


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topic", required=True)
    parser.add_argument("--expect", type=int, required=True, help="records to count")
    parser.add_argument("--app-id", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--report", required=True, type=Path, help="where the figures go")
    args = parser.parse_args()
    # The worker's settings from the environment (bootstrap, security, batch size, fetch wait).
    settings = WorkerSettings.from_sources(
        {"app_id": args.app_id, "data_dir": args.data_dir, "allow_unsigned": True}
    )
    app = build_app(settings, args.topic, args.expect, args.report)
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    worker = faust.Worker(
        app, loglevel="WARNING", logging_config=logging_config("WARNING"), quiet=True
    )
    worker.execute_from_commandline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
