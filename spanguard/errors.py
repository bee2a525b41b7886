"""Every error spanguard raises on bad input or configuration derives from `SpanguardError`.

One subclass per surface, each also the builtin type callers would expect (a bad setting is a
`ValueError`, an unreadable replay file an `OSError`). The CLI turns any `SpanguardError` into
one line on stderr and exit code 2. This module imports nothing of spanguard, so every layer,
the wire contracts included, can raise these.

`AgentKilled` (spanguard.killswitch) is deliberately not one: it is the guard's verdict raised
into an agent's code, not an error of spanguard.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "AuditReadError",
    "BacktestError",
    "JudgeError",
    "JudgeErrorKind",
    "KafkaConnectError",
    "KafkaSecurityError",
    "OtlpDecodeError",
    "PagerConfigError",
    "PolicyError",
    "ReplayInputError",
    "SecretError",
    "SettingsError",
    "SpanguardError",
]


class SpanguardError(Exception):
    """Base of spanguard's errors: the message says what is wrong and where."""

    exit_code = 2  # what the CLI exits with: a usage or configuration error


class SettingsError(SpanguardError, ValueError):
    """A setting with a value that cannot be used; the message names it."""


class SecretError(SettingsError):
    """A secret set twice (value and file), or its file unreadable or empty."""


class PagerConfigError(SettingsError):
    """PagerDuty paging is configured in a way that cannot work."""


class KafkaSecurityError(SettingsError):
    """Kafka connection settings that cannot be used together; named by their Kafka names."""


class KafkaConnectError(SpanguardError):
    """The broker could not be reached, refused the credentials or was not trusted."""

    exit_code = 1  # the settings may be right; the cluster said no


class PolicyError(SpanguardError, ValueError):
    """The policy file cannot be used; the message names the file, the field and the value."""


class OtlpDecodeError(SpanguardError, ValueError):
    """Bytes or JSON that are not an OTLP ExportTraceServiceRequest."""


class ReplayInputError(SpanguardError, OSError):
    """A replay input that cannot be opened or read."""


class AuditReadError(SpanguardError, OSError):
    """The detections topic cannot be read (missing, unreachable, or not read in time)."""


class BacktestError(SpanguardError):
    """A backtest that cannot run as asked: a missing topic, a bad time range."""


JudgeErrorKind = Literal["invalid_reply", "timeout", "unavailable", "rejected"]


class JudgeError(SpanguardError):
    """The judge gave no verdict. Never read it as a pass.

    kind: invalid_reply (not a strict verdict), timeout, unavailable (connection errors, 429,
    5xx after every attempt), rejected (a 4xx other than 429: model, key or request is wrong).
    """

    def __init__(self, message: str, kind: JudgeErrorKind = "invalid_reply") -> None:
        super().__init__(message)
        self.kind: JudgeErrorKind = kind
