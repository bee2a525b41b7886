"""The `spanguard` command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from spanguard import __version__
from spanguard.config.policy_file import load_policy
from spanguard.errors import BacktestError, PolicyError, SettingsError, SpanguardError
from spanguard.schemas.policy import Policy

if TYPE_CHECKING:
    from spanguard.schemas.decision import KillSignal

EXIT_USAGE = 2


def _load_policy(path: str | None) -> Policy:
    return load_policy(path) if path else Policy()


EXIT_SKIPPED = 1  # replay: every input read, but some broken lines or files were skipped


def _cmd_replay(args: argparse.Namespace) -> int:
    from spanguard.cli.replay import replay

    result = replay(args.paths, _load_policy(args.policy), html=args.html)
    return EXIT_SKIPPED if result.skipped else 0


def _cmd_policy_check(args: argparse.Namespace) -> int:
    """Load FILE as the worker would; print the policy in force per agent match (exit 0), or
    the one-line problem (exit 2)."""
    import yaml

    policy = load_policy(args.file)
    rules = len(policy.rules)
    print(f"# {args.file}: valid; the defaults and {rules} agent rule{'s' * (rules != 1)},"
          " every setting in force written out (first match wins)")  # fmt: skip
    document = policy.effective()
    print(yaml.safe_dump(document, sort_keys=False, default_flow_style=None, width=100), end="")
    return 0


def _add_settings_flags(parser: argparse.ArgumentParser, *owners: str) -> None:
    """One flag per setting of the registry (settings of `owners`); unset flags fall back to
    their environment variables, then to the defaults."""
    from spanguard.config.settings import REGISTRY

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
    from spanguard.config.kafka_security import add_flags

    add_flags(parser)


def _flags(args: argparse.Namespace, owner: str) -> dict[str, str]:
    prefix = owner + "."
    return {k.removeprefix(prefix): v for k, v in vars(args).items() if k.startswith(prefix)}


def _settings(args: argparse.Namespace):
    from spanguard.config.settings import WorkerSettings

    # The Kafka connection flags (--kafka-*) are the worker's too: one security for every client.
    kafka = {k: v for k, v in vars(args).items() if k.startswith("kafka_")}
    return WorkerSettings.from_sources(_flags(args, "WorkerSettings") | kafka)


def _cmd_worker(args: argparse.Namespace) -> int:
    from spanguard.config.settings import GoalSettings, PagerSettings, WebhookSettings

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

    from spanguard.connectors.topics import create_topics

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

    from spanguard.connectors.audit import read_decisions
    from spanguard.detection.explain import explain_records

    settings = _settings(args)
    if args.tool is not None:
        return _explain_tool(settings, args)
    if args.server is not None:
        print("spanguard explain: --server goes with --tool NAME", file=sys.stderr)
        return 2
    if args.trace_id is None:
        print("spanguard explain: give a TRACE_ID, or --tool NAME", file=sys.stderr)
        return 2
    trace_id = args.trace_id.lower()
    scan = read_decisions(
        settings.bootstrap, settings.kafka, settings.detections_topic, trace_id, args.timeout
    )
    if not scan.records:
        print(
            f"spanguard explain: no decision for trace {trace_id} in {settings.detections_topic}"
            f" ({scan.scanned} records read)",
            file=sys.stderr,
        )
        return 1
    acks = _read_acks(settings, trace_id, args.timeout)
    if args.json:
        for record in scan.records:
            print(json.dumps(record, sort_keys=True))
    else:
        text = explain_records(trace_id, scan.records, acks, ack_within=args.ack_within)
        sys.stdout.write(text)
    return 0


def _explain_tool(settings: Any, args: argparse.Namespace) -> int:
    """`explain --tool NAME [--server S]`: the tool's fleet incidents, open and recovered.
    No incident is an answer, not an error: exit 0 and say so."""
    import json

    from spanguard.connectors.audit import read_tool_incidents
    from spanguard.detection.explain import explain_tool_incidents

    if args.trace_id is not None:
        print("spanguard explain: a TRACE_ID or --tool, not both", file=sys.stderr)
        return 2
    scan = read_tool_incidents(
        settings.bootstrap,
        settings.kafka,
        settings.detections_topic,
        args.tool,
        args.server,
        args.timeout,
    )
    if args.json:
        for record in scan.records:
            print(json.dumps(record, sort_keys=True))
        return 0
    text = explain_tool_incidents(args.tool, scan.records)
    if not scan.records:
        at = f" at {args.server}" if args.server else ""
        text = (
            f"spanguard explain: no fleet incident on {args.tool}{at} in"
            f" {settings.detections_topic} ({scan.scanned} records read)\n"
        )
    sys.stdout.write(text)
    return 0


def _read_acks(settings: Any, trace_id: str, timeout: float) -> list[dict[str, Any]] | None:
    """The agents' acks of the trace, each with `_signature` (see spanguard.killswitch.acks);
    None, with a note on stderr, when the ack topic cannot be read."""
    from spanguard.config.secrets import signing_keys_from_env
    from spanguard.connectors.audit import read_decisions
    from spanguard.errors import AuditReadError, SecretError
    from spanguard.killswitch.acks import ack_status
    from spanguard.schemas.decision import keyring

    try:
        scan = read_decisions(
            settings.bootstrap, settings.kafka, settings.ack_topic, trace_id, timeout
        )
    except AuditReadError as exc:
        print(f"spanguard explain: no acks read: {exc}", file=sys.stderr)
        return None
    try:
        keys = keyring(signing_keys_from_env()) or None
    except SecretError:
        keys = None
    acks = [record for record in scan.records if record.get("kind") == "ack"]
    for ack in acks:
        ack["_signature"] = ack_status(ack, keys)
    return acks


def _add_worker_flags(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    """The few worker settings a reading command needs, as the worker's flags (env vars
    honoured; metavar: HOST:PORT or the name's last word, TOPIC or TTL)."""
    from spanguard.config.settings import REGISTRY

    for entry in REGISTRY:
        if entry.owner == "WorkerSettings" and entry.name in names and entry.flag is not None:
            parser.add_argument(
                entry.flag,
                dest=f"{entry.owner}.{entry.name}",
                default=None,
                metavar="HOST:PORT"
                if entry.name == "bootstrap"
                else entry.name.split("_")[-1].upper(),
                help=f"{entry.help} (${entry.env}; default {entry.default})",
            )


