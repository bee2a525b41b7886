"""The `spanguard` command."""

from __future__ import annotations

import argparse
import logging
import sys

from spanguard import __version__
from spanguard.errors import PolicyError, SettingsError, SpanguardError
from spanguard.schemas.policy import Policy

EXIT_USAGE = 2


def _load_policy(path: str | None) -> Policy:
    return Policy.load(path) if path else Policy()


EXIT_SKIPPED = 1  # replay: every input read, but some broken lines or files were skipped


def _cmd_replay(args: argparse.Namespace) -> int:
    from spanguard.detection.replay import replay

    result = replay(args.paths, _load_policy(args.policy), html=args.html)
    return EXIT_SKIPPED if result.skipped else 0


def _cmd_policy_check(args: argparse.Namespace) -> int:
    """Load FILE as the worker would; print the policy in force per agent match (exit 0), or
    the one-line problem (exit 2)."""
    import yaml

    policy = Policy.load(args.file)
    rules = len(policy.rules)
    print(f"# {args.file}: valid; the defaults and {rules} agent rule{'s' * (rules != 1)},"
          " every setting in force written out (first match wins)")  # fmt: skip
    document = policy.effective()
    print(yaml.safe_dump(document, sort_keys=False, default_flow_style=None, width=100), end="")
    return 0


def _add_settings_flags(parser: argparse.ArgumentParser, *owners: str) -> None:
    """One flag per setting of the registry (settings of `owners`); unset flags fall back to
    their environment variables, then to the defaults."""
    from spanguard.settings import REGISTRY

    for entry in REGISTRY:
        if entry.owner not in owners or entry.flag is None:
            continue  # secrets: never on a command line, where `ps` shows them
        if entry.owner == "KafkaSecurity":
            continue  # their own group, below
        default = "none" if entry.default is None else entry.default
        if isinstance(entry.default, bool):
            default = "on" if entry.default else "off"
        help = f"{entry.help} (${entry.env}; default {default})"
        if entry.kind is bool:  # --name / --no-name; neither: the variable, then the default
            parser.add_argument(
                entry.flag,
                dest=f"{entry.owner}.{entry.name}",
                default=None,
                action=argparse.BooleanOptionalAction,
                help=help,
            )
            continue
        parser.add_argument(
            entry.flag,
            dest=f"{entry.owner}.{entry.name}",
            default=None,
            choices=entry.choices,
            metavar="HOST:PORT" if entry.name == "bootstrap" else entry.name.split("_")[-1].upper(),
            help=help,
        )
    from spanguard.kafka_security import add_flags

    add_flags(parser)


def _flags(args: argparse.Namespace, owner: str) -> dict[str, str]:
    prefix = owner + "."
    return {k.removeprefix(prefix): v for k, v in vars(args).items() if k.startswith(prefix)}


def _settings(args: argparse.Namespace):
    from spanguard.settings import WorkerSettings

    # The Kafka connection flags (--kafka-*) are the worker's too: one security for every client.
    kafka = {k: v for k, v in vars(args).items() if k.startswith("kafka_")}
    return WorkerSettings.from_sources(_flags(args, "WorkerSettings") | kafka)


def _cmd_worker(args: argparse.Namespace) -> int:
    from spanguard.settings import GoalSettings, PagerSettings, WebhookSettings

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
    goal = GoalSettings.from_sources(_flags(args, "GoalSettings"))
    pager_flags = _flags(args, "PagerSettings")
    pager = (
        PagerSettings.from_sources(pager_flags) if PagerSettings.configured(pager_flags) else None
    )
    webhook_flags = _flags(args, "WebhookSettings")
    webhook = (
        WebhookSettings.from_sources(webhook_flags)
        if WebhookSettings.configured(webhook_flags)
        else None
    )
    policy = _load_policy(settings.policy)  # bad settings or a bad policy stop here, before Kafka
    settings.kill_signing_key()  # signed by default: no key (and no opt-out) stops here too
    return run_worker(settings, policy, goal, pager, webhook)


def _cmd_topics_create(args: argparse.Namespace) -> int:
    from confluent_kafka import KafkaException

    from spanguard.streams.topics import create_topics

    settings = _settings(args)
    try:
        replication, outcomes = create_topics(settings)
    except (KafkaException, ValueError) as exc:
        print(f"spanguard topics create: {exc}", file=sys.stderr)
        return 1
    print(f"spanguard topics create: {replication.describe()}")
    for name, outcome in outcomes.items():
        print(f"{name}: {outcome}")
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    import json

    from spanguard.detection.explain import explain_records
    from spanguard.streams.audit import read_decisions

    settings = _settings(args)
    trace_id = args.trace_id.lower()
    scan = read_decisions(settings.bootstrap, settings.detections_topic, trace_id, args.timeout)
    if not scan.records:
        print(
            f"spanguard explain: no decision for trace {trace_id} in {settings.detections_topic}"
            f" ({scan.scanned} records read)",
            file=sys.stderr,
        )
        return 1
    if args.json:
        for record in scan.records:
            print(json.dumps(record, sort_keys=True))
    else:
        sys.stdout.write(explain_records(trace_id, scan.records))
    return 0


