"""The docs name only what exists: in README.md and docs/*.md every repository path, link and
anchor, `spanguard.*` module (or module attribute), `make` target, `spanguard` command and
flag, and `SPANGUARD_*` setting is checked against the tree, the Makefile, the CLI's own
argparse parser and the settings registry. A docs section cited in the code exists. Values
restated outside the code are compared with it: the state version docs/rules.md gives, and the
rule lists of the TypeScript and Go killswitch clients and of schemas/decision.py against the
schemas' `rule` enums.

Import names map to folders through the layout table of docs/design.md ("Layout"), so a module
is looked for where the documented layout puts it. `python -m tests.test_docs` prints how many
references of each kind the docs hold.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import re
import unicodedata
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from tests.support.python_source import parse_python

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

# Variables the docs name that are not settings of the registry: each is read by a test
# harness, the Collector's configuration or the killswitch's key rotation, and must occur in
# a source file of the repository.
OTHER_VARIABLES = {
    "SPANGUARD_PREVIOUS_SIGNING_KEY": "the agents' second key while the signing key rotates",
    "SPANGUARD_TEST_BOOTSTRAP": "the tests' own Kafka cluster",
    "SPANGUARD_TEST_STEP_DELAY": "the looping agent's step time in the agent matrix",
    "SPANGUARD_FIXTURE_VENVS": "where the fixture agents' virtualenvs live",
    "SPANGUARD_COLLECTOR_QUEUE_DIR": "the Collector's on-disk sending queue",
    "SPANGUARD_COMPILE": "setup.py compiling the detection core (the worker image)",
    "SPANGUARD_ALLOW_UNTESTED_FAUST": "read at import, before any setting: the worker on"
    " Faust, mode or aiokafka versions its internals were not written for",
}
SOURCE_SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".go", ".ts", ".tpl", ".json", ".toml"}
SKIPPED_DIRS = {".venv", "node_modules", ".git", "__pycache__", "build"}


# -- reading the docs ---------------------------------------------------------------------------


def split_fences(text: str) -> tuple[str, list[str]]:
    """The prose (fenced blocks blanked out) and the fenced blocks' bodies."""
    blocks: list[str] = []

    def take(match: re.Match[str]) -> str:
        blocks.append(match.group(1))
        return "\n"

    prose = re.sub(r"^```[^\n]*\n(.*?)^```", take, text, flags=re.S | re.M)
    return prose, blocks


def code_spans(prose: str) -> list[str]:
    """Inline code; a span may run over a line break, which reads as a space (CommonMark)."""
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]


def command_lines(text: str) -> list[str]:
    """Code spans, and the lines of fenced blocks with their `\\` continuations joined."""
    prose, blocks = split_fences(text)
    lines = list(code_spans(prose))
    for block in blocks:
        lines.extend(block.replace("\\\n", " ").splitlines())
    return lines


