"""The settings registry: flags over variables over defaults; secrets from env or files; the
docs/settings.md, `--help` and the deployment files agree with it."""

from pathlib import Path

import pytest

from spanguard.config.settings import (
    REGISTRY,
    GoalSettings,
    PagerSettings,
    WorkerSettings,
    settings_table,
)
from spanguard.errors import SettingsError


def test_flags_win_over_environment_which_wins_over_defaults():
    env = {"SPANGUARD_INPUT_TOPIC": "spans-from-env", "SPANGUARD_STATE_TTL": "120"}
    settings = WorkerSettings.from_sources({"input_topic": "spans-from-flag"}, env)
    assert settings.input_topic == "spans-from-flag"
    assert settings.state_ttl == 120.0
    assert settings.kill_topic == "agent-kill-signals"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SPANGUARD_PARTITIONS": "many"}, "SPANGUARD_PARTITIONS='many' is not a valid int"),
        ({"SPANGUARD_STORE": "redis"}, "SPANGUARD_STORE='redis': expected one of rocksdb, memory"),
        ({"SPANGUARD_BOOTSTRAP": "kafka"}, "bootstrap must be HOST:PORT"),
        ({"SPANGUARD_SESSION_TIMEOUT": "1"}, "session_timeout must be at least 6"),
    ],
)
def test_bad_values_name_the_setting(env, message):
    with pytest.raises(SettingsError, match=message):
        WorkerSettings.from_sources({}, env)


def test_signing_key_from_the_environment_or_a_file(tmp_path):
    assert WorkerSettings.from_sources({}, {}).signing_key_bytes() is None
    direct = WorkerSettings.from_sources({}, {"SPANGUARD_SIGNING_KEY": "k1"})
    assert direct.signing_key_bytes() == b"k1"
    assert "k1" not in repr(direct)
    key_file = tmp_path / "key"
    key_file.write_text("k2\n")
    from_file = WorkerSettings.from_sources({}, {"SPANGUARD_SIGNING_KEY_FILE": str(key_file)})
    assert from_file.signing_key_bytes() == b"k2"
    both = WorkerSettings.from_sources(
        {}, {"SPANGUARD_SIGNING_KEY": "k1", "SPANGUARD_SIGNING_KEY_FILE": str(key_file)}
    )
    with pytest.raises(SettingsError, match="not both"):
        both.signing_key_bytes()
    (tmp_path / "empty").write_text("")
    empty = WorkerSettings.from_sources({}, {"SPANGUARD_SIGNING_KEY_FILE": str(tmp_path / "empty")})
    with pytest.raises(SettingsError, match="is empty"):
        empty.signing_key_bytes()


SETTINGS_DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_the_settings_reference_is_the_registry():
    """docs/settings.md is generated (`python -m spanguard.config.settings`); it must not drift."""
    from spanguard.config.settings import settings_document

    document = SETTINGS_DOC.read_text()
    assert document == settings_document(), (
        "run `python -m spanguard.config.settings > docs/settings.md`"
    )
    for row in settings_table().splitlines()[2:]:  # every setting is in it once
        assert document.count(row) == 1, row


def test_worker_help_lists_every_setting_with_a_flag():
    from spanguard.cli.main import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command")
    # argparse wraps long words too: compare without the whitespace it adds.
    worker_help = "".join(commands.choices["worker"].format_help().split())
    for entry in REGISTRY:
        if entry.flag is None:
            assert entry.secret and f"{entry.env}_FILE" in worker_help
            continue
        assert entry.flag in worker_help and f"${entry.env}" in worker_help


def test_registry_declares_each_variable_once_with_its_type_and_default():
    envs = [entry.env for entry in REGISTRY]
    assert len(envs) == len(set(envs))
    by_env = {entry.env: entry for entry in REGISTRY}
    assert by_env["SPANGUARD_STORE"].default == "rocksdb"
    assert by_env["SPANGUARD_STORE"].choices == ("rocksdb", "memory")
    assert by_env["SPANGUARD_JUDGE_TIMEOUT"].kind is float
    assert by_env["SPANGUARD_SIGNING_KEY"].flag is None  # a secret: no flag


def test_flags_win_over_the_environment_for_every_group():
    from spanguard.cli.main import _flags, build_parser

    args = build_parser().parse_args(
        ["worker", "--judge-timeout", "2.5", "--pagerduty-max-attempts", "2", "--partitions", "3"]
    )
    env = {"SPANGUARD_JUDGE_TIMEOUT": "9", "SPANGUARD_PARTITIONS": "7"}
    assert GoalSettings.from_sources(_flags(args, "GoalSettings"), env).timeout == 2.5
    assert WorkerSettings.from_sources(_flags(args, "WorkerSettings"), env).partitions == 3
    assert _flags(args, "PagerSettings")["max_attempts"] == "2"


def test_a_setting_is_read_from_its_one_variable():
    env = {"SPANGUARD_PAGERDUTY_ROUTING_KEY": "r" * 32, "SPANGUARD_PAGERDUTY_TIMEOUT": "3"}
    assert PagerSettings.from_env(env).timeout == 3.0


