"""Extract tool-calling customer-service runs from the public tau2-bench leaderboard submissions.

Usage:
    python3 scripts/realruns/extract_tau2.py --git-dir <snapshot git dir> [--commit <sha>] [--dry-run]

Reads the trajectory files listed in `CHOSEN` straight from a git directory of
sierra-research/tau2-bench (`git cat-file` / `git show`, no work tree needed), turns each
simulation into one run (see common.py for the step format) and writes
tests/fixtures/realruns/tau2.jsonl.gz.

The trajectory files were removed from the repository's main branch by commit 20062c79
("remove trajectory files from repo (now served from S3)"), so each file is read from the
commit recorded next to it in `CHOSEN` (the last commit on which it exists). `--commit`, when
given, is used for every file instead (e.g. a snapshot in which the files were restored).
A file whose blob is absent from the git directory (snapshots may omit files of 4 MiB and
more) or that is a Git LFS pointer is skipped and reported; the script never substitutes
other data for it.

Mapping of one simulation to one run:
  run      tau2/<submission>/<domain>/<task_id>/<trial>  (a counter appended if repeated)
  harness  the submission's folder name;  model  info.agent_info.llm when the file says it
  kind     "service";  outcome  success if reward >= 0.999, failure if below, None if absent
  steps    user message -> user step; assistant message -> model step, then one tool step per
           call, in order; the result is the content of the tool message answering that call
           (matched by call id, each tool message used once), error its `error` flag. Calls
           the user simulator makes (requestor "user": telecom's phone tools) are named
           "user:<tool>". Call ids are kept exactly as recorded, repeats included.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    model_step,
    numbered,
    read_runs,
    run_record,
    tool_step,
    user_step,
    write_runs,
)

REPO = "sierra-research/tau2-bench"
SUBMISSIONS = "web/leaderboard/public/submissions"

# Commits on which the trajectory files exist (the files are gone from main's HEAD).
MAIN_BEFORE_REMOVAL = "2f6c259b85fb6ced67f75ed3d0f8becae6d3dea6"  # parent of 20062c79 on main
AMITY = "79ed1e011dce55c316329eba8d0157f50923be14"  # PR merge ref for the Amity submission
EIGEN = "3bb7e0ac3848935d5b29834c67306a4ce7577560"  # PR head for the Tsinghua & Eigen one
MININGLAMP = "945ab7bb40a951035d8b1bacba8662b6d281709a"  # PR merge ref for Mininglamp's
BIGAI = "35817c990865ffc0c024de548200bcc4de5c5235"  # PR merge ref for BIGAI's TongAgents

# The chosen files: (submission folder, file name, commit, how many simulations to take).
# Why these: six different harnesses/organisations (Sierra's default tau2 llm_agent run by
# Sierra with GPT-4.1 and with Claude 3.7 Sonnet; Amity's fine-tuned Qwen3-4B agent;
# Tsinghua & Eigen's RL-trained A-ReaL-Eigen; Mininglamp's DM-Cito-72B; BIGAI's TongAgents
# harness on Gemini 3 Pro), several models, and all three text domains (airline, retail,
# telecom - telecom adds the user simulator's own tool calls). Each file contributes the
# first N simulations by (task id, trial), so whole tasks with all their trials are taken,
# failures included; N keeps the total near 960 runs and the output under 12 MB.
# Held out (never read): gpt-oss-120b_openai_2025-11-26, toolorchestra_nvidia_2025-12-02,
# claude-sonnet-4-5_aide-platform_2025-10-31, button-claude-opus-4-6_distyl-ai_2026-03-04,
# ironshell-ironforge_ironshell-ui_2026-03-09, adaptive-agent_community_2026-03-23; also
# not used: adaptive-agent_ironshell-ui_2026-03-22 (same author and agent as two held-out
# submissions) and gpt-oss-120b_openai_2026-01-08 (same LangChain harness as a held-out one).
CHOSEN: list[tuple[str, str, str, int]] = [
    (
        "gpt-4-1_openai_2024-06-20",
        "gpt-4.1-2025-04-14_telecom_default_gpt-4.1-2025-04-14_4trials.json",
        MAIN_BEFORE_REMOVAL,
        160,
    ),
    (
        "claude-3-7-sonnet_anthropic_2024-06-20",
        "claude-3-7-sonnet-20250219_airline_default_gpt-4.1-2025-04-14_4trials.json",
        MAIN_BEFORE_REMOVAL,
        200,
    ),
    (
        "amity-sigma-v3r_amity_2026-01-10",
        "amity-sigma-v3r_retail_default_gpt-4.1_4trials.json",
        AMITY,
        160,
    ),
    (
        "a-reaL-eigen_tsinghua&eigen_2026-01-31",
        "a-real-eigen_telecom_default_gpt-4.1-2025-04-14_4trials.json",
        EIGEN,
        160,
    ),
    (
        "dm-cito-72b-v1_mininglamp_2026-01-08",
        "dm-cito-72b-v1_retail_default_gpt-4.1-2025-04-14_4trials.json",
        MININGLAMP,
        140,
    ),
    (
        "gemini-3-pro_BIGAI_2026-01-15",
        "airline_tong_llm_agent_gemini-3-pro-preview_user_simulator_gemini-3-pro-preview.json",
        BIGAI,
        140,
    ),
]

# Credential shapes beyond common.scrub's, applied first (common.scrub runs afterwards).
_EXTRA_SECRETS = [
    (re.compile(r"(?i)\b(Bearer\s+)[A-Za-z0-9._~+/\-]{12,}=*"), r"\1[REDACTED]"),
    (re.compile(r"(?i)(x-api-key\"?\s*[:=]\s*\"?)[^\s\"',}]{12,}"), r"\1[REDACTED]"),
]
KEYLIKE = re.compile(r"sk-[A-Za-z0-9_\-]{8,}|AKIA[0-9A-Z]{8,}|api_key|Bearer ", re.I)


def extra_scrub(value: Any) -> Any:
    if isinstance(value, str):
        for pattern, replacement in _EXTRA_SECRETS:
            value = pattern.sub(replacement, value)
        return value
    if isinstance(value, list):
        return [extra_scrub(item) for item in value]
    if isinstance(value, dict):
        return {key: extra_scrub(item) for key, item in value.items()}
    return value


def git(git_dir: str, *args: str) -> bytes:
    return subprocess.run(
        ["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True
    ).stdout


def read_blob(git_dir: str, commit: str, path: str) -> tuple[bytes | None, str]:
    """The file's bytes, or None and why not."""
    spec = f"{commit}:{path}"
    try:
        oid = git(git_dir, "rev-parse", "--verify", spec).decode().strip()
    except subprocess.CalledProcessError:
        return None, f"no such path at {commit}"
    check = subprocess.run(
        ["git", f"--git-dir={git_dir}", "cat-file", "-e", oid], capture_output=True
    )
    if check.returncode != 0:
        return None, f"blob {oid} absent from the git directory (snapshot omits large files)"
    data = git(git_dir, "cat-file", "blob", oid)
    if data.startswith(b"version https://git-lfs"):
        return None, f"blob {oid} is a Git LFS pointer"
    return data, "ok"


