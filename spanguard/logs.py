"""Structured logs: one JSON object per line on stderr, for the worker and its tools."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

# Attributes every LogRecord has; anything else passed with `extra=` becomes a JSON field.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def logging_config(level: str = "INFO", loggers: dict[str, str] | None = None) -> dict[str, Any]:
    """A logging.config.dictConfig that sends everything through JsonFormatter; `loggers` sets
    single loggers' levels over `level` (logger name -> level)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"level": level.upper(), "handlers": ["stderr"]},
        # aiokafka narrates every connection at INFO; keep its warnings.
        "loggers": {
            "aiokafka": {"level": "WARNING"},
            **{name: {"level": value} for name, value in (loggers or {}).items()},
        },
    }
