"""The chart rendered by real helm (scripts/helm.sh builds it from the Go module proxy, once)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "spanguard"
HELM_SH = ROOT / "scripts" / "helm.sh"
# The first `go install` of helm compiles a few hundred packages: minutes on a small machine.
HELM_INSTALL_TIMEOUT = 1800
# Every dashboard and alert the chart can ship.
MONITORING_ON = (
    "monitoring.dashboard.enabled=true",
    "monitoring.serviceMonitor.enabled=true",
    "monitoring.prometheusRule.enabled=true",
)
# The alerts of the chart's PrometheusRule.
ALERTS = frozenset(
    {
        "SpanguardWorkerDown",
        "SpanguardConsumerLagGrowing",
        "SpanguardDeadLettersRising",
        "SpanguardPagesUndeliverable",
        "SpanguardFetchStalls",
    }
)


def helm_sh() -> Path:
    """scripts/helm.sh with helm installed; skips only where `go` is absent."""
    proc = subprocess.run(
        [str(HELM_SH), "path"], capture_output=True, text=True, timeout=HELM_INSTALL_TIMEOUT
    )
    if proc.returncode != 0:
        if shutil.which("go") is None:
            pytest.skip(f"go is not installed, so scripts/helm.sh cannot build helm: {proc.stderr}")
        pytest.fail(f"scripts/helm.sh path failed:\n{proc.stderr}")
    return HELM_SH


def render(*sets: str, release: str = "sg", namespace: str = "agents") -> list[dict[str, Any]]:
    """`helm template` of the chart with `--set` items: the documents it prints."""
    args = [str(helm_sh()), "template", release, str(CHART), "--namespace", namespace]
    for item in sets:
        args += ["--set", item]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