def _add_explain_parser(commands: argparse._SubParsersAction) -> None:
    from spanguard.config.kafka_security import add_flags

    explain = commands.add_parser(
        "explain",
        help="why was this trace's agent killed: its decisions and their evidence",
        description=(
            "Read the detections topic and print the trace's decisions with their evidence:"
            " the window when the rule tripped (tool names, hash prefixes, span ids, times),"
            " the policy entry in force and its threshold, and whether an agent acknowledged"
            " obeying each kill or downgrade (the ack topic). Exit 1 if there is none."
            " With --tool NAME: the tool's fleet incidents instead."
        ),
    )
    explain.add_argument("trace_id", metavar="TRACE_ID", nargs="?", help="32 hex digits")
    explain.add_argument(
        "--tool",
        metavar="NAME",
        help="instead of a trace: the tool's fleet incidents (open and recovered), with their"
        " figures, traces and agents",
    )
    explain.add_argument(
        "--server", metavar="S", help="with --tool: only the incidents of this server"
    )
    _add_worker_flags(explain, ("bootstrap", "detections_topic", "ack_topic"))
    explain.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to read the topic (default 30)"
    )
    explain.add_argument(
        "--ack-within",
        type=float,
        default=10.0,
        help="seconds after which a kill or downgrade no agent acknowledged counts as not"
        " obeyed (default 10)",
    )
    explain.add_argument("--json", action="store_true", help="print the records as JSON lines")
    add_flags(explain)
    explain.set_defaults(handler=_cmd_explain)


