"""Extract recorded SWE-bench coding-agent runs into tests/fixtures/realruns/swe.jsonl.gz.

Sources (repository snapshots pinned by commit, read with `git show <commit>:<path>`):

* NL2Code/CodeR: the CodeR submission to SWE-bench Lite (20240604_CodeR), a multi-agent
  harness built on SWE-agent. `trajs/<instance>.traj` holds SWE-agent trajectories
  (`trajectory`: action / observation / thought); `results.json` lists the resolved instances.
* RussellRyanH/CSCI-635-LiveSWE-Agent: a mini-swe-agent 2.2.4 run of openai/gpt-5-mini on a
  SWE-bench Verified subset (`results/llm-ablation/gpt-5-mini/<id>/<id>.traj.json`, tool-call
  messages), with a SWE-bench evaluation report per instance under `eval_results/`.

Usage:
    python3 scripts/realruns/extract_swe.py \
        --coder-git-dir /work/.mirror/NL2Code+CodeR/repo \
        --mini-git-dir /work/.mirror/RussellRyanH+CSCI-635-LiveSWE-Agent/repo

Mapping: the task statement is the first user step; each model turn is a model step followed by
one tool step per action. Observations are kept as recorded (both harnesses' observations
carry no per-step counter; mini-swe-agent's constant `<returncode>`/`<output>` wrapper stays).
Harness feedback messages (mini-swe-agent format errors, limits) become user steps.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, TypedDict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_step, run_record, tool_step, user_step, write_runs


class Source(TypedDict, total=False):
    """Where one harness's runs are read from (each source names the keys it needs)."""

    repo: str
    commit: str
    trajs: str
    results: str
    submission: str
    harness: str
    model: str | None
    reports: str
    preds: str
    short: str


CODER: Source = {
    "repo": "NL2Code/CodeR",
    "commit": "d63468344bc215bbabb8f0c1ba4af24897a946df",
    "trajs": "trajs/",
    "results": "results.json",
    "submission": "20240604_CodeR",
    "harness": "swe-agent/CodeR",
    "model": None,  # the repository does not name the model
}

MINI: Source = {
    "repo": "RussellRyanH/CSCI-635-LiveSWE-Agent",
    "commit": "2813cfb19465bb9f57d50ebd0798550480a2f836",
    "trajs": "results/llm-ablation/gpt-5-mini/",
    "reports": "results/llm-ablation/gpt-5-mini/eval_results/openai__gpt-5-mini/",
    "preds": "results/llm-ablation/gpt-5-mini/preds.json",
    "harness": "mini-swe-agent",
    "model": "openai/gpt-5-mini",
    "short": "gpt-5-mini",
}

# SWE-agent / CodeR interface commands: the command's own name is the tool name. Other actions
# are plain shell: `python` for python invocations, `bash` for the rest.
SWE_AGENT_COMMANDS = {
    "open",
    "goto",
    "scroll_down",
    "scroll_up",
    "create",
    "edit",
    "submit",
    "search_dir",
    "search_file",
    "find_file",
    "plan",
    "succeed",
    "fail",
    "exit_cost",
    "exit_context",
    "exit_api",
    "exit_format",
    "exit_error",
    "skip",
    "rover_search_class",
    "rover_search_method",
    "rover_search_code",
    "rover_search_file",
    "rover_search_extension",
    "rover_search_method_in_class",
    "rover_search_code_in_file",
    "stackoverflow_search",
    "similar_issue_search",
}

# Credential shapes beyond common.scrub (none were found in these sources; kept as a guard).
_EXTRA_SECRETS = [re.compile(r"Bearer\s+[A-Za-z0-9._\-]{20,}")]


def extra_scrub(text: str | None) -> str | None:
    if text is None:
        return None
    for pattern in _EXTRA_SECRETS:
        text = pattern.sub("Bearer [REDACTED]", text)
    return text


class Git:
    def __init__(self, git_dir: str, commit: str):
        self.git_dir = git_dir
        self.commit = commit
        subprocess.run(
            ["git", "--git-dir", git_dir, "cat-file", "-e", commit + "^{commit}"], check=True
        )

    def ls(self, prefix: str) -> list[str]:
        out = subprocess.run(
            ["git", "--git-dir", self.git_dir, "ls-tree", "-r", "--name-only", self.commit, prefix],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return sorted(out.split())

    def show(self, path: str) -> bytes:
        return subprocess.run(
            ["git", "--git-dir", self.git_dir, "show", f"{self.commit}:{path}"],
            check=True,
            capture_output=True,
        ).stdout


def lenient_json(raw: bytes) -> Any:
    """JSON with trailing commas allowed (CodeR's results.json has them)."""
    text = raw.decode("utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(re.sub(r",(\s*[\]}])", r"\1", text))


# ---------------------------------------------------------------- CodeR (SWE-agent trajectories)


def coder_tool_name(action: str) -> str:
    first = action.strip().split(None, 1)[0] if action.strip() else ""
    if first in SWE_AGENT_COMMANDS:
        return first
    if first in ("python", "python3"):
        return "python"
    return "bash"


def coder_problem(history: list[dict[str, Any]]) -> str:
    for message in history:
        if message.get("role") == "user" and not message.get("is_demo"):
            content = message.get("content") or ""
            match = re.search(r"ISSUE:\n(.*?)\n\nINSTRUCTIONS:", content, re.S)
            return match.group(1) if match else content
    return ""