def links(prose: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", prose)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    text = heading.strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in ("L", "N"))
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_fences(path.read_text())
    return {slug(m) for m in re.findall(r"^#{1,6} +(.+?) *$", prose, flags=re.M)}


# -- the layout ---------------------------------------------------------------------------------


@cache
def layout() -> dict[str, str]:
    """Import name -> folder, from docs/design.md's layout table (`folder | import name | holds`)."""
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w-]+)/` \| `(spanguard(?:\.\w+)?)` \|", section, flags=re.M)
    return {name: folder for folder, name in rows}


def top_level_entries() -> set[str]:
    """What a repository path may start with: the tree's entries and the layout's folders."""
    return {p.name for p in ROOT.iterdir()} | set(layout().values())


def module_file(parts: list[str]) -> Path | None:
    """The file of `spanguard.<parts>` under the documented layout, or None."""
    packages = layout()
    if len(parts) > 1 and ".".join(parts[:2]) in packages:
        folder, rest = ROOT / packages[".".join(parts[:2])], parts[2:]
    else:
        folder, rest = ROOT / packages["spanguard"], parts[1:]
    base = folder.joinpath(*rest)
    for candidate in (base.with_suffix(".py") if rest else None, base / "__init__.py"):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


def defined_names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    names: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.If | ast.Try):  # guarded definitions
            names.update(defined_names(node.body))
    return names


def module_exists(name: str) -> bool:
    """`spanguard.a.b` is a module, or a module's attribute (`Class` or `Class.member`)."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        path = module_file(parts[:split])
        if path is not None:
            break
    else:
        return False
    scope = defined_names(parse_python(path).body)
    for attribute in parts[split:]:
        node = scope.get(attribute)
        if node is None:
            return False
        scope = defined_names(node.body) if isinstance(node, ast.ClassDef) else {}
    return True


@cache
def source_strings() -> frozenset[str]:
    """Every string constant of the package's source: span attributes, headers and span names
    the code writes are named like modules (`spanguard.tool.args_hash`)."""
    found: set[str] = set()
    for folder in set(layout().values()):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(parse_python(path)):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.add(node.value)
    return frozenset(found)


@cache
def source_text() -> str:
    """The repository's source and configuration files (not the docs), as one text."""
    texts = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and Path(folder, d) != ROOT / "docs"]
        for name in files:
            path = Path(folder, name)
            if path == Path(__file__):
                continue  # this file names them all
            if path.suffix in SOURCE_SUFFIXES or name == "Makefile":
                texts.append(path.read_text(errors="replace"))
    return "\n".join(texts)


# -- the checks: each returns what it found wrong -----------------------------------------------


PATH_TOKEN = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")


def wrong_paths(doc: Path, text: str) -> Iterator[str]:
    """Backticked repository paths must exist; relative links too, with their anchors."""
    prose, blocks = split_fences(text)
    roots = top_level_entries()
    for span in code_spans(prose) + [line for block in blocks for line in block.splitlines()]:
        for token in span.split():
            token = token.strip("\"'(),;:")
            if "/" not in token or not PATH_TOKEN.match(token):
                continue
            if token.split("/")[0] not in roots:
                continue  # not a repository path: /run/secrets/kafka, ~/.cache, a URL's path
            if not (ROOT / token).exists():
                yield f"{doc.name}: `{token}` does not exist"
    for target in links(prose):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists():
            yield f"{doc.name}: link ({target}) does not exist"
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            yield f"{doc.name}: link ({target}) has no heading #{anchor}"


# Not a file path's part (helm/spanguard.json) nor a Go import path (spanguard.dev/killswitch).
MODULE_NAME = re.compile(r"(?<![\w./-])spanguard(?:\.[A-Za-z_]\w*)+(?![\w/])")


def wrong_modules(doc: Path, text: str) -> Iterator[str]:
    for name in sorted(set(MODULE_NAME.findall(text))):
        if not module_exists(name) and name not in source_strings():
            yield f"{doc.name}: {name} is neither a module, a module's attribute nor a name the code writes"


@cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    targets: set[str] = set()
    for line in re.findall(r"^([\w .-]+?)\s*:(?!=)", text, flags=re.M):
        targets.update(line.split())
    return frozenset(targets)


def wrong_make_targets(doc: Path, text: str) -> Iterator[str]:
    for line in command_lines(text):
        for target in re.findall(r"(?:^|[\s`(;&|])make ([a-z][\w-]*)", line):
            if target not in make_targets():
                yield f"{doc.name}: `make {target}` is not a Makefile target"


@cache
def cli_parser() -> argparse.ArgumentParser:
    """The `spanguard` command's parser, built without running anything (the entry point's
    module as the documented layout names it)."""
    module = importlib.import_module(
        "spanguard.cli.main"
        if (ROOT / layout()["spanguard.cli"] / "main.py").is_file()
        else "spanguard.cli"
    )
    return module.build_parser()


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def spanguard_commands(line: str) -> Iterator[list[str]]:
    """The words after each `spanguard` that starts a command of the line."""
    for segment in re.split(r"&&|;|\|(?!\w)", line):
        words = segment.split()
        for i, word in enumerate(words):
            if word == "spanguard" and all(w == "$" or ENV_ASSIGNMENT.match(w) for w in words[:i]):
                rest = words[i + 1 :]
                if "#" in rest:
                    rest = rest[: rest.index("#")]
                yield rest
                break