def _parse_time(text: str, flag: str) -> float:
    """--from/--to: ISO 8601 (UTC unless it names its offset), as epoch seconds."""
    from datetime import UTC, datetime

    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise BacktestError(
            f"{flag} {text!r} is not an ISO 8601 time (e.g. 2026-11-26T09:00:00Z)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _parse_duration(text: str, flag: str, units: str, examples: str) -> float:
    """A flag's positive duration such as 90s, 30m, 12h, 2d or 1w in seconds, its unit one of
    `units`; a ValueError names the flag and `examples` of what it takes."""
    import re

    match = re.fullmatch(rf"\s*(\d+(?:\.\d+)?)\s*([{units}])\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"{flag} {text!r} is not a duration such as {examples}")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def _parse_since(text: str) -> float:
    """--since: a duration such as 7d, 12h, 30m or 90s, in seconds."""
    try:
        return _parse_duration(text, "--since", "smhdw", "7d, 12h, 30m or 90s")
    except ValueError as exc:
        raise BacktestError(str(exc)) from None


def _cmd_backtest(args: argparse.Namespace) -> int:
    import json
    import time
    from pathlib import Path

    from spanguard.cli.report import render_backtest_html
    from spanguard.detection.backtest import Backtest, format_report

    settings = _settings(args)
    now = time.time()
    if args.since is not None and args.start is not None:
        raise BacktestError("give --since or --from, not both")
    if args.since is None and args.start is None:
        raise BacktestError("give the history to read: --since 7d, or --from TIME [--to TIME]")
    start = now - _parse_since(args.since) if args.since is not None else 0.0
    if args.start is not None:
        start = _parse_time(args.start, "--from")
    end = _parse_time(args.end, "--to") if args.end is not None else None
    if end is not None and end <= start:
        raise BacktestError("--to must be after the start of the history read")
    if start >= now:
        raise BacktestError("the start of the history read is in the future")
    if args.max_traces < 1:
        raise BacktestError("--max-traces must be at least 1")
    current_path = args.against or settings.policy
    new_policy = load_policy(args.policy)
    current_policy = _load_policy(current_path)  # bad policies stop here, before Kafka
    backtest = Backtest(
        new_policy,
        current_policy,
        state_ttl=settings.state_ttl,
        max_traces=args.max_traces,
        timelines=args.html is not None,
        new_name=args.policy,
        current_name=current_path or "the built-in defaults",
    )
    from spanguard.connectors.backtest import describe_plan, read_history

    def said(plan) -> None:
        for line in describe_plan(plan, int(start * 1000)):
            print(line, file=sys.stderr)

    read_history(
        settings.bootstrap,
        settings.kafka,
        settings.input_topic,
        int(start * 1000),
        int(end * 1000) if end is not None else None,
        backtest,
        on_plan=said,
    )
    report = backtest.finish()
    if args.json:
        print(json.dumps(report.to_dict(), sort_keys=True))
    else:
        sys.stdout.write(format_report(report))
    if args.html:
        try:
            Path(args.html).write_text(render_backtest_html(report), encoding="utf-8")
        except OSError as exc:
            raise BacktestError(f"{args.html}: cannot write the page: {exc.strerror}") from None
        print(f"backtest: wrote {args.html} ({len(report.kept)} changed traces)", file=sys.stderr)
    return 0


def _add_backtest_parser(commands: argparse._SubParsersAction) -> None:
    from spanguard.config.kafka_security import add_flags
    from spanguard.detection.backtest import DEFAULT_MAX_TRACES

    backtest = commands.add_parser(
        "backtest",
        help="what a new policy would have decided on the spans the topic still holds",
        description=(
            "Read the spans topic's retained history (every partition, from the first record at"
            " or after the start; no consumer group, nothing committed: the worker is untouched)"
            " through the guard under the new policy and under the current one, and report the"
            " decisions added and removed per agent, rule and action, the traces concerned and,"
            " where a budget is tracked, the tokens spent after each decision. Memory stays"
            " bounded: idle traces are evicted after --state-ttl in record time, at most"
            " --max-traces are held. Exit status: 0 read and compared, 1 Kafka did not answer,"
            " 2 bad usage (a bad policy, a bad time, a missing topic)."
        ),
    )
    backtest.add_argument("--policy", required=True, metavar="NEW.yaml", help="the new policy")
    backtest.add_argument(
        "--against",
        metavar="CURRENT.yaml",
        help="the policy in force (default: $SPANGUARD_POLICY, else the built-in defaults)",
    )
    backtest.add_argument("--since", metavar="DURATION", help="e.g. 7d, 12h, 30m: up to now")
    backtest.add_argument("--from", dest="start", metavar="TIME", help="ISO 8601 start (UTC)")
    backtest.add_argument("--to", dest="end", metavar="TIME", help="ISO 8601 end (default: now)")
    backtest.add_argument(
        "--max-traces",
        type=int,
        default=DEFAULT_MAX_TRACES,
        metavar="N",
        help=f"traces held at once; beyond, the oldest are evicted early (default {DEFAULT_MAX_TRACES:,})",
    )
    backtest.add_argument("--json", action="store_true", help="print the report as one JSON object")
    backtest.add_argument(
        "--html", metavar="FILE", help="also write a page with a timeline per changed trace"
    )
    _add_worker_flags(backtest, ("bootstrap", "input_topic", "state_ttl"))
    add_flags(backtest)
    backtest.set_defaults(handler=_cmd_backtest)


def _cmd_manual(args: argparse.Namespace) -> int:
    """`spanguard kill` / `spanguard release`: a signed signal and its audit record."""
    import re

    from spanguard.connectors.manual import manual_decision, publish_manual
    from spanguard.killswitch.client import parse_agent
    from spanguard.schemas.decision import MAX_CONVERSATION_ID_CHARS

    named = [args.trace_id, args.conversation, args.agent, getattr(args, "tool", None)]
    if sum(value is not None for value in named) != 1:
        tool = " or --tool NAME" if args.command == "release" else ""
        print(f"spanguard {args.command}: name one of TRACE_ID, --conversation ID,"
              f" --agent SERVICE[/NAME]{tool}", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    if getattr(args, "tool", None) is not None:
        return _cmd_tool(args)
    trace_id = args.trace_id.lower() if args.trace_id is not None else None
    agent = None
    if trace_id is not None and not re.fullmatch(r"[0-9a-f]{32}", trace_id):
        print(f"spanguard {args.command}: {args.trace_id!r} is not a trace id (32 hex digits)",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    if args.conversation is not None and not (
        0 < len(args.conversation) <= MAX_CONVERSATION_ID_CHARS
    ):
        print(f"spanguard {args.command}: a conversation id has 1 to"
              f" {MAX_CONVERSATION_ID_CHARS} characters", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    if args.agent is not None:
        try:
            agent = parse_agent(args.agent)
        except ValueError as exc:
            print(f"spanguard {args.command}: {exc}", file=sys.stderr)
            return EXIT_USAGE
    operator = args.operator or _login()
    reason = args.reason or f"released by {operator}"
    settings = _settings(args)
    decision = manual_decision(
        trace_id, args.command, reason, operator, conversation_id=args.conversation, agent=agent
    )
    return _send(args, settings, operator, lambda: publish_manual(settings, decision))


def _send(
    args: argparse.Namespace, settings: Any, operator: str, publish: Callable[[], KillSignal]
) -> int:
    """Publish an operator's signal (`publish` returns it) and say what was sent: 0, or 1 when
    Kafka did not acknowledge it."""
    from confluent_kafka import KafkaException

    try:
        signal = publish()
    except KafkaException as exc:
        print(f"spanguard {args.command}: not sent: {exc}", file=sys.stderr)
        return 1
    # A kill of a scope (a conversation, an agent, a tool) lasts until the signal expires.
    scoped_kill = signal.kind == "kill" and signal.stops != "trace"
    until = f" until {signal.expires_at}" if scoped_kill else ""
    print(f"{args.command}: {signal.describe_target()} signal {signal.signal_id} by {operator}"
          f" on {settings.kill_topic}{until}")  # fmt: skip
    return 0


def _cmd_tool(args: argparse.Namespace) -> int:
    """`spanguard contain --tool` / `spanguard release --tool`: a signed tool signal and its
    audit record."""
    import uuid
    from datetime import UTC, datetime, timedelta

    from spanguard.connectors.manual import manual_tool_decision, publish_signal
    from spanguard.schemas.decision import DEFAULT_CONTAIN_SECONDS, tool_signal

    kind: Literal["kill", "release"] = "kill" if args.command == "contain" else "release"
    try:
        seconds = (
            _parse_duration(args.duration, "--for", "smhd", "1h, 30m, 90s or 2d")
            if kind == "kill"
            else DEFAULT_CONTAIN_SECONDS
        )
    except ValueError as exc:
        print(f"spanguard {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    operator = args.operator or _login()
    now = datetime.now(UTC)
    try:
        signal = tool_signal(
            args.tool,
            args.server or "",
            "manual",
            args.reason or f"released by {operator}",
            uuid.uuid4().hex,
            (now + timedelta(seconds=seconds)).isoformat(timespec="milliseconds"),
            kind=kind,
            detected_at=now.isoformat(timespec="milliseconds"),
            operator=operator,
        )
    except ValueError as exc:
        print(f"spanguard {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    settings = _settings(args)
    audit = manual_tool_decision(signal, operator)
    return _send(args, settings, operator, lambda: publish_signal(settings, signal, audit))


def _add_contain_parser(commands: argparse._SubParsersAction) -> None:
    help = "contain a tool: every agent's calls to it are refused, the agents go on"
    contain = commands.add_parser(
        "contain",
        help=help,
        description=(
            f"{help} (each client raises ToolContained, which the framework adapters hand to"
            " the model as the tool's error; the gateway guardrail takes the tool out of the"
            " requests). Publishes a signed tool signal to the kill topic, and its audit record"
            " to the detections topic; it lasts --for, or until `spanguard release --tool NAME`."
        ),
    )
    contain.add_argument("--tool", required=True, metavar="NAME", help="the tool's name")
    contain.add_argument(
        "--server",
        metavar="SERVER",
        help="its server (an MCP server's name); without it, the tool on every server",
    )
    contain.add_argument(
        "--for",
        dest="duration",
        default="1h",
        metavar="DURATION",
        help="how long the contain lasts, e.g. 30m, 1h, 2d (default 1h)",
    )
    contain.add_argument(
        "--reason", required=True, metavar="TEXT", help="why (shown to the model and the agent)"
    )
    contain.add_argument(
        "--operator", metavar="NAME", help="who issues it (default: the login name)"
    )
    _add_settings_flags(contain, "WorkerSettings")
    contain.set_defaults(handler=_cmd_tool)


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
        command.add_argument(
            "trace_id", metavar="TRACE_ID", nargs="?", help="32 hex digits (or a scope below)"
        )
        command.add_argument(
            "--conversation",
            metavar="ID",
            help=f"{name} every trace of this conversation (gen_ai.conversation.id / session.id)",
        )
        command.add_argument(
            "--agent",
            metavar="SERVICE[/NAME]",
            help=f"{name} every trace of this agent (service.name, gen_ai.agent.name; without"
            " /NAME every agent of the service); a kill lasts the signal TTL",
        )
        if name == "release":
            command.add_argument(
                "--tool", metavar="NAME", help="lift the contain of this tool (spanguard contain)"
            )
            command.add_argument(
                "--server", metavar="SERVER", help="with --tool: the server its contain named"
            )
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
    _add_backtest_parser(commands)
    _add_manual_parsers(commands)
    _add_contain_parser(commands)

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
