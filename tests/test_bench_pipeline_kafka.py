"""`make bench-pipeline` in miniature, on the real broker: the Collector's latency run at two
rates, the scope phase with the tool scope on, the fleet phase, and (where the compiled core is
built: `python scripts/compiled_core.py build`) the compiled worker on the packed path, each once,
small. The figures are not judged (a tiny run on a shared machine); the lines and keys are."""

from __future__ import annotations

import json

import pytest

from bench.bench_pipeline import compiled_core_built, main

pytestmark = pytest.mark.kafka


def test_the_bench_runs_its_collector_scope_and_fleet_phases_in_miniature(capsys) -> None:
    compiled = compiled_core_built()
    phases = "one,latency,collector,scopes,fleet" + (",compiled" if compiled else "")
    argv = ["--phases", phases, "--runs", "1"]
    argv += ["--spans", "3000", "--traces", "60", "--latency-traces", "60", "--seconds", "3"]
    argv += ["--rate", "500", "--rates", "500,1000", "--scope-rounds", "1"]
    argv += ["--scope-builds", "python", "--fleet-incidents", "2", "--fleet-segment", "4"]
    argv += ["--drain-timeout", "90"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    targets = next(line for line in out.splitlines() if line.startswith("targets"))
    # Both rates are in the targets line, each judged or said not reached.
    assert "p99 < 100 ms at 500 spans/s:" in targets
    assert "p99 < 100 ms at 1,000 spans/s:" in targets
    assert "collector_latency_1000_p99_ms" in result
    assert "packed_latency_1000_p99_ms" in result  # the packed path at each rate too
    # The scope-on worker ran the tool scope: it sent tool call records.
    assert "conversation, agent and tool scopes on" in out
    assert result["scopes_tool_call_records"] > 0
    # ... and the tool scope's own cost is judged against the worker without it.
    assert "tool scope on >= 0.8 of off:" in targets
    assert result["scopes_tool_off_spans_per_s"] > 0
    # The fleet phase: one incident per failing tool, timed from its crossing.
    assert "fleet incident p99 within a step (30 s):" in targets
    fleet = next(line for line in out.splitlines() if line.startswith("fleet decision time"))
    assert result["fleet_incidents_expected"] == 2
    assert result["fleet_incidents_crossed"] == 2, fleet  # every failing tool was posted
    # (When one is missing, the bench prints the worker's counts and log before that line.)
    assert result["fleet_incidents_opened"] == 2, out[max(0, out.index(fleet) - 6000) :]
    assert len(result["fleet_decision_ms"]) == 2, fleet
    assert result["fleet_tool_call_records"] > 0
    if compiled:
        assert "compiled packed >= 0.25 of compiled core:" in targets
        assert result["compiled_packed_drain_complete"]