def wrong_commands(doc: Path, text: str) -> Iterator[str]:
    for line in command_lines(text):
        for words in spanguard_commands(line):
            parser, path = cli_parser(), ["spanguard"]
            for word in words:
                word = word.strip("[]:,.")
                if not word:
                    continue
                if word.startswith("-"):
                    flag = word.split("=", 1)[0]
                    if "<" in flag or "*" in flag:  # a family: --kafka-<name>
                        stem = re.split(r"[<*]", flag, maxsplit=1)[0]
                        found = any(option.startswith(stem) for option in options(parser))
                    else:
                        found = flag in options(parser)
                    if not found:
                        yield f"{doc.name}: `{' '.join(path)} {flag}` is not a flag of that command"
                elif word in subcommands(parser):
                    parser = subcommands(parser)[word]
                    path.append(word)
                elif len(path) == 1 or subcommands(parser):
                    yield f"{doc.name}: `{' '.join(path)} {word}` is not a command"
                    break
                # else: a positional argument (a trace id, a file)


def registry_variables() -> tuple[set[str], set[str]]:
    from spanguard.config.settings import REGISTRY

    names = {entry.env for entry in REGISTRY}
    files = {f"{entry.env}_FILE" for entry in REGISTRY if entry.secret}
    return names, files


def wrong_variables(doc: Path, text: str) -> Iterator[str]:
    names, files = registry_variables()
    for match in re.finditer(r"SPANGUARD_[A-Z0-9_]*", text):
        variable = match.group()
        if variable.endswith("_"):  # a family: SPANGUARD_KAFKA_<NAME>, SPANGUARD_JUDGE_*
            if not any(name.startswith(variable) for name in names):
                yield f"{doc.name}: no setting is named {variable}..."
        elif variable in OTHER_VARIABLES:
            if variable not in source_text():
                yield f"{doc.name}: {variable} ({OTHER_VARIABLES[variable]}) is read nowhere"
        elif variable not in names and variable not in files:
            yield f"{doc.name}: {variable} is not a setting of config/settings.py"


def wrong_citations() -> Iterator[str]:
    """A citation in the code (the docs file, then the section's title in quotes) names a
    file and a heading that exist."""
    cited = re.compile(r'docs/([\w-]+\.md)(?:,\s*(?:#\s*)?"([^"]+)")?')
    for folder in set(layout().values()) | {"tests", "bench", "scripts"}:
        for path in (ROOT / folder).rglob("*.py"):
            text = re.sub(r"\s+", " ", path.read_text())
            for file_name, section in cited.findall(text):
                doc = ROOT / "docs" / file_name
                where = path.relative_to(ROOT)
                if not doc.is_file():
                    yield f"{where} cites docs/{file_name}, which does not exist"
                elif section and slug(section) not in anchors(doc):
                    yield f'{where} cites docs/{file_name}, "{section}": no such section'


# -- the conventions table against the code -----------------------------------------------------


@cache
def convention_names() -> frozenset[str]:
    package = ROOT / layout()["spanguard"] / "detection" / "conventions"
    return frozenset(
        node.value
        for path in sorted(package.glob("*.py"))
        for node in ast.walk(parse_python(path))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    )


def documented_attributes(text: str) -> list[str]:
    """Attribute names in the conventions table's "arguments from" column and in the section
    on tool names, call ids, results and tokens."""
    names: list[str] = []
    for row in re.findall(r"^\|(.+)\|$", text, flags=re.M):
        cells = [cell.strip() for cell in row.split("|")]
        if len(cells) == 5 and not set(cells[2]) <= set("-"):
            names.extend(code_spans(cells[2]))
    section = text.split("\n## Tool names, call ids, results and tokens\n", 1)[1]
    names.extend(code_spans(section.split("\n## ", 1)[0]))
    return [name for name in names if re.fullmatch(r"[\w.:]+", name) and re.search(r"[.:_]", name)]


