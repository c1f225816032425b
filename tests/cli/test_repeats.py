"""A broker gone away after a start: kafka-python's reconnect lines are said once per kind every 30 s,
with how many were left out, not ten a second (issue 26)."""

from __future__ import annotations

import logging

from runwatch.cli.repeats import RepeatFilter


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def record(name: str, msg: str, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_a_repeated_line_passes_once_per_period_saying_how_many_were_held():
    clock = Clock()
    f = RepeatFilter("kafka", every_s=30, clock=clock)
    passed = []
    for i in range(100):  # ten a second for ten seconds, then 30 s on
        clock.t = i / 10
        r = record("kafka.net.manager", "Connection failed: %s")
        if f.filter(r):
            passed.append(r.getMessage() if r.args else r.msg)
    clock.t = 31.0
    r = record("kafka.net.manager", "Connection failed: %s")
    assert f.filter(r)
    assert passed == ["Connection failed: %s"]
    assert r.msg == "Connection failed: %s (and 99 more like it in the last 30 s)"


def test_other_kinds_levels_and_loggers_pass():
    f = RepeatFilter("kafka", clock=Clock())
    assert f.filter(record("kafka.net.manager", "Connection failed: %s"))
    assert f.filter(record("kafka.net.manager", "Bootstrap connection failed: %s"))  # another kind
    assert f.filter(record("kafka.net.manager", "Connection failed: %s", logging.WARNING))  # another level
    assert f.filter(record("kafka.conn", "Connection failed: %s"))  # another logger
    for _ in range(5):
        assert f.filter(record("runwatch.sinks.consumer", "stored %d rows"))  # not the library's
        assert f.filter(record("kafkaesque", "same"))  # a name that only starts like it
