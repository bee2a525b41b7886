"""What `pip install spanguard` gives: a lean core, the worker as an extra, ranges for libraries,
the tested pins in constraints.txt (used by the Dockerfile and `make install`), py.typed and
one version.

The slow test builds the wheel and installs it into a fresh venv beside another supported
OpenTelemetry SDK than the one the project pins, then runs the killswitch there against the
real broker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
import uuid
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import spanguard

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Not the project's pin (1.45.2), and inside its supported range (>=1.30,<2).
OTHER_OTEL = "1.33.1"
WORKER_ONLY = {
    "faust-streaming",
    "aiokafka",
    "pagerduty",
    "httpx2",
    "rocksdict",
    "prometheus-client",
    "genai-prices",  # brings httpx2; agents add it with spanguard[prices] where they price
}


# Extras tested in a virtualenv of their own, at the pins of their own constraints file (the
# gateway's: LiteLLM's pins conflict with constraints.txt; `make gateway-venv`).
OWN_CONSTRAINTS = {"litellm": "constraints-litellm.txt"}


def constraints(path: str = "constraints.txt") -> dict[str, str]:
    pins = {}
    for line in (ROOT / path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path} pins exact versions: {line!r}"
            pins[canonicalize_name(name)] = version
    return pins


def test_the_core_is_lean_and_takes_ranges():
    core = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    names = {canonicalize_name(r.name) for r in core}
    assert not names & WORKER_ONLY, names & WORKER_ONLY
    for requirement in core:
        assert not any(s.operator == "==" for s in requirement.specifier), requirement
    worker = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["optional-dependencies"]["worker"]}  # fmt: skip
    assert worker >= WORKER_ONLY


def test_constraints_pin_every_dependency_inside_its_range():
    project = PYPROJECT["project"]
    files = {"constraints.txt": list(project["dependencies"])}
    for extra, requirements in project["optional-dependencies"].items():
        files.setdefault(OWN_CONSTRAINTS.get(extra, "constraints.txt"), []).extend(requirements)
    files[OWN_CONSTRAINTS["litellm"]] += project["dependencies"]
    for path, requirements in files.items():
        pins = constraints(path)
        for line in requirements:
            requirement = Requirement(line)
            name = canonicalize_name(requirement.name)
            assert name in pins, f"{name} is not in {path}"
            assert requirement.specifier.contains(pins[name], prereleases=True), (
                path,
                line,
                pins[name],
            )
        assert "spanguard" not in pins


def test_the_dockerfile_and_make_install_use_the_constraints_file():
    dockerfile = (ROOT / "Dockerfile").read_text()
    installs = [
        line for line in dockerfile.replace("\\\n", " ").splitlines()
        if "pip install" in line and '".[' in line
    ]  # fmt: skip
    assert installs, "the Dockerfile installs the project"
    for line in installs:
        assert "-c constraints.txt" in line, line
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert "constraints.txt" not in ignored and "*.txt" not in ignored
    makefile = (ROOT / "Makefile").read_text()
    assert '-c constraints.txt -e ".[dev,worker,demo,instrumentation-tests]"' in makefile
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["x-spanguard-build"]["args"]["EXTRAS"] == "worker,demo"


def test_one_version():
    assert PYPROJECT["project"]["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "spanguard.__version__"
    }
    assert metadata.version("spanguard") == spanguard.__version__
    chart = yaml.safe_load((ROOT / "helm" / "spanguard" / "Chart.yaml").read_text())
    assert chart["appVersion"] == spanguard.__version__
    assert (ROOT / "spanguard" / "py.typed").is_file()


# ---------------------------------------------------------------------- the wheel, elsewhere

AGENT = textwrap.dedent(
    """
    import importlib.metadata as m, importlib.util, json, sys
    from datetime import UTC, datetime
    from confluent_kafka import Producer
    from opentelemetry.sdk.trace import TracerProvider
    from spanguard.killswitch import AgentKilled
    from spanguard.killswitch.client import KillSwitch
    from spanguard.schemas.decision import AgentIdentity, Decision, Evidence, KillSignal, sign

    bootstrap, topic, key = sys.argv[1:4]
    tracer = TracerProvider().get_tracer("lean-agent")
    with KillSwitch(bootstrap, topic, signing_key=key) as switch, \\
            tracer.start_as_current_span("invoke_agent lean") as span:
        trace_id = format(span.get_span_context().trace_id, "032x")
        assert switch.check() is None
        signal = KillSignal.from_decision(Decision(
            trace_id=trace_id, span_id="00f067aa0ba902b7", rule="tool_loop", action="kill",
            reason="search_docs called 4x in last 4 steps", agent=AgentIdentity("lean"),
            detected_at=datetime.now(UTC).isoformat(timespec="milliseconds"),  # not expired
            evidence=Evidence(
                tool_name="search_docs", args_hash="1d79773f7dd21571", hits=4, window=10, steps=4
            ),
        ))
        record = sign(signal.to_dict(), key.encode())
        out = Producer({"bootstrap.servers": bootstrap})
        out.produce(topic, key=trace_id.encode(), value=json.dumps(record).encode())
        assert out.flush(10) == 0
        import time
        deadline = time.monotonic() + 20
        while not switch.received and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            switch.check()
            killed = False
        except AgentKilled:
            killed = True
    print(json.dumps({
        "killed": killed,
        "sdk": m.version("opentelemetry-sdk"),
        "proto": m.version("opentelemetry-proto"),
        "lean": [n for n in ("faust", "aiokafka", "pagerduty", "httpx2", "rocksdict")
                 if importlib.util.find_spec(n) is not None],
    }))
    """
)


@pytest.mark.slow
@pytest.mark.kafka
# pip builds the wheel in ROOT/build, where the fixture generators' editable installs of this
# checkout write too: under xdist the tests that build or install this checkout share one worker.
@pytest.mark.xdist_group("this_checkout_built")
def test_the_wheel_installs_lean_beside_another_otel_sdk_and_the_killswitch_works(tmp_path):
    from tests.support.kafka_harness import CLUSTER, ensure_broker

    if CLUSTER.security.security_protocol != "PLAINTEXT":
        pytest.skip("the lean agent script speaks plaintext")
    bootstrap = ensure_broker()
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("spanguard-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert "spanguard/py.typed" in archive.namelist()
        (meta,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        requires = Parser().parsestr(archive.read(meta).decode()).get_all("Requires-Dist")
    unconditional = {canonicalize_name(Requirement(r).name) for r in requires if "extra" not in r}
    assert not unconditional & WORKER_ONLY

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # No pip cache here: everything comes from the index, so this is the slow part.
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel),
         f"opentelemetry-sdk=={OTHER_OTEL}", f"opentelemetry-proto=={OTHER_OTEL}"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr

    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"t{uuid.uuid4().hex[:8]}-agent-kill-signals"
    admin = AdminClient(CLUSTER.config())
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPANGUARD_", "PYTHON"))}
    try:
        run = subprocess.run(
            [str(python), "-c", AGENT, bootstrap, topic, "lean-agent-signing-key-0123"],
            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
        )  # fmt: skip
    finally:
        admin.delete_topics([topic])
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"killed": True, "sdk": OTHER_OTEL, "proto": OTHER_OTEL, "lean": []}

    # The worker is an extra: asked for without it, the command says so.
    worker = subprocess.run(
        [str(venv / "bin" / "spanguard"), "worker"], capture_output=True, text=True, timeout=60,
        env=env, cwd=tmp_path,
    )  # fmt: skip
    assert worker.returncode == 2
    assert 'pip install "spanguard[worker]"' in worker.stderr, worker.stderr
    version = subprocess.run(
        [str(venv / "bin" / "spanguard"), "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.stdout.strip() == f"spanguard {spanguard.__version__}"
