"""Worker settings: flags over SPANGUARD_* variables over defaults; secrets from env or files."""

import pytest

from spanguard.settings import SettingsError, WorkerSettings


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
        ({"SPANGUARD_STORE": "redis"}, "store must be rocksdb or memory"),
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
