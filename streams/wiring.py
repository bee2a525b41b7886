"""What the agents share: the app, its topics and tables, the guard and the outbox."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spanguard.outcomes import Tally

# Types only: streams/app.py builds these, and the modules that define them import the agents.
if TYPE_CHECKING:
    import faust
    from faust.types import TableT
    from prometheus_client import CollectorRegistry

    from spanguard.alerting.incident_reader import IncidentReader
    from spanguard.alerting.service import PagingService
    from spanguard.alerting.webhook import WebhookService
    from spanguard.config.settings import WorkerSettings
    from spanguard.connectors.releases import ReleaseReader
    from spanguard.detection.guard import Guard
    from spanguard.detection.pipeline import SpanPipeline
    from spanguard.goal.verifier import GoalVerifier
    from spanguard.outcomes import Counted, CountedOutcome
    from spanguard.streams.agent_windows import AgentUsageRecorder
    from spanguard.streams.conversations import ConversationRecorder
    from spanguard.streams.decoded_states import DecodedStates
    from spanguard.streams.delivery import Outbox
    from spanguard.streams.health import Health
    from spanguard.streams.metrics import ConsumerLag, DetectionLatency
    from spanguard.streams.state_table import StateTable
    from spanguard.streams.tool_scope import ToolCallRecorder

__all__ = ["Worker"]


@dataclass
class Worker:
    app: faust.App
    settings: WorkerSettings
    spans_in: faust.TopicT  # the Collector's topic and the repartition topic
    goal_checks: faust.TopicT
    detections_in: faust.TopicT
    table: StateTable  # trace id -> TraceState bytes
    paged: TableT  # trace id -> rules already paged
    notified: TableT | None  # trace id -> rules already sent to the webhook (a webhook only)
    states: DecodedStates
    guard: Guard
    pipeline: SpanPipeline
    outbox: Outbox
    health: Health
    paging: PagingService
    webhook: WebhookService
    verifier: GoalVerifier | None
    releases: ReleaseReader
    incident_reader: IncidentReader
    # Which part counts each outcome enum: what /metrics reads (the agents add their own).
    counted: dict[type[CountedOutcome], Counted[Any]]
    registry: CollectorRegistry  # what /metrics serves
    latency: DetectionLatency
    lag: ConsumerLag
    # The conversation scope, when a policy entry turns it on: what the span agent's guard
    # records, and the topic it sends the records to (streams/conversations.py).
    recorder: ConversationRecorder | None = None
    conversations_out: faust.TopicT | None = None
    # Agent budgets over a window, when a policy entry sets one: what the span agent's guard
    # records, and the topic it sends the records to (streams/agent_windows.py).
    usage_recorder: AgentUsageRecorder | None = None
    agent_usage_out: faust.TopicT | None = None
    # The tool scope, when the policy's fleet rules are on: what the span agent's guard
    # records, and the topic it sends the records to (streams/tool_scope.py).
    tool_recorder: ToolCallRecorder | None = None
    tool_calls_out: faust.TopicT | None = None

    def tally(self, outcome: type[CountedOutcome]) -> Tally:
        """The Tally streams/app.py made for `outcome`: where the agents that count it count."""
        tally = self.counted[outcome]
        assert isinstance(tally, Tally)
        return tally