# -- the tests ----------------------------------------------------------------------------------


def all_wrong(check) -> list[str]:
    return [problem for doc in DOCS for problem in check(doc, doc.read_text())]


def test_every_path_and_link_exists():
    assert not all_wrong(wrong_paths), "\n".join(all_wrong(wrong_paths))


def test_every_module_named_exists_in_the_documented_layout():
    assert not all_wrong(wrong_modules), "\n".join(all_wrong(wrong_modules))


def test_every_make_target_exists():
    assert not all_wrong(wrong_make_targets), "\n".join(all_wrong(wrong_make_targets))


def test_every_spanguard_command_and_flag_exists():
    assert not all_wrong(wrong_commands), "\n".join(all_wrong(wrong_commands))


def test_every_setting_named_is_in_the_registry():
    assert not all_wrong(wrong_variables), "\n".join(all_wrong(wrong_variables))


def test_code_cites_sections_that_exist():
    problems = list(wrong_citations())
    assert not problems, "\n".join(problems)


def test_the_conventions_table_names_attributes_the_code_reads():
    names = documented_attributes((ROOT / "docs" / "conventions.md").read_text())
    assert len(names) >= 20, names  # the table and the section were found
    unknown = sorted(set(names) - convention_names())
    assert not unknown, f"not read by spanguard/detection/conventions/: {unknown}"


def test_the_layout_table_maps_every_import_name():
    packages = layout()
    assert packages["spanguard"] == "spanguard"
    for name in ("schemas", "connectors", "cli", "streams", "alerting", "killswitch"):
        assert packages[f"spanguard.{name}"] == name


def test_the_checks_catch_a_typo(tmp_path):
    """Each check fails on a wrong name (the checks are not vacuous)."""
    doc = tmp_path / "typos.md"
    text = (
        "See `schemas/no-such.schema.json`, [here](no-such.md) and [there](#no-heading).\n"
        "Import `spanguard.detection.gaurd` and `spanguard.detection.guard.NoSuchGuard`.\n"
        "Run `make tset` and `spanguard wroker` and `spanguard worker --no-such-flag`.\n"
        "```sh\nSPANGUARD_MODE=observe spanguard replay --polcy p.yaml x.jsonl\n```\n"
        "Set `SPANGUARD_BOOTSTRAPP` or any `SPANGUARD_NOPE_<NAME>`.\n"
    )
    doc.write_text(text)
    paths = list(wrong_paths(doc, text))
    assert any("no-such.schema.json" in p for p in paths)
    assert any("(no-such.md)" in p for p in paths) and any("#no-heading" in p for p in paths)
    assert len(list(wrong_modules(doc, text))) == 2
    assert [p for p in wrong_make_targets(doc, text)] == [
        "typos.md: `make tset` is not a Makefile target"
    ]
    commands = list(wrong_commands(doc, text))
    assert any("`spanguard wroker` is not a command" in p for p in commands)
    assert any("--no-such-flag" in p for p in commands)
    assert any("`spanguard replay --polcy`" in p for p in commands)
    variables = list(wrong_variables(doc, text))
    assert any("SPANGUARD_BOOTSTRAPP" in p for p in variables)
    assert any("SPANGUARD_NOPE_" in p for p in variables)
    assert not any("SPANGUARD_MODE" in p for p in variables)


def test_the_checks_accept_what_exists(tmp_path):
    doc = tmp_path / "fine.md"
    text = (
        "`schemas/policy.schema.json`, `spanguard.schemas.decision.Decision.from_dict`,\n"
        "`spanguard.tool.args_hash`, `make test`, `spanguard topics create --partitions 12`,\n"
        "`spanguard worker --kafka-<name>`, `SPANGUARD_KAFKA_<NAME>`, `SPANGUARD_SIGNING_KEY_FILE`.\n"
    )
    doc.write_text(text)
    for check in (wrong_paths, wrong_make_targets, wrong_commands, wrong_variables):
        assert not list(check(doc, text)), check.__name__
    modules = list(wrong_modules(doc, text))
    assert not modules, modules


