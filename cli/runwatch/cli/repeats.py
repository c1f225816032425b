"""Client-library log lines said once, not on every retry: kafka-python logs each reconnect attempt to a
broker that went away (about 10 lines a second); the long-running commands keep the first line of each
kind and then one every ``every_s``, saying how many like it were left out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RepeatFilter(logging.Filter):
    """Passes a record of a logger under ``prefix`` only if no record of the same logger, level and
    message template passed in the last ``every_s`` seconds; the next one that passes says how many
    were held back. Other loggers' records pass untouched."""

    def __init__(self, prefix: str, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.prefix = prefix
        self.every_s = every_s
        self.clock = clock
        self._last: dict[tuple[str, int, str], float] = {}
        self._held: dict[tuple[str, int, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.name == self.prefix or record.name.startswith(self.prefix + ".")):
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        self._last[key] = now
        held = self._held.pop(key, 0)
        if held:
            record.msg = f"{record.msg} (and {held} more like it in the last {self.every_s:g} s)"
        return True


def quiet_repeats(prefix: str = "kafka", every_s: float = 30.0) -> None:
    """Install a ``RepeatFilter`` on every handler of the root logger (call after ``basicConfig``)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(RepeatFilter(prefix, every_s))
