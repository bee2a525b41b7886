"""The guard policy: defaults plus per-agent overrides, read from YAML and checked by JSON Schema.

Shape (every field optional):

    defaults:
      loop: {window: 10, threshold: 4}
      polling: {window: 30, threshold: 20, tools: []}   # same call, changing result
      no_progress: {threshold: 4, action: flag}         # different calls, one same result
      volatile_keys: [...]       # added to the built-in volatile keys
      fold: {}                   # tool name -> [case, whitespace]: folded before hashing
      token_budget: null         # tokens per trace; null = no budget
      action: kill               # kill | downgrade  (tool_loop; a token budget is a hard cap)
      autonomous: false          # true: also page on-call
      missing_args: skip         # skip | name_only
      record_arguments: false    # keep raw tool arguments in decisions
      severity: error            # PagerDuty severity for autonomous agents
      goal: {enabled: false, model: null, min_confidence: 0.7, sample_rate: 1.0}
    agents:                      # first match wins; match on resource or span attributes
      - match: {service.name: research-assistant}
        loop: {window: 20, threshold: 4}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import jsonschema
import yaml

from spanguard.errors import PolicyError

__all__ = ["DEFAULT_VOLATILE_KEYS", "AgentPolicy", "Policy", "PolicyError"]

# Keys that change on every call without changing its intent.
DEFAULT_VOLATILE_KEYS: frozenset[str] = frozenset(
    {"timestamp", "request_id", "trace_id", "span_id", "nonce", "now", "_ts", "correlation_id"}
)

# What a policy may ask for on a loop (a decision's `Action` adds "flag", for goal checks).
LoopAction = Literal["kill", "downgrade"]
MissingArgs = Literal["skip", "name_only"]
NoProgressAction = Literal["flag", "kill", "downgrade", "off"]
Severity = Literal["critical", "error", "warning", "info"]


@dataclass(frozen=True, slots=True)
class AgentPolicy:
    """The settings in force for one agent."""

    window: int = 10
    threshold: int = 4
    # Polling: the same call whose recorded result changes; much more patience than a loop.
    polling_window: int = 30
    polling_threshold: int = 20
    polling_tools: frozenset[str] = frozenset()  # always polling, even when the result repeats
    # No progress: `threshold` different calls of one tool in the window, all the same result.
    no_progress_threshold: int = 4
    no_progress_action: NoProgressAction = "flag"
    volatile_keys: frozenset[str] = DEFAULT_VOLATILE_KEYS
    # Tool name -> foldings ("case", "whitespace") applied to its string arguments.
    fold: tuple[tuple[str, frozenset[str]], ...] = ()
    token_budget: int | None = None
    action: LoopAction = "kill"
    autonomous: bool = False
    missing_args: MissingArgs = "skip"
    record_arguments: bool = False
    severity: Severity = "error"
    # The goal verifier: off by default (every verdict is a model call that costs money).
    goal_enabled: bool = False
    goal_model: str | None = None  # None: the judge's configured default model
    goal_min_confidence: float = 0.7
    goal_sample_rate: float = 1.0

    def merged(self, settings: Mapping[str, Any]) -> AgentPolicy:
        """These settings with `settings` (one validated policy section) laid over them."""
        changes: dict[str, Any] = {}
        loop = settings.get("loop") or {}
        if "window" in loop:
            changes["window"] = loop["window"]
        if "threshold" in loop:
            changes["threshold"] = loop["threshold"]
        polling = settings.get("polling") or {}
        for name in ("window", "threshold"):
            if name in polling:
                changes[f"polling_{name}"] = polling[name]
        if "tools" in polling:
            changes["polling_tools"] = frozenset(polling["tools"])
        no_progress = settings.get("no_progress") or {}
        for name in ("threshold", "action"):
            if name in no_progress:
                changes[f"no_progress_{name}"] = no_progress[name]
        if "volatile_keys" in settings:
            changes["volatile_keys"] = self.volatile_keys | frozenset(settings["volatile_keys"])
        if "fold" in settings:
            folds = dict(self.fold)
            folds.update((tool, frozenset(how)) for tool, how in settings["fold"].items())
            changes["fold"] = tuple(sorted(folds.items()))
        for name in (
            "token_budget",
            "action",
            "autonomous",
            "missing_args",
            "record_arguments",
            "severity",
        ):
            if name in settings:
                changes[name] = settings[name]
        goal = settings.get("goal") or {}
        for name in ("enabled", "model", "min_confidence", "sample_rate"):
            if name in goal:
                changes[f"goal_{name}"] = goal[name]
        return replace(self, **changes)

    def folding(self, tool_name: str) -> frozenset[str]:
        """The foldings the policy asks for on `tool_name`'s string arguments."""
        for tool, how in self.fold:
            if tool == tool_name:
                return how
        return frozenset()