# -- values the docs and the clients restate --------------------------------------------------


def documented_state_version(rules_md: str) -> int:
    """The `"v": N` docs/rules.md gives in "The state's changelog form"."""
    section = rules_md.split("\n## The state's changelog form\n", 1)[1].split("\n## ", 1)[0]
    (version,) = re.findall(r'`"v": (\d+)`', section)
    return int(version)


def schema_rules(name: str) -> list[str]:
    """The `rule` enum of schemas/NAME.schema.json."""
    import json

    schema = json.loads((ROOT / "schemas" / f"{name}.schema.json").read_text())
    return list(schema["properties"]["rule"]["enum"])


# Each client's list of the rules a kill signal may name: (file, pattern of the list's text).
# A client refuses a signal whose rule it does not list, so each list must be the schema's.
CLIENT_RULE_LISTS = {
    "clients/typescript/src/signal.js": r"const RULES = new Set\(\[([^\]]*)\]\)",
    "clients/typescript/src/index.d.ts": r"readonly rule: ('[^;]*');",
    "clients/go/signal.go": r"\brules\s*=\s*map\[string\]bool\{([^}]*)\}",
    "clients/java/src/main/java/dev/spanguard/killswitch/Signals.java": (
        r"Set<String> RULES =\s*Set\.of\(([^)]*)\)"
    ),
}


def client_rules(path: str, text: str) -> list[str]:
    """The rule names of one client's list (quoted names, in the order written)."""
    found = re.findall(CLIENT_RULE_LISTS[path], text)
    assert len(found) == 1, f"{path}: the rule list was not found once ({len(found)})"
    return re.findall(r"""["'](\w+)["']""", found[0].replace(": true", ""))


def wrong_client_rules(texts: dict[str, str], enum: list[str]) -> Iterator[str]:
    for path, text in texts.items():
        names = client_rules(path, text)
        if len(set(names)) != len(names):
            yield f"{path}: a rule listed twice: {names}"
        if set(names) != set(enum):
            missing, extra = sorted(set(enum) - set(names)), sorted(set(names) - set(enum))
            yield f"{path}: rules {names} are not the kill signal schema's (missing {missing}, extra {extra})"


def test_the_state_version_in_the_docs_is_the_codes():
    from spanguard.detection.trace_state import STATE_VERSION

    documented = documented_state_version((ROOT / "docs" / "rules.md").read_text())
    assert documented == STATE_VERSION, (
        f'docs/rules.md says "v": {documented}, trace_state.STATE_VERSION is {STATE_VERSION}'
    )


def test_the_state_version_check_reads_the_number():
    text = (ROOT / "docs" / "rules.md").read_text()
    from spanguard.detection.trace_state import STATE_VERSION

    drifted = text.replace(f'`"v": {STATE_VERSION}`', f'`"v": {STATE_VERSION + 1}`')
    assert documented_state_version(drifted) == STATE_VERSION + 1


def test_every_clients_rule_list_is_the_kill_signal_schemas():
    enum = schema_rules("kill-signal")
    texts = {path: (ROOT / path).read_text() for path in CLIENT_RULE_LISTS}
    problems = list(wrong_client_rules(texts, enum))
    assert not problems, "\n".join(problems)


def test_the_python_rule_names_are_the_schemas():
    """Python's killswitch validates against kill-signal.schema.json itself; its decisions name
    `Rule` (schemas/decision.py), which must be the detection schema's enum, and a kill signal
    names only rules a detection may name. The registry's rules are all detection rules."""
    import typing

    from spanguard.detection.rules import RULES
    from spanguard.schemas.decision import Rule

    detection = schema_rules("detection")
    assert list(typing.get_args(Rule)) == detection
    assert set(schema_rules("kill-signal")) <= set(detection)
    assert {rule.name for rule in RULES} <= set(detection)


