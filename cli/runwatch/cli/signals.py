"""Long-running commands stop on SIGINT/SIGTERM."""

from __future__ import annotations

import signal
import threading
from typing import Protocol


class _Consumer(Protocol):
    """A sink or remediate consumer: ``run()`` until ``stopping`` is set."""

    @property
    def stopping(self) -> threading.Event: ...

    def run(self) -> None: ...


class _Store(Protocol):
    def close(self) -> None: ...


def run_until_signalled(consumer: _Consumer, store: _Store) -> None:
    """Run ``consumer`` until SIGINT/SIGTERM asks it to stop, then close ``store``."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: consumer.stopping.set())
    try:
        consumer.run()
    finally:
        store.close()


def wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