@dataclass(frozen=True, slots=True)
class _Rule:
    match: tuple[tuple[str, str], ...]
    policy: AgentPolicy


@dataclass(frozen=True)
class Policy:
    """Defaults plus ordered per-agent rules; `for_attributes` picks the one in force."""

    defaults: AgentPolicy = field(default_factory=AgentPolicy)
    rules: tuple[_Rule, ...] = ()

    @property
    def match_keys(self) -> frozenset[str]:
        """Every attribute name some rule matches on."""
        return frozenset(key for rule in self.rules for key, _ in rule.match)

    def for_attributes(self, attributes: Mapping[str, str]) -> AgentPolicy:
        """The first rule whose match equals `attributes`, else the defaults."""
        for rule in self.rules:
            if all(attributes.get(key) == value for key, value in rule.match):
                return rule.policy
        return self.defaults

    @classmethod
    def from_mapping(cls, document: Any, *, source: str = "policy") -> Policy:
        if document is None:
            document = {}
        _validate(document, source)
        defaults = AgentPolicy().merged(document.get("defaults") or {})
        _check_loop(defaults, f"{source}: field defaults.loop")
        rules = []
        for index, entry in enumerate(document.get("agents") or ()):
            # Match values compare as strings: attributes arrive typed, YAML guesses types.
            match = tuple((key, _as_text(value)) for key, value in entry["match"].items())
            merged = defaults.merged(entry)
            _check_loop(merged, f"{source}: field agents.{index}.loop")
            rules.append(_Rule(match, merged))
        return cls(defaults, tuple(rules))

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PolicyError(f"{path}: cannot read policy: {exc.strerror}") from None
        try:
            document = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PolicyError(f"{path}: not valid YAML: {exc}") from None
        return cls.from_mapping(document, source=str(path))


def _check_loop(policy: AgentPolicy, where: str) -> None:
    if policy.threshold > policy.window:
        raise PolicyError(
            f"{where}: threshold {policy.threshold} can never be reached"
            f" in a window of {policy.window} calls"
        )
    if policy.polling_threshold > policy.polling_window:
        raise PolicyError(
            f"{where.replace('.loop', '.polling')}: threshold {policy.polling_threshold} can"
            f" never be reached in a window of {policy.polling_window} calls"
        )
    if policy.no_progress_action != "off" and policy.no_progress_threshold > policy.window:
        raise PolicyError(
            f"{where.replace('.loop', '.no_progress')}: threshold"
            f" {policy.no_progress_threshold} can never be reached in a loop window of"
            f" {policy.window} calls"
        )


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


_SCHEMA: dict[str, Any] | None = None


def _schema() -> dict[str, Any]:
    global _SCHEMA
    if _SCHEMA is None:
        text = resources.files("spanguard.schemas").joinpath("policy.schema.json").read_text()
        _SCHEMA = json.loads(text)
    return _SCHEMA


def _validate(document: Any, source: str) -> None:
    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    if not errors:
        return
    error = jsonschema.exceptions.best_match(errors)
    where = ".".join(str(part) for part in error.absolute_path) or "(top level)"
    raise PolicyError(f"{source}: field {where}: {error.message}")