def test_the_worker_signs_by_default_and_unsigned_takes_an_explicit_setting():
    with pytest.raises(SettingsError, match="no signing key: set SPANGUARD_SIGNING_KEY"):
        WorkerSettings.from_sources({}, {}).kill_signing_key()
    with pytest.raises(SettingsError, match="it needs at least 16"):
        WorkerSettings.from_sources({}, {"SPANGUARD_SIGNING_KEY": "short"}).kill_signing_key()
    key = "a-signing-key-of-32-characters!!"
    assert WorkerSettings.from_sources({}, {"SPANGUARD_SIGNING_KEY": key}).kill_signing_key() == (
        key.encode()
    )
    insecure = WorkerSettings.from_sources({}, {"SPANGUARD_ALLOW_UNSIGNED": "true"})
    assert insecure.allow_unsigned is True and insecure.kill_signing_key() is None
    # Both at once is a contradiction, refused rather than resolved either way.
    both = {"SPANGUARD_ALLOW_UNSIGNED": "yes", "SPANGUARD_SIGNING_KEY": key}
    with pytest.raises(SettingsError, match="not both"):
        WorkerSettings.from_sources({}, both)


@pytest.mark.parametrize(
    ("raw", "value"), [("true", True), ("1", True), ("ON", True), ("false", False), ("no", False)]
)
def test_boolean_settings_read_the_usual_spellings(raw, value):
    assert (
        WorkerSettings.from_sources({}, {"SPANGUARD_ALLOW_UNSIGNED": raw}).allow_unsigned is value
    )


def test_a_boolean_setting_that_is_no_boolean_is_an_error_not_false():
    with pytest.raises(SettingsError, match="SPANGUARD_ALLOW_UNSIGNED='maybe' is not a boolean"):
        WorkerSettings.from_sources({}, {"SPANGUARD_ALLOW_UNSIGNED": "maybe"})


def test_boolean_flags_are_on_off_switches_over_the_variable():
    from spanguard.cli.main import _flags, build_parser

    env = {"SPANGUARD_ALLOW_UNSIGNED": "true"}
    for argv, expected in ((["worker"], True), (["worker", "--no-allow-unsigned"], False)):
        flags = _flags(build_parser().parse_args(argv), "WorkerSettings")
        assert WorkerSettings.from_sources(flags, env).allow_unsigned is expected
    flags = _flags(build_parser().parse_args(["worker", "--allow-unsigned"]), "WorkerSettings")
    assert WorkerSettings.from_sources(flags, {}).allow_unsigned is True


def test_the_worker_command_refuses_to_start_without_a_key(tmp_path, monkeypatch, capsys):
    """Before any Kafka connection: one line, exit 2 (the broker address is unreachable)."""
    from spanguard.cli.main import main

    for name in ("SPANGUARD_SIGNING_KEY", "SPANGUARD_SIGNING_KEY_FILE", "SPANGUARD_ALLOW_UNSIGNED"):
        monkeypatch.delenv(name, raising=False)
    assert main(["worker", "--bootstrap", "127.0.0.1:9", "--data-dir", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("spanguard worker: bad setting: no signing key")


# -- the goal verifier's judge (GoalSettings) --------------------------------------------------


def test_goal_settings_from_env(tmp_path):
    assert GoalSettings.from_env({}) == GoalSettings()
    assert not GoalSettings.from_env({}).enabled
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    settings = GoalSettings.from_env(
        {
            "SPANGUARD_JUDGE_URL": "http://vllm:8000/v1/",
            "SPANGUARD_JUDGE_MODEL": "qwen2.5-7b-instruct",
            "SPANGUARD_JUDGE_API_KEY_FILE": str(key_file),
            "SPANGUARD_JUDGE_TIMEOUT": "2.5",
            "SPANGUARD_JUDGE_MAX_ATTEMPTS": "2",
            "SPANGUARD_JUDGE_MAX_CONCURRENCY": "8",
        }
    )
    assert settings == GoalSettings(
        "http://vllm:8000/v1", "qwen2.5-7b-instruct", "sk-from-file", 2.5, 2, 8
    )
    assert settings.enabled


@pytest.mark.parametrize(
    "env, message",
    [
        ({"SPANGUARD_JUDGE_TIMEOUT": "soon"}, "not a valid float"),
        ({"SPANGUARD_JUDGE_TIMEOUT": "0"}, "positive"),
        ({"SPANGUARD_JUDGE_MAX_ATTEMPTS": "0"}, "at least 1"),
        ({"SPANGUARD_JUDGE_MAX_CONCURRENCY": "0"}, "at least 1"),
        ({"SPANGUARD_JUDGE_URL": "vllm:8000"}, "http(s) URL"),
        ({"SPANGUARD_JUDGE_URL": "ftp://user:pw@host/v1"}, "'ftp://host/v1'"),  # no password
        (
            {"SPANGUARD_JUDGE_API_KEY": "a", "SPANGUARD_JUDGE_API_KEY_FILE": "/k"},
            "not both",
        ),
        ({"SPANGUARD_JUDGE_API_KEY_FILE": "/nonexistent/key"}, "cannot read"),
    ],
)
def test_goal_settings_errors(env, message):
    with pytest.raises(SettingsError) as caught:
        GoalSettings.from_env(env)
    assert message in str(caught.value)
    assert "pw" not in str(caught.value)
