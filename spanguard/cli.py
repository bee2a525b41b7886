"""The `spanguard` command."""

from __future__ import annotations

import argparse
import logging
import sys

from spanguard import __version__
from spanguard.schemas.policy import Policy, PolicyError

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
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
