"""The `spanguard` command."""

from __future__ import annotations

import argparse
import logging
import sys

from spanguard import __version__
from spanguard.kafka_security import KafkaConnectError, KafkaSecurityError
from spanguard.schemas.policy import Policy, PolicyError
from spanguard.streams.settings import SettingsError

EXIT_USAGE = 2


def _load_policy(path: str | None) -> Policy:
    return Policy.load(path) if path else Policy()


def _cmd_replay(args: argparse.Namespace) -> int:
    from spanguard.streams.replay import ReplayInputError, replay

    policy = _load_policy(args.policy)
    try:
        replay(args.paths, policy)
    except ReplayInputError as exc:
        print(f"spanguard replay: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per worker setting; unset flags fall back to SPANGUARD_* variables."""
    from dataclasses import fields

    from spanguard.streams.settings import ENV_PREFIX, WorkerSettings

    for spec in fields(WorkerSettings):
        if spec.metadata.get("flag") is False:
            continue  # secrets: never on a command line, where `ps` shows them
        kind = type(spec.default) if spec.default is not None else str
        env = ENV_PREFIX + spec.name.upper()
        parser.add_argument(
            "--" + spec.name.replace("_", "-"),
            dest=spec.name,
            type=kind,
            default=None,
            metavar=spec.name.split("_")[-1].upper() if spec.name != "bootstrap" else "HOST:PORT",
            help=f"{spec.metadata.get('help', '')} (${env}; default {spec.default})",
        )
    from spanguard.kafka_security import add_flags

    add_flags(parser)


def _settings(args: argparse.Namespace):
    from spanguard.streams.settings import WorkerSettings

    return WorkerSettings.from_sources(vars(args))


def _cmd_worker(args: argparse.Namespace) -> int:
    try:
        from spanguard.streams.worker import run_worker
    except ModuleNotFoundError as exc:  # a lean install: the killswitch and replay only
        print(
            f"spanguard worker: {exc.name} is not installed; the worker needs the worker extra:"
            ' pip install "spanguard[worker]"',
            file=sys.stderr,
        )
        return EXIT_USAGE

    settings = _settings(args)
    policy = _load_policy(settings.policy)  # a bad policy stops here, before Kafka
    return run_worker(settings, policy)


def _cmd_topics_create(args: argparse.Namespace) -> int:
    from confluent_kafka import KafkaException

    from spanguard.streams.topics import create_topics

    settings = _settings(args)
    try:
        outcomes = create_topics(settings)
    except KafkaException as exc:
        print(f"spanguard topics create: {exc}", file=sys.stderr)
        return 1
    for name, outcome in outcomes.items():
        print(f"{name}: {outcome}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spanguard",
        description="Runtime guards for fleets of LLM agents, in the trace pipeline.",
    )
    parser.add_argument("--version", action="version", version=f"spanguard {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    replay = commands.add_parser(
        "replay",
        help="run the guards over OTLP files and print one JSON decision per line",
        description=(
            "Run the detection core over OTLP trace files in order and print one JSON decision"
            " per line. Files ending .pb/.binpb hold one protobuf ExportTraceServiceRequest;"
            " other files (and - for stdin) hold OTLP/JSON, one request a line."
        ),
    )
    replay.add_argument("paths", nargs="+", metavar="PATH", help="input files, - for stdin")
    replay.add_argument("--policy", metavar="FILE", help="policy YAML (default: built-in defaults)")
    replay.set_defaults(handler=_cmd_replay)

    worker = commands.add_parser(
        "worker",
        help="run the streaming guard: OTLP spans from Kafka in, kill signals out",
        description="Consume OTLP spans from Kafka, keep per-trace state, publish decisions.",
    )
    _add_settings_flags(worker)
    worker.set_defaults(handler=_cmd_worker)

    topics = commands.add_parser("topics", help="manage the Kafka topics spanguard uses")
    topic_commands = topics.add_subparsers(dest="topics_command", required=True, metavar="ACTION")
    create = topic_commands.add_parser(
        "create", help="create the input, output, dead-letter and state topics"
    )
    _add_settings_flags(create)
    create.set_defaults(handler=_cmd_topics_create)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except PolicyError as exc:
        print(f"spanguard: bad policy: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (SettingsError, KafkaSecurityError) as exc:
        print(f"spanguard: bad setting: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KafkaConnectError as exc:
        print(f"spanguard: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