def _add_explain_parser(commands: argparse._SubParsersAction) -> None:
    from spanguard.settings import REGISTRY

    explain = commands.add_parser(
        "explain",
        help="why was this trace's agent killed: its decisions and their evidence",
        description=(
            "Read the detections topic and print the trace's decisions with their evidence:"
            " the window when the rule tripped (tool names, hash prefixes, span ids, times),"
            " the policy entry in force and its threshold. Exit 1 if there is none."
        ),
    )
    explain.add_argument("trace_id", metavar="TRACE_ID", help="32 hex digits")
    for entry in REGISTRY:  # only the two worker settings explain needs, env vars honoured
        if entry.owner == "WorkerSettings" and entry.name in ("bootstrap", "detections_topic"):
            explain.add_argument(
                entry.flag,
                dest=f"{entry.owner}.{entry.name}",
                default=None,
                metavar="HOST:PORT" if entry.name == "bootstrap" else "TOPIC",
                help=f"{entry.help} (${entry.env}; default {entry.default})",
            )
    explain.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to read the topic (default 30)"
    )
    explain.add_argument("--json", action="store_true", help="print the records as JSON lines")
    explain.set_defaults(handler=_cmd_explain)


def _cmd_manual(args: argparse.Namespace) -> int:
    """`spanguard kill` / `spanguard release`: a signed signal and its audit record."""
    import re

    from confluent_kafka import KafkaException

    from spanguard.streams.manual import manual_decision, publish_manual

    trace_id = args.trace_id.lower()
    if not re.fullmatch(r"[0-9a-f]{32}", trace_id):
        print(f"spanguard {args.command}: {args.trace_id!r} is not a trace id (32 hex digits)",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    operator = args.operator or _login()
    reason = args.reason or f"released by {operator}"
    settings = _settings(args)
    decision = manual_decision(trace_id, args.command, reason, operator)
    try:
        signal = publish_manual(settings, decision)
    except KafkaException as exc:
        print(f"spanguard {args.command}: not sent: {exc}", file=sys.stderr)
        return 1
    print(f"{args.command}: trace {trace_id} signal {signal.signal_id} by {operator}"
          f" on {settings.kill_topic}")  # fmt: skip
    return 0


def _login() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no user name in the environment or the password database
        return "unknown"


def _add_manual_parsers(commands: argparse._SubParsersAction) -> None:
    for name, help in (
        ("kill", "kill a trace's agent now: a signed kill signal, recorded with who sent it"),
        ("release", "lift a kill: the trace's agent may call tools again"),
    ):
        command = commands.add_parser(
            name,
            help=help,
            description=(
                f"{help}. Publishes to the kill topic, signed with the worker's signing key,"
                " and writes an audit record (rule manual, the operator) to the detections"
                " topic. A later kill, manual or detected, kills the trace again"
                + (
                    ": the workers re-arm the released trace's loop rules, so the same loop"
                    " repeated kills it again (its token budget stays spent)."
                    if name == "release"
                    else "."
                )
            ),
        )
        command.add_argument("trace_id", metavar="TRACE_ID", help="32 hex digits")
        command.add_argument(
            "--reason",
            required=name == "kill",
            metavar="TEXT",
            help="why (shown to the agent and in the audit)",
        )
        command.add_argument(
            "--operator", metavar="NAME", help="who issues it (default: the login name)"
        )
        _add_settings_flags(command, "WorkerSettings")
        command.set_defaults(handler=_cmd_manual)


def _kind(exc: SpanguardError) -> str:
    if isinstance(exc, PolicyError):
        return "bad policy: "
    if isinstance(exc, SettingsError):
        return "bad setting: "
    return ""


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
            " other files (and - for stdin) hold OTLP/JSON, one request a line. A broken line"
            " or file is reported on stderr (file:line) and skipped. Exit status: 0 every"
            " input read, 1 some were skipped, 2 a bad policy or an unreadable file."
        ),
    )
    replay.add_argument("paths", nargs="+", metavar="PATH", help="input files, - for stdin")
    replay.add_argument("--policy", metavar="FILE", help="policy YAML (default: built-in defaults)")
    replay.add_argument(
        "--html",
        metavar="FILE",
        help="also write one self-contained HTML page with a timeline per tripped trace",
    )
    replay.set_defaults(handler=_cmd_replay)

    worker = commands.add_parser(
        "worker",
        help="run the streaming guard: OTLP spans from Kafka in, kill signals out",
        description="Consume OTLP spans from Kafka, keep per-trace state, publish decisions.",
    )
    _add_settings_flags(
        worker, "WorkerSettings", "GoalSettings", "PagerSettings", "WebhookSettings"
    )
    worker.set_defaults(handler=_cmd_worker)

    topics = commands.add_parser("topics", help="manage the Kafka topics spanguard uses")
    topic_commands = topics.add_subparsers(dest="topics_command", required=True, metavar="ACTION")
    create = topic_commands.add_parser(
        "create", help="create the input, output, dead-letter and state topics"
    )
    _add_settings_flags(create, "WorkerSettings")
    create.set_defaults(handler=_cmd_topics_create)
    _add_explain_parser(commands)
    _add_manual_parsers(commands)

    policy = commands.add_parser("policy", help="check a policy file")
    policy_commands = policy.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    check = policy_commands.add_parser(
        "check",
        help="validate a policy file and print the settings in force per agent match",
        description=(
            "Load FILE exactly as the worker and replay do. Valid: print the effective policy"
            " (the defaults and each agent rule with every setting written out, itself a valid"
            " policy file) and exit 0. Invalid: one line naming the field, exit 2."
        ),
    )
    check.add_argument("file", metavar="FILE", help="the policy YAML")
    check.set_defaults(handler=_cmd_policy_check)
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
    except SpanguardError as exc:
        # Bad input or configuration: one line that says what and where, no traceback.
        message = " ".join(str(exc).split())  # one line, whatever the message held
        print(f"spanguard {args.command}: {_kind(exc)}{message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
