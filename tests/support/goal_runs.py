"""An agent's run as the goal verifier sees it: real-SDK spans with GenAI content (a user's
request, the agent's answer, its instructions), and what a judge is asked about it."""

from __future__ import annotations

import json

from spanguard.goal.invocations import InvocationEnd
from spanguard.schemas.otlp import decode_protobuf
from tests.support.spans import AgentRecorder, encode

REQUEST = "What is the refund policy for items that arrive damaged?"
ANSWER = "Damaged items are refunded in full within 30 days; send a photo to support."
INSTRUCTIONS = "You are the support agent of an online shop. Be precise."

INPUT_MESSAGES = [
    {"role": "system", "parts": [{"type": "text", "content": "ignored: not the user"}]},
    {"role": "user", "parts": [{"type": "text", "content": "Hi, an earlier question"}]},
    {"role": "assistant", "parts": [{"type": "text", "content": "Hello! How can I help?"}]},
    {"role": "user", "parts": [{"type": "text", "content": REQUEST}]},
]
OUTPUT_MESSAGES = [
    {
        "role": "assistant",
        "parts": [
            {"type": "tool_call", "id": "call_1", "name": "search_docs", "arguments": {"q": "x"}},
            {"type": "text", "content": ANSWER},
        ],
        "finish_reason": "stop",
    }
]
SYSTEM_INSTRUCTIONS = [{"type": "text", "content": INSTRUCTIONS}]


def genai_content(**overrides) -> dict[str, str]:
    content = {
        "gen_ai.input.messages": json.dumps(INPUT_MESSAGES),
        "gen_ai.output.messages": json.dumps(OUTPUT_MESSAGES),
        "gen_ai.system_instructions": json.dumps(SYSTEM_INSTRUCTIONS),
    }
    content.update(overrides)
    return {k: v for k, v in content.items() if v is not None}


def agent_run(agent_name: str = "support", **root_attributes) -> AgentRecorder:
    agent = AgentRecorder("support-bot", agent_name)
    agent.chat(800, 60)
    agent.tool("search_docs", {"query": "refund damaged"})
    agent.chat(1200, 90)
    agent.finish(**root_attributes)
    return agent


def wire(spans):
    """Through the bytes the Collector writes, as the worker will see them."""
    return decode_protobuf(encode(spans).SerializeToString())


CASE = InvocationEnd(
    trace_id="0af7651916cd43dd8448eb211c80319c",
    span_id="b7ad6b7169203331",
    service="support-bot",
    agent_name="support",
    request=REQUEST,
    answer=ANSWER,
    instructions=INSTRUCTIONS,
)

# A judge's reply that is a verdict.
GOOD_JSON = '{"satisfied": true, "confidence": 0.8, "reason": "It answers the question."}'
