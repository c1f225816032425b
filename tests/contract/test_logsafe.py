"""A client's data in a log line cannot start a line of its own (issue 23, case 11)."""

from __future__ import annotations

import io
import logging

from runwatch.contract import logsafe


def test_control_characters_in_a_runwatch_log_argument_are_escaped():
    logsafe.install()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger("runwatch.test-logsafe")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("anomaly run=%s module %s", "r\nERROR forged line", "enc\x00\u2028oder")
        log.warning("mapping %(name)s", {"name": "a\rb"})
    finally:
        log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines == [
        "WARNING anomaly run=r\\nERROR forged line module enc\\x00\\u2028oder",
        "WARNING mapping a\\rb",
    ]


def test_printable_text_is_left_as_it_is():
    assert logsafe.escape_control("run-42 ü/ß: ok") == "run-42 ü/ß: ok"
    assert logsafe.escape_control("a\tb\x1b[31m") == "a\\tb\\x1b[31m"