def rule_lists_script():
    """scripts/rule_lists.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("rule_lists", ROOT / "scripts" / "rule_lists.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_list_of_rules_is_written_from_the_registry():
    """The lists checked above, the README's rule table among them, are what
    scripts/rule_lists.py writes from the rule registry: adding a rule edits none by hand."""
    stale = rule_lists_script().stale()
    assert not stale, f"run scripts/rule_lists.py: {stale}"


def test_a_rule_added_to_the_registry_is_written_into_every_list(monkeypatch):
    script = rule_lists_script()
    names = script.rule_names
    monkeypatch.setattr(script, "rule_names", lambda *, signals: [*names(signals=signals), "new"])
    assert set(script.stale()) == set(script.LISTS) - {"README.md"}
    for path in CLIENT_RULE_LISTS:
        text = script.rewritten(path, (ROOT / path).read_text())
        assert client_rules(path, text) == [*schema_rules("kill-signal"), "new"]


def test_the_client_rule_check_catches_a_drift():
    enum = schema_rules("kill-signal")
    texts = {path: (ROOT / path).read_text() for path in CLIENT_RULE_LISTS}
    assert not list(wrong_client_rules(texts, enum))
    # A rule added to the schema but not to a client, and one a client lists twice.
    assert len(list(wrong_client_rules(texts, [*enum, "new_rule"]))) == len(texts)
    go = texts["clients/go/signal.go"].replace('"cycle": true,', '"cycle": true, "cycle": true,')
    problems = list(wrong_client_rules({"clients/go/signal.go": go}, enum))
    assert problems and "twice" in problems[0]
    ts = texts["clients/typescript/src/index.d.ts"].replace(" | 'cycle'", "")
    problems = list(wrong_client_rules({"clients/typescript/src/index.d.ts": ts}, enum))
    assert problems and "missing ['cycle']" in problems[0]


def counts() -> dict[str, int]:
    """How many references of each kind the docs hold (each one checked by the tests above)."""
    totals = dict.fromkeys(("paths", "links", "modules", "make", "commands", "settings"), 0)
    for doc in DOCS:
        text = doc.read_text()
        prose, blocks = split_fences(text)
        spans = code_spans(prose) + [line for block in blocks for line in block.splitlines()]
        roots = top_level_entries()
        totals["paths"] += sum(
            1
            for span in spans
            for token in (t.strip("\"'(),;:") for t in span.split())
            if "/" in token and PATH_TOKEN.match(token) and token.split("/")[0] in roots
        )
        totals["links"] += sum(1 for t in links(prose) if not re.match(r"^[a-z]+:", t))
        totals["modules"] += len(MODULE_NAME.findall(text))
        totals["make"] += sum(
            len(re.findall(r"(?:^|[\s`(;&|])make ([a-z][\w-]*)", line))
            for line in command_lines(text)
        )
        totals["commands"] += sum(
            1 for line in command_lines(text) for _ in spanguard_commands(line)
        )
        totals["settings"] += len(re.findall(r"SPANGUARD_[A-Z0-9_]*", text))
    totals["total"] = sum(totals.values())
    return totals


if __name__ == "__main__":
    print(counts())


def test_agent_code_in_the_docs_imports_from_the_one_agent_package():
    """What an agent writes (the killswitch, its exceptions, the stop helper, the span
    processors) has one import path, `spanguard.killswitch`, and every name the docs import
    from it is there; framework adapters keep a module each."""
    import importlib

    agent_api = importlib.import_module("spanguard.killswitch")
    pattern = re.compile(r"from (spanguard\.killswitch(?:\.\w+)?) import ([\w, ]+)")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for module, names in pattern.findall(path.read_text()):
            if module == "spanguard.killswitch":
                for name in (n.strip() for n in names.split(",")):
                    assert hasattr(agent_api, name), f"{path.name}: {name}"
                continue
            assert module.rsplit(".", 1)[1].startswith("adapters_") or module.endswith("gateway"), (
                f"{path.name} imports from {module}: the agent API is spanguard.killswitch"
            )
