"""Extract tau-bench / tau2-bench customer-service runs committed in forks and derived projects.

Usage:
    python3 scripts/realruns/extract_tau_forks.py [--mirror /work/.mirror] [--dry-run]

The official leaderboard's trajectory files cannot be read here (files of 4 MiB and more are
absent from repository snapshots), so this script reads simulation result files that other
public repositories committed, each small enough to be present. Every source is pinned in
`SOURCES` below (repository, commit, path, format, how many runs to take, and why it was
chosen); files are read straight from a bare git directory of the repository snapshot
(`<mirror>/<owner>+<name>/repo`, as `fetch` lays it out) with `git cat-file`. A file whose blob
is absent, or that is a Git LFS pointer, is skipped and reported; nothing is substituted.

Formats handled:
  tau2-task   one tau2 simulation per file, `task_<id>.json`, in a folder (`path` is the folder):
              either {task_id, messages, reward_info, run_info, ...} (the tau2 web viewer's
              export) or {task_id, reward, simulation_run: {messages, ...}}
  tau2-eval   {config: {domain, agent_llm, ...}, task_results: [{task_id, trial, reward,
              trajectory: <tau2 simulation>}]} (bogoliubon's policy-refinement evaluator)
  tau-v1      tau-bench v1 result list [{task_id, trial, reward, info, traj: [OpenAI-style
              messages]}]

Mapping (tau2 formats use extract_tau2.steps_of, so the step rules are the same as there):
  run      tau/<repo owner>/<file stem>/<domain>/<task_id>/<trial>; for tau2-task sources, whose
           files each hold one task, the stem is the folder's name; trial 0 when not recorded
  harness  <repo>:<agent>;  model  as the source records it (None when it names none)
  outcome  success if reward >= 0.999, failure if below, None if absent
  steps    tau-v1: user message -> user step; assistant message -> model step, then one tool
           step per tool call, in order, its result the tool message answering that call id
           (each tool message used once); system messages carry no step. Call ids are kept
           exactly as recorded.

Excluded by rule and never read: tau-bench v1's historical_trajectories, anything under a
data/simulations or judge_viewer/data/simulations folder, and the held-out leaderboard
submissions (see extract_tau2.py).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import model_step, numbered, tool_step, user_step
from extract_tau2 import (
    answer_of,
    extra_scrub,
    git,
    parse_arguments,
    read_blob,
    reward_of,
    service_run,
    steps_of,
    task_key,
    text_of,
    tool_answers,
    write_and_check,
)

EXCLUDED = re.compile(
    r"(^|/)(judge_viewer/)?data/simulations/|historical_trajectories|"
    r"gpt-oss-120b_openai_2025-11-26|toolorchestra_nvidia_2025-12-02|"
    r"claude-sonnet-4-5_aide-platform_2025-10-31|button-claude-opus-4-6_distyl-ai_2026-03-04|"
    r"ironshell|adaptive-?agent",
    re.I,
)

CODESQUE = "c9e1346e5a5a62062fb085aeca56a6c2db5a0235"  # codesque16/tau2-bench main HEAD
BOG_TUDOR = "c811fc8fa339826cf5d8992342558c684361068c"  # bogoliubon: "Add Claude Code trajectories, GPT-5 rollouts, ..."
BOG_CHLOE = (
    "947b0d29e760e832dba1c8a1a550b04a7c10caae"  # bogoliubon: "Add Chloe's evaluation results"
)
MADHAV = "aeb171db5dd4f5fdac1a42e55cb892aa892d7641"  # Madhav-Kanda/tau-bench main HEAD
AVALJOT = "f2ad25ac1aa0b42bb6d2f1ced30b38d3dd34f086"  # avaljotsingh/tau-bench main HEAD

# (repo, commit, path, format, limit, domain, agent, model, reason)
# `domain` / `model` None: taken from the file.  `limit`: the first N simulations by
# (task id, trial), so whole tasks are taken, failures included.
SOURCES: list[tuple[str, str, str, str, int, str | None, str, str | None, str]] = [
    (
        "codesque16/tau2-bench",
        CODESQUE,
        "docs/data/_gemini-3-flash__mermaid_harness_v1__all_",
        "tau2-task",
        114,
        "retail",
        "llm_mermaid_agent",
        "gemini-3-flash-preview",
        "the repo's own graph-guided agent (goto_node / todo tools around the retail tools), "
        "Gemini 3 Flash; all 114 retail tasks (0-113), one trial",
    ),
    (
        "codesque16/tau2-bench",
        CODESQUE,
        "docs/data/_gpt-5-mini__base__all_",
        "tau2-task",
        114,
        "retail",
        "llm_agent",
        "gpt-5-mini",
        "tau2's default llm_agent with GPT-5 mini; all 114 retail tasks (0-113), one trial",
    ),
    (
        "codesque16/tau2-bench",
        CODESQUE,
        "docs/data/_gpt-5-nano__base__all_",
        "tau2-task",
        114,
        "retail",
        "llm_agent",
        "gpt-5-nano",
        "tau2's default llm_agent with GPT-5 nano (a weaker model: more failures); all 114 "
        "retail tasks, one trial",
    ),
    (
        "bogoliubon/tau2-bench",
        BOG_TUDOR,
        "claude_code_trajectories",
        "tau2-task",
        100,
        "retail",
        "claude_code",
        None,
        "Claude Code itself driving the agent side through a file-based bridge "
        "(scripts/claude_code_agent.py); 74 retail training tasks, one trial each; model not "
        "recorded; only completed (reward 1.0) runs were kept by the repo",
    ),
    (
        "bogoliubon/tau2-bench",
        BOG_TUDOR,
        "evaluations/airline/eval_llm_rollouts_gpt4o_test_3trials.json",
        "tau2-eval",
        60,
        None,
        "llm_agent+policy-refined-from-gpt-4o-rollouts",
        None,
        "airline: tau2 llm_agent (GPT-4o per the file's config) with a policy that GPT-4o "
        "refined from rollouts; 20 test tasks x 3 trials",
    ),
    (
        "bogoliubon/tau2-bench",
        BOG_TUDOR,
        "evaluations/airline/eval_llm_rollouts_gpt5mini_test_3trials.json",
        "tau2-eval",
        60,
        None,
        "llm_agent+policy-refined-from-gpt-5-mini-rollouts",
        None,
        "airline: same evaluator and GPT-4o agent, policy refined by GPT-5 mini (46k chars); "
        "20 test tasks x 3 trials",
    ),
    (
        "bogoliubon/tau2-bench",
        BOG_CHLOE,
        "evaluations/new_prompt/claude_sonnet_74train_trajectories.json",
        "tau2-eval",
        74,
        None,
        "llm_agent",
        None,
        "retail: tau2 llm_agent with Claude Sonnet 4.6 and the stock policy; 74 training "
        "tasks, one trial each; a curated set: every kept trajectory has reward 1.0",
    ),
    (
        "Madhav-Kanda/tau-bench",
        MADHAV,
        "final_results/tool-calling-l0-4o.json",
        "tau-v1",
        115,
        "retail",
        "tool-calling",
        "gpt-4o",
        "tau-bench v1's tool-calling agent, base tool set (L0), GPT-4o (model named by the "
        "file name and final_results/statistics.py); all 115 retail test tasks",
    ),
    (
        "Madhav-Kanda/tau-bench",
        MADHAV,
        "results/tool-calling-Qwen2.5-Coder-32B-Instruct-0.1_range_0--1_user-Qwen2.5-Coder-"
        "32B-Instruct-llm_1212134054.json",
        "tau-v1",
        50,
        "airline",
        "tool-calling",
        "Qwen2.5-Coder-32B-Instruct",
        "v1 tool-calling agent on a vLLM-served Qwen2.5-Coder-32B (also the user model): its "
        "tool calls came back as text, so these runs have no tool steps; all 50 airline tasks",
    ),
    (
        "avaljotsingh/tau-bench",
        AVALJOT,
        "final_results/tool-calling-with-preconditions-none-0.1_range_0-100_user-none-llm_"
        "0626123715.json",
        "tau-v1",
        100,
        "retail",
        "tool-calling-with-preconditions",
        None,
        "the repo's own agent (v1 tool-calling plus generated tool preconditions given as "
        "advice); retail tasks 0-99; the file names the model 'none' (an unnamed endpoint)",
    ),
]


def v1_steps(traj: list[dict[str, Any]]) -> list[dict[str, Any]]:
    used: set[int] = set()
    steps: list[dict[str, Any]] = []
    for index, message in enumerate(traj or []):
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if role == "user":
            steps.append(user_step(extra_scrub(text_of(message.get("content")))))
            continue
        if role != "assistant":
            continue  # system and tool messages carry no step of their own
        steps.append(model_step(extra_scrub(text_of(message.get("content")))))
        answers = tool_answers(traj, index)
        for position, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") or {}
            call_id = call.get("id")
            match = answer_of(traj, answers, used, position, call_id, "tool_call_id")
            result = None
            if match is not None:
                result = text_of(traj[match].get("content"))
            steps.append(
                tool_step(
                    str(function.get("name")),
                    call_id,
                    extra_scrub(parse_arguments(function.get("arguments"))),
                    extra_scrub(result),
                    None,  # v1 records no error flag
                )
            )
    return steps


def blob_json(git_dir: str, commit: str, path: str) -> tuple[Any, str]:
    data, why = read_blob(git_dir, commit, path)
    if data is None:
        return None, why
    return json.loads(data), "ok"


def records_of(git_dir: str, commit: str, path: str, fmt: str, domain: str | None):
    """(sim-like dict, domain, model, reward, steps, trial, file path) for each run in a source."""
    out = []
    if fmt == "tau2-task":
        listing = git(git_dir, "ls-tree", "--name-only", f"{commit}:{path}").decode().split("\n")
        names = sorted(n for n in listing if re.fullmatch(r"task_[^/]+\.json", n))
        for name in names:
            full = f"{path}/{name}"
            data, why = blob_json(git_dir, commit, full)
            if data is None:
                print(f"  SKIPPED {full}: {why}")
                continue
            sim = (
                data.get("simulation_run") if isinstance(data.get("simulation_run"), dict) else data
            )
            reward = reward_of(sim)
            if reward is None and isinstance(data.get("reward"), (int, float)):
                reward = float(data["reward"])
            trial = sim.get("trial")
            task_id = data.get("task_id", sim.get("task_id"))
            out.append(
                (task_id, trial, domain, None, reward, steps_of(sim.get("messages") or []), full)
            )
    elif fmt == "tau2-eval":
        data, why = blob_json(git_dir, commit, path)
        if data is None:
            print(f"  SKIPPED {path}: {why}")
            return out
        config = data.get("config") or {}
        for result in data.get("task_results") or []:
            sim = result.get("trajectory")
            if not isinstance(sim, dict) or not sim.get("messages"):
                print(
                    f"  left out task {result.get('task_id')} trial {result.get('trial')}: "
                    f"no trajectory recorded (termination {result.get('termination_reason')})"
                )
                continue
            reward = reward_of(sim)
            if reward is None and isinstance(result.get("reward"), (int, float)):
                reward = float(result["reward"])
            trial = result.get("trial", sim.get("trial"))
            out.append(
                (
                    result.get("task_id", sim.get("task_id")),
                    trial,
                    domain or config.get("domain"),
                    config.get("agent_llm"),
                    reward,
                    steps_of(sim.get("messages") or []),
                    path,
                )
            )
    elif fmt == "tau-v1":
        data, why = blob_json(git_dir, commit, path)
        if data is None:
            print(f"  SKIPPED {path}: {why}")
            return out
        for item in data:
            reward = item.get("reward")
            reward = float(reward) if isinstance(reward, (int, float)) else None
            out.append(
                (
                    item.get("task_id"),
                    item.get("trial"),
                    domain,
                    None,
                    reward,
                    v1_steps(item.get("traj") or []),
                    path,
                )
            )
    else:
        raise ValueError(fmt)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mirror", default="/work/.mirror")
    parser.add_argument("--dry-run", action="store_true", help="convert and report, write nothing")
    args = parser.parse_args()

    runs: list[dict[str, Any]] = []
    seen: Counter[str] = Counter()
    loops: list[tuple[int, str, str]] = []
    for repo, commit, path, fmt, limit, domain, agent, model, _reason in SOURCES:
        assert not EXCLUDED.search(path), path
        git_dir = str(Path(args.mirror) / repo.replace("/", "+") / "repo")
        owner = repo.split("/")[0]
        stem = Path(path).name if fmt == "tau2-task" else Path(path).stem
        try:
            full = git(git_dir, "rev-parse", "--verify", f"{commit}^{{commit}}").decode().strip()
        except (subprocess.CalledProcessError, FileNotFoundError):
            print(f"SKIPPED {repo} {path}: commit {commit} not available")
            continue
        records = records_of(git_dir, full, path, fmt, domain)
        records.sort(key=lambda r: task_key({"task_id": r[0], "trial": r[1]}))
        chosen = records[:limit]
        tally: Counter[str | None] = Counter()
        models: Counter[str | None] = Counter()
        tool_steps = unanswered = 0
        for task_id, trial, sim_domain, file_model, reward, steps, file_path in chosen:
            run_model = model or file_model
            models[run_model] += 1
            trial = 0 if trial is None else trial
            run_id = numbered(
                f"tau/{owner}/{stem}/{sim_domain or 'unknown'}/{task_id}/{trial}", seen
            )
            for step in steps:
                if step["type"] == "tool":
                    tool_steps += 1
                    unanswered += step["result"] is None
            harness = f"{repo}:{agent}"
            run = service_run(
                run_id, reward, steps, loops, repo, full, file_path, harness, run_model
            )
            tally[run["outcome"]] += 1
            runs.append(run)
        print(
            f"{repo} {path}: {len(records)} runs in the source, {len(chosen)} taken; "
            f"models {dict(models)}; success {tally['success']}, failure {tally['failure']}, "
            f"no reward {tally[None]}; tool steps {tool_steps} ({unanswered} without a result)"
        )

    print(f"total runs {len(runs)}")
    for count, run_id, what in sorted(loops, reverse=True)[:25]:
        print(f"  repeated call x{count}: {run_id}: {what}")
    if args.dry_run or not runs:
        return 1 if not runs else 0
    write_and_check("tau-forks", runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