def extract_coder(git: Git) -> list[dict[str, Any]]:
    results = lenient_json(git.show(CODER["results"]))
    resolved = set(results["resolved"])
    evaluated = set(results.get("generated", [])) | set(results.get("no_generation", []))
    runs = []
    for path in git.ls(CODER["trajs"]):
        if not path.endswith(".traj"):
            continue
        instance = path.rsplit("/", 1)[1][: -len(".traj")]
        data = json.loads(git.show(path))
        steps = [user_step(coder_problem(data.get("history", [])))]
        for entry in data["trajectory"]:
            action = (entry.get("action") or "").rstrip("\n")
            steps.append(model_step(extra_scrub(entry.get("thought") or "")))
            steps.append(
                tool_step(
                    coder_tool_name(action),
                    None,
                    {"command": extra_scrub(action)},
                    extra_scrub(entry.get("observation")),
                    None,
                )
            )
        if instance in resolved:
            outcome, reward = "success", 1.0
        elif instance in evaluated:
            outcome, reward = "failure", 0.0
        else:
            outcome, reward = None, None
        run_id = f"swe/swe-agent-{CODER['submission']}/{instance}"
        runs.append(coding_run(run_id, CODER, path, outcome, reward, steps))
    return runs


# ---------------------------------------------------------------- mini-swe-agent (tool calls)

_RETURNCODE = re.compile(r"<returncode>(-?\d+)</returncode>")


def mini_problem(content: str) -> str:
    match = re.search(
        r"Consider the following PR description:\n(.*?)\n</pr_description>", content, re.S
    )
    return match.group(1) if match else content


def mini_error(content: str) -> bool | None:
    if "<exception>" in content:
        return True
    match = _RETURNCODE.search(content)
    return None if match is None else int(match.group(1)) != 0


def text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def extract_mini(git: Git) -> list[dict[str, Any]]:
    preds = json.loads(git.show(MINI["preds"]))
    reports = {}
    for path in git.ls(MINI["reports"]):
        if path.endswith("/report.json"):
            reports.update(json.loads(git.show(path)))
    runs = []
    for path in git.ls(MINI["trajs"]):
        if not path.endswith(".traj.json") or path.startswith(MINI["reports"]):
            continue
        data = json.loads(git.show(path))
        instance = data.get("instance_id") or path.rsplit("/", 1)[1][: -len(".traj.json")]
        messages = data["messages"]
        results = {m.get("tool_call_id"): m for m in messages if m.get("role") == "tool"}
        steps: list[dict[str, Any]] = []
        seen_task = False
        for message in messages:
            role = message.get("role")
            if role == "system" or role == "tool" or role == "exit":
                continue
            if role == "user":
                text = text_of(message.get("content"))
                steps.append(user_step(extra_scrub(mini_problem(text) if not seen_task else text)))
                seen_task = True
                continue
            if role != "assistant":
                continue
            steps.append(model_step(extra_scrub(text_of(message.get("content")))))
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                try:
                    arguments = json.loads(function.get("arguments") or "{}")
                except json.JSONDecodeError:
                    arguments = {"raw": function.get("arguments")}
                if isinstance(arguments, dict) and isinstance(arguments.get("command"), str):
                    arguments = dict(arguments, command=extra_scrub(arguments["command"]))
                result = results.get(call.get("id"))
                output = None if result is None else text_of(result.get("content"))
                steps.append(
                    tool_step(
                        function.get("name") or "bash",
                        call.get("id"),
                        arguments,
                        extra_scrub(output),
                        None if output is None else mini_error(output),
                    )
                )
        report = reports.get(instance)
        if report is not None:
            ok = bool(report.get("resolved"))
            outcome, reward = ("success", 1.0) if ok else ("failure", 0.0)
        elif not (preds.get(instance) or {}).get("model_patch"):
            outcome, reward = "failure", 0.0  # empty patch: unresolved by definition
        else:
            outcome, reward = None, None
        run_id = f"swe/mini-swe-agent-{MINI['short']}/{instance}"
        runs.append(coding_run(run_id, MINI, path, outcome, reward, steps))
    return runs


def coding_run(
    run_id: str,
    submission: Source,
    path: str,
    outcome: str | None,
    reward: float | None,
    steps: list[dict[str, Any]],
) -> dict[str, Any]:
    """One run of a submission's coding agent, recorded where the submission is published."""
    return run_record(
        run_id,
        repo=submission["repo"],
        commit=submission["commit"],
        path=path,
        harness=submission["harness"],
        model=submission["model"],
        kind="coding",
        outcome=outcome,
        reward=reward,
        steps=steps,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--coder-git-dir", required=True, help="snapshot of NL2Code/CodeR")
    parser.add_argument(
        "--mini-git-dir", required=True, help="snapshot of RussellRyanH/CSCI-635-LiveSWE-Agent"
    )
    args = parser.parse_args()
    runs = extract_coder(Git(args.coder_git_dir, CODER["commit"]))
    runs += extract_mini(Git(args.mini_git_dir, MINI["commit"]))
    target = write_runs("swe", runs)
    by_source: dict[str, list[int]] = {}
    for run in runs:
        counts = by_source.setdefault(run["source"]["repo"], [0, 0, 0, 0])
        counts[0] += 1
        counts[{"success": 1, "failure": 2, None: 3}[run["outcome"]]] += 1
    for repo, (total, ok, bad, unknown) in by_source.items():
        print(f"{repo}: {total} runs, {ok} resolved, {bad} unresolved, {unknown} unknown")
    print(f"wrote {target} ({target.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
