"""Logging setup: JSON lines on stderr for log collectors, plain text when a person is watching a terminal."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

# Attributes every LogRecord has; anything else was passed through `extra=` and is context worth keeping.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus any `extra=` context (node, gpu_uuid, reason)."""

    def format(self, record: logging.LogRecord) -> str:
        """Render one record."""
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


#: A log message longer than this is cut (text from outside, a device name or an annotation, can be megabytes)
MAX_MESSAGE = 8192


def cut(text: str, limit: int) -> str:
    """`text` within `limit` characters, saying how much was left out (for logs, Events and errors)."""
    if len(text) <= limit:
        return text
    tail = f"... ({len(text) - limit} more characters)"
    return text[:max(0, limit - len(tail))] + tail


class BoundedMessages(logging.Filter):
    """Cuts every record's message to `MAX_MESSAGE` characters, saying how much was left out."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Always keeps the record; only its message may be shortened."""
        message = record.getMessage()
        if len(message) > MAX_MESSAGE:
            record.msg, record.args = cut(message, MAX_MESSAGE), None
        return True


def setup_logging(level: str = "info", fmt: str = "auto") -> None:
    """Configure the root logger once; `fmt` is json, text, or auto (text on a terminal)."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if use_json else
                         logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    handler.addFilter(BoundedMessages())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # grpc and the HTTP client are chatty at debug level; their warnings still come through.
    # httpx2 logs every request it sends at INFO (each API call would be a log line): warnings only.
    for noisy in ("grpc", "httpx", "httpcore", "httpx2", "httpcore2", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
