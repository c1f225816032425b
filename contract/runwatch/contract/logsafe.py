"""Log lines that a client cannot forge: what runwatch's loggers print of client data (run ids,
module and category names, reasons) has its control characters escaped, so a newline in a name
cannot start a second, fake log line. Installed once per process by the command line."""

from __future__ import annotations

import logging
from typing import Any

_installed = False


def escape_control(text: str) -> str:
    """``text`` with every character that is not printable (controls, format characters, line and
    paragraph separators, spaces other than " ") written as its escape; the rest unchanged."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _safe(arg: Any) -> Any:
    return escape_control(arg) if isinstance(arg, str) else arg


def install() -> None:
    """Escape the arguments of every ``runwatch.*`` log record (the format strings are ours)."""
    global _installed
    if _installed:
        return
    _installed = True
    make_record = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        if record.name.startswith("runwatch") and record.args:
            if isinstance(record.args, tuple):
                record.args = tuple(_safe(a) for a in record.args)
            elif isinstance(record.args, dict):
                record.args = {k: _safe(v) for k, v in record.args.items()}
        return record

    logging.setLogRecordFactory(factory)


def redacted(url: str) -> str:
    """``url`` (a DSN, a Grafana URL) without its password, for log lines and error messages."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    except ValueError:  # a port that is not a number: show no credentials at all
        return url.split("@", 1)[-1] if "@" in url else url
    return urlunsplit(parts._replace(netloc=netloc))