def task_key(sim: dict[str, Any]) -> tuple[Any, ...]:
    task = str(sim.get("task_id"))
    number = int(task) if task.isdigit() else math.inf
    return (number, task, sim.get("trial") or 0)


def parse_arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        parts = []
        for part in content:
            if isinstance(part, dict):
                parts.append(str(part.get("text") or ""))
            else:
                parts.append(str(part))
        return "".join(parts)
    return json.dumps(content, ensure_ascii=False)


def flatten(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with any grouped tool messages (`tool_messages`) spread out in order."""
    flat = []
    for message in messages or []:
        if message.get("role") == "tool" and isinstance(message.get("tool_messages"), list):
            flat.extend(message["tool_messages"])
        else:
            flat.append(message)
    return flat


def tool_answers(messages: list[Any], index: int) -> list[int]:
    """Where the tool messages right after messages[index] are: the answers to its calls."""
    answers = []
    for later in range(index + 1, len(messages)):
        if not isinstance(messages[later], dict) or messages[later].get("role") != "tool":
            break
        answers.append(later)
    return answers


def answer_of(
    messages: list[Any],
    answers: list[int],
    used: set[int],
    position: int,
    call_id: Any,
    id_key: str,
) -> int | None:
    """The tool message answering the `position`th call: the one naming its id (`id_key`),
    else, for a call without an id, the one in its place; each answers one call (`used`)."""
    match = None
    for later in answers:
        if later not in used and messages[later].get(id_key) == call_id:
            match = later
            break
    if (
        match is None
        and call_id is None
        and position < len(answers)
        and answers[position] not in used
    ):
        match = answers[position]
    if match is not None:
        used.add(match)
    return match


def steps_of(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    messages = flatten(messages)
    used: set[int] = set()
    steps: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "tool":
            continue  # placed on the call it answers
        if role == "user":
            steps.append(user_step(extra_scrub(text_of(message.get("content")))))
        elif role == "assistant":
            steps.append(model_step(extra_scrub(text_of(message.get("content")))))
        else:
            continue  # system messages carry no step
        # the tool messages answering this message's calls follow it
        answers = tool_answers(messages, index)
        for position, call in enumerate(message.get("tool_calls") or []):
            call_id = call.get("id")
            match = answer_of(messages, answers, used, position, call_id, "id")
            result = error = None
            if match is not None:
                result = text_of(messages[match].get("content"))
                error = messages[match].get("error")
            requestor = call.get("requestor") or role
            name = str(call.get("name"))
            if requestor == "user":
                name = f"user:{name}"
            steps.append(
                tool_step(
                    name,
                    call_id,
                    extra_scrub(parse_arguments(call.get("arguments"))),
                    extra_scrub(result),
                    error,
                )
            )
    return steps


def outcome_of(reward: float | None) -> str | None:
    """A run's outcome from its reward: full reward is a success."""
    return None if reward is None else ("success" if reward >= 0.999 else "failure")


def reward_of(sim: dict[str, Any]) -> float | None:
    info = sim.get("reward_info")
    if isinstance(info, dict) and isinstance(info.get("reward"), (int, float)):
        return float(info["reward"])
    return None


def loop_signs(steps: list[dict[str, Any]]) -> tuple[int, str]:
    """The largest count of one (tool, arguments) pair in a run, and that pair."""
    counts = Counter(
        (s["name"], json.dumps(s["arguments"], sort_keys=True))
        for s in steps
        if s["type"] == "tool"
    )
    if not counts:
        return 0, ""
    (name, arguments), count = counts.most_common(1)[0]
    return count, f"{name} {arguments[:80]}"


def runs_of_file(
    data: bytes,
    submission: str,
    name: str,
    commit: str,
    path: str,
    limit: int,
    seen: Counter[str],
    loops: list[tuple[int, str, str]],
) -> list[dict[str, Any]]:
    """The run records of one results file (its first `limit` simulations by task), with a
    line of what it held; repeated calls seen are added to `loops`, run ids to `seen`."""
    runs: list[dict[str, Any]] = []
    results = json.loads(data)
    simulations = results.get("simulations") if isinstance(results, dict) else results
    info = results.get("info") if isinstance(results, dict) else None
    info = info or {}
    model = (info.get("agent_info") or {}).get("llm")
    domain = (info.get("environment_info") or {}).get("domain_name")
    chosen = sorted(simulations or [], key=task_key)[:limit]
    tally: Counter[str | None] = Counter()
    for sim in chosen:
        sim_domain = domain or str(sim.get("domain") or "unknown")
        run_id = numbered(
            f"tau2/{submission}/{sim_domain}/{sim.get('task_id')}/{sim.get('trial')}", seen
        )
        steps = steps_of(sim.get("messages") or [])
        run = service_run(
            run_id, reward_of(sim), steps, loops, REPO, commit, path, submission, model
        )
        tally[run["outcome"]] += 1
        runs.append(run)
    print(
        f"{submission}/{name}: {len(simulations or [])} simulations in the file, "
        f"{len(chosen)} taken, model {model}, domain {domain}; "
        f"success {tally['success']}, failure {tally['failure']}, no reward {tally[None]}"
    )
    return runs


def service_run(
    run_id: str,
    reward: float | None,
    steps: list[dict[str, Any]],
    loops: list[tuple[int, str, str]],
    repo: str,
    commit: str,
    path: str,
    harness: str,
    model: str | None,
) -> dict[str, Any]:
    """One customer-service run; a call it repeats three times or more is added to `loops`."""
    count, what = loop_signs(steps)
    if count >= 3:
        loops.append((count, run_id, what))
    return run_record(
        run_id,
        repo=repo,
        commit=commit,
        path=path,
        harness=harness,
        model=model,
        kind="service",
        outcome=outcome_of(reward),
        reward=reward,
        steps=steps,
    )


def write_and_check(name: str, runs: list[dict[str, Any]]) -> None:
    """Write the runs as fixture `name`, then count what still looks like a key in what was
    written."""
    target = write_runs(name, runs)
    print(f"wrote {target} ({target.stat().st_size} bytes)")
    leftovers: Counter[str] = Counter()
    for run in read_runs(target):
        for match in KEYLIKE.finditer(json.dumps(run, ensure_ascii=False)):
            leftovers[match.group(0)[:12]] += 1
    print(f"key-like strings left in the output: {dict(leftovers) or 'none'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--git-dir", required=True)
    parser.add_argument("--commit", help="read every file at this commit")
    parser.add_argument("--dry-run", action="store_true", help="convert and report, write nothing")
    args = parser.parse_args()
    snapshot = git(args.git_dir, "rev-parse", "HEAD").decode().strip()
    print(f"snapshot HEAD {snapshot}")

    runs: list[dict[str, Any]] = []
    seen: Counter[str] = Counter()
    loops: list[tuple[int, str, str]] = []
    skipped = []
    for submission, name, commit, limit in CHOSEN:
        commit = args.commit or commit
        path = f"{SUBMISSIONS}/{submission}/trajectories/{name}"
        try:
            found = git(args.git_dir, "rev-parse", "--verify", f"{commit}^{{commit}}")
        except subprocess.CalledProcessError:
            print(f"SKIPPED {submission}/{name}: commit {commit} not in the git directory")
            skipped.append((submission, name, "commit absent"))
            continue
        full = found.decode().strip()
        data, why = read_blob(args.git_dir, full, path)
        if data is None:
            print(f"SKIPPED {submission}/{name}: {why}")
            skipped.append((submission, name, why))
            continue
        runs += runs_of_file(data, submission, name, full, path, limit, seen, loops)

    print(f"total runs {len(runs)}; files skipped {len(skipped)}")
    for count, run_id, what in sorted(loops, reverse=True)[:20]:
        print(f"  repeated call x{count}: {run_id}: {what}")
    if args.dry_run or not runs:
        if not runs:
            print("nothing written: no run could be read")
        return 1 if not runs else 0
    write_and_check("tau2", runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
