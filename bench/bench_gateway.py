"""What spanguard's guardrail adds to a model call through the real LiteLLM proxy.

Two proxies from the gateway's virtualenv (`make gateway-venv`) in one run, the same scripted
model behind both (a local OpenAI-compatible server that answers at once): one with the
guardrail reading a real kill topic on the shared broker (and its book holding `--kills`
other traces' kills, a fleet's worth), one without. Calls alternate between them, so both see
the same machine load; each call names a trace (`traceparent`). Prints p50 and p99 per call for
each, the guardrail's added time and the ratio. No `otel` callback: the guardrail alone is
measured.

    python -m bench.bench_gateway [--calls 400] [--kills 5000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from spanguard.schemas.decision import sign
from tests.support import gateway
from tests.support.kafka_harness import (
    BOOTSTRAP,
    SIGNING_KEY,
    ensure_broker,
    producer,
    scratch_topic,
)
from tests.support.spans import kill_signal


def _config(model_url: str, guarded: bool, kill_topic: str) -> str:
    text = gateway.proxy_config(
        model_url, guardrail=guarded, kill_topic=kill_topic, bootstrap_servers=BOOTSTRAP,
        ack_topic=None,
    )  # fmt: skip
    return text.replace('  callbacks: ["otel"]\n', "  callbacks: []\n")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400, help="calls per proxy")
    parser.add_argument("--kills", type=int, default=5000, help="other traces' kills on the topic")
    args = parser.parse_args(argv)
    if (reason := gateway.missing()) is not None:
        raise SystemExit(reason)
    ensure_broker()
    with (
        tempfile.TemporaryDirectory() as tmp,
        gateway.ScriptedModel() as model,
        scratch_topic(4, "bench-gateway-kills") as kill_topic,
    ):
        env = {"SPANGUARD_SIGNING_KEY": SIGNING_KEY}
        guarded = gateway.Proxy(_config(model.base_url, True, kill_topic), Path(tmp, "g"), env)
        bare = gateway.Proxy(_config(model.base_url, False, kill_topic), Path(tmp, "b"), env)
        with guarded, bare:
            time.sleep(3.0)  # the guardrail's consumer positioned at the topic's end
            send = producer()
            for _ in range(args.kills):  # read into the guardrail's book, bounded by it
                record = sign(kill_signal(uuid.uuid4().hex).to_dict(), SIGNING_KEY.encode())
                send.produce(kill_topic, json.dumps(record).encode())
            send.flush(30)
            time.sleep(2.0)
            times: dict[str, list[float]] = {"without": [], "with": []}
            messages = [{"role": "user", "content": "healthy"}]
            for i in range(args.calls + 20):
                for name, proxy in (("with", guarded), ("without", bare))[:: 1 if i % 2 else -1]:
                    headers = {"traceparent": f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"}
                    start = time.perf_counter()
                    status, body = gateway.chat(proxy.base_url, messages, headers)
                    elapsed = time.perf_counter() - start
                    if status != 200:
                        raise SystemExit(f"{name}: {status} {body}")
                    if i >= 20:  # the first calls warm both up
                        times[name].append(elapsed * 1000)
    print(f"{args.calls} calls per proxy, alternating; {args.kills} other traces' kills read")
    print(f"{'':9} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for name in ("without", "with"):
        values = times[name]
        print(
            f"{name:9} {_percentile(values, 0.5):8.2f} {_percentile(values, 0.99):8.2f}"
            f" {statistics.fmean(values):8.2f}"
        )
    for label, q in (("p50", 0.5), ("p99", 0.99)):
        plain, guarded_ms = _percentile(times["without"], q), _percentile(times["with"], q)
        print(
            f"guardrail adds {label}: {guarded_ms - plain:+.2f} ms"
            f" (ratio with/without {guarded_ms / plain:.3f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
