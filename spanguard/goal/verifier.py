"""Goal completion, step two: which invocation ends to judge, and what a verdict becomes.

Pure: the judge comes from `judge_factory` (the worker passes the HTTP judge of
`spanguard.connectors.judge`). The worker forwards messages that hold a root span to a topic of their own; its
goal agent calls `GoalVerifier.check` there, so a slow judge never delays loop or budget rules.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Protocol

from spanguard.detection.conventions.keys import AGENT_NAME, SERVICE_NAME
from spanguard.errors import JudgeError, OtlpDecodeError
from spanguard.goal.invocations import InvocationEnd, find_invocation_ends
from spanguard.goal.sampling import should_sample
from spanguard.goal.verdicts import Judge
from spanguard.outcomes import CountedOutcome, Tally
from spanguard.schemas.decision import AgentIdentity, Decision, Evidence, PolicyInForce, Rule
from spanguard.schemas.otlp import decode_protobuf
from spanguard.schemas.policy import Policy

__all__ = ["GoalOutcome", "GoalVerifier"]

log = logging.getLogger("spanguard.goal")

GOAL_UNMET: Rule = "goal_unmet"


class JudgeChoice(Protocol):
    """The two judge settings the verifier reads (`spanguard.config.settings.GoalSettings` has
    them); a protocol, so that the kernel does not import the layer that reads the environment."""

    @property
    def enabled(self) -> bool: ...

    @property
    def model(self) -> str | None: ...


class GoalOutcome(CountedOutcome):
    """What became of an ended agent invocation the verifier read."""

    MET = "met"
    UNMET = "unmet"  # a goal_unmet decision
    LOW_CONFIDENCE = "low_confidence"  # unmet, below the policy's goal.min_confidence
    NO_CONTENT = "no_content"  # no request/answer recorded: nothing to judge
    NOT_SAMPLED = "not_sampled"
    DISABLED = "disabled"  # the agent's policy has the verifier off
    JUDGE_ERROR = "judge_error"


class GoalVerifier:
    def __init__(
        self,
        policy: Policy,
        settings: JudgeChoice,
        *,
        judge_factory: Callable[[str], Judge],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy
        self.settings = settings
        self.clock = clock
        self._judge_factory = judge_factory  # model name -> judge, one per model
        self._judges: dict[str, Judge] = {}
        self.outcomes = Tally()
        self._warned_no_content: set[str] = set()

    @property
    def wanted(self) -> bool:
        """Whether any agent has the verifier on and a judge is configured."""
        enabled = self.policy.defaults.goal.enabled or any(
            rule.policy.goal.enabled for rule in self.policy.rules
        )
        return enabled and self.settings.enabled

    async def check(self, message: bytes) -> tuple[list[Decision], list[str]]:
        """The goal_unmet decisions for the invocations that end in `message`, and errors."""
        try:
            ends = decode_ends(message)
        except OtlpDecodeError as exc:
            return [], [str(exc)]
        decisions: list[Decision] = []
        errors: list[str] = []
        for end in ends:
            try:
                decision = await self._check_one(end)
            except JudgeError as exc:
                self.outcomes.add(GoalOutcome.JUDGE_ERROR)
                log.warning(
                    "goal check failed", extra={"trace_id": end.trace_id, "error": str(exc)}
                )
                errors.append(f"goal check of trace {end.trace_id} failed: {exc}")
                continue
            if decision is not None:
                decisions.append(decision)
        return decisions, errors

    async def _check_one(self, end: InvocationEnd) -> Decision | None:
        attributes = {SERVICE_NAME: end.service}
        if end.agent_name:
            attributes[AGENT_NAME] = end.agent_name
        policy = self.policy.for_attributes(attributes)
        if not policy.goal.enabled:
            self.outcomes.add(GoalOutcome.DISABLED)
            return None
        if not end.has_content:
            # Content capture is opt-in: without the request and the answer there is nothing
            # to judge, and guessing would be worse than saying so.
            self.outcomes.add(GoalOutcome.NO_CONTENT)
            if end.kind == "agent" and end.service not in self._warned_no_content:
                self._warned_no_content.add(end.service)
                log.warning(
                    "agent runs of service %r record no request/answer content: the goal"
                    " verifier skips them (turn on content capture, e.g."
                    " OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true)",
                    end.service,
                )
            return None
        if not should_sample(end.trace_id, policy.goal.sample_rate):
            self.outcomes.add(GoalOutcome.NOT_SAMPLED)
            return None
        model = policy.goal.model or self.settings.model or ""
        judge = self._judges.get(model)
        if judge is None:
            judge = self._judges[model] = self._judge_factory(model)
        verdict = await judge.judge(end)
        if verdict.satisfied:
            self.outcomes.add(GoalOutcome.MET)
            return None
        if verdict.confidence < policy.goal.min_confidence:
            self.outcomes.add(GoalOutcome.LOW_CONFIDENCE)
            return None
        self.outcomes.add(GoalOutcome.UNMET)
        return Decision(
            trace_id=end.trace_id,
            span_id=end.span_id,
            rule=GOAL_UNMET,
            action="flag",
            reason=f"the answer does not do what was asked: {verdict.reason}",
            agent=AgentIdentity(end.service, end.agent_name),
            detected_at=datetime.fromtimestamp(self.clock(), UTC).isoformat(
                timespec="milliseconds"
            ),
            evidence=Evidence(confidence=verdict.confidence),
            policy=PolicyInForce(severity=policy.severity, autonomous=policy.autonomous),
        )

    async def aclose(self) -> None:
        for judge in self._judges.values():
            close = getattr(judge, "aclose", None)
            if close is not None:
                await close()


def decode_ends(message: bytes) -> list[InvocationEnd]:
    return find_invocation_ends(decode_protobuf(message))
