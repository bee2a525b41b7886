"""One secret reader for the worker and the agents' KillSwitch: the same variables and files,
the same whitespace rule, bounded reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from spanguard.config.secrets import MAX_SECRET_BYTES, read_secret, signing_keys_from_env
from spanguard.config.settings import WorkerSettings
from spanguard.errors import SecretError, SettingsError
from spanguard.killswitch.client import KillSwitch
from spanguard.schemas.decision import key_id, sign
from tests.support.kafka_harness import ROOT
from tests.support.spans import kill_signal


def stack_key_file(tmp_path) -> str:
    """The key file `scripts/stack.sh` makes for the worker and the agents of a stack."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPANGUARD_SIGNING_KEY")}
    env["SPANGUARD_STACK_DIR"] = str(tmp_path / "stack")
    result = subprocess.run(
        [str(ROOT / "scripts" / "stack.sh"), "key-file"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return result.stdout.strip()


def test_the_stacks_key_file_means_one_key_to_the_worker_and_the_killswitch(tmp_path):
    key_file = stack_key_file(tmp_path)
    assert Path(key_file).read_bytes().endswith(b"\n")  # as `print()` wrote it
    env = {"SPANGUARD_SIGNING_KEY_FILE": key_file}
    worker_key = WorkerSettings.from_sources({}, env).kill_signing_key()
    switch = KillSwitch("127.0.0.1:1", start=False, environ=env)
    assert switch._keys == {key_id(worker_key): worker_key}

    # A signal the worker signs is obeyed, never `unknown_key`.
    trace_id = uuid.uuid4().hex
    record = sign(kill_signal(trace_id).to_dict(), worker_key)
    switch._accept(json.dumps(record).encode())
    assert switch.ignored == {} and switch.signals.is_killed(trace_id)


def test_a_key_passed_in_is_read_by_the_same_whitespace_rule(tmp_path):
    """The key file's content read by hand, newline and all: the same key as the worker's."""
    key_file = stack_key_file(tmp_path)
    worker_key = WorkerSettings.from_sources({}, {"SPANGUARD_SIGNING_KEY_FILE": key_file})
    raw = Path(key_file).read_text()
    switch = KillSwitch("127.0.0.1:1", signing_key=raw, start=False, environ={})
    assert list(switch._keys.values()) == [worker_key.kill_signing_key()]
    switch = KillSwitch("127.0.0.1:1", signing_key=raw.encode(), start=False, environ={})
    assert list(switch._keys.values()) == [worker_key.kill_signing_key()]


def test_the_rotation_set_comes_from_the_previous_key_variables(tmp_path):
    previous = tmp_path / "previous"
    previous.write_text("  the-old-signing-key-0123456789\n")
    env = {"SPANGUARD_SIGNING_KEY": "the-new-signing-key-0123456789",
           "SPANGUARD_PREVIOUS_SIGNING_KEY_FILE": str(previous)}  # fmt: skip
    assert signing_keys_from_env(env) == [
        b"the-new-signing-key-0123456789",
        b"the-old-signing-key-0123456789",
    ]
    switch = KillSwitch("127.0.0.1:1", start=False, environ=env)
    assert len(switch._keys) == 2


def test_no_key_anywhere_is_refused_with_the_variables_named():
    with pytest.raises(SettingsError, match="SPANGUARD_SIGNING_KEY_FILE"):
        KillSwitch("127.0.0.1:1", start=False, environ={})


@pytest.mark.parametrize("path", ["/dev/zero", "big"])
def test_a_key_file_larger_than_a_key_is_one_line_of_error(tmp_path, path):
    if path == "big":
        path = str(tmp_path / "big")
        with open(path, "wb") as file:
            file.write(b"k" * (MAX_SECRET_BYTES + 1))
    env = {"SPANGUARD_SIGNING_KEY_FILE": path}
    with pytest.raises(SecretError, match="holds more than 65536 bytes") as raised:
        read_secret(env, "SPANGUARD_SIGNING_KEY", "SPANGUARD_SIGNING_KEY_FILE")
    assert "\n" not in str(raised.value)
    with pytest.raises(SecretError, match="holds more than"):
        KillSwitch("127.0.0.1:1", start=False, environ=env)


def test_the_worker_refuses_dev_zero_in_one_line():
    env = {**os.environ, "SPANGUARD_SIGNING_KEY_FILE": "/dev/zero"}
    env.pop("SPANGUARD_SIGNING_KEY", None)
    result = subprocess.run(
        [sys.executable, "-m", "spanguard.cli", "worker", "--bootstrap", "127.0.0.1:1"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "SPANGUARD_SIGNING_KEY_FILE: '/dev/zero' holds more than" in result.stderr


def test_a_key_file_that_is_not_text_or_empty_is_refused(tmp_path):
    binary, blank = tmp_path / "binary", tmp_path / "blank"
    binary.write_bytes(b"\xff\xfe\x00key")
    blank.write_text(" \n\t\n")
    for path, message in ((binary, "not UTF-8"), (blank, "empty")):
        with pytest.raises(SecretError, match=message):
            read_secret({"K_FILE": str(path)}, "K", "K_FILE")


def test_a_key_file_path_holding_a_nul_byte_is_one_line_of_error():
    env = {"SPANGUARD_SIGNING_KEY_FILE": "/run/secrets/key\0x"}
    with pytest.raises(SecretError, match="NUL byte") as raised:
        read_secret(env, "SPANGUARD_SIGNING_KEY", "SPANGUARD_SIGNING_KEY_FILE")
    assert "\n" not in str(raised.value)
