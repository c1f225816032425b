"""Long-running commands stop on SIGINT/SIGTERM."""

from __future__ import annotations

import signal
import threading


def run_until_signalled(consumer, store) -> None:  # noqa: ANN001 - a sink or remediate consumer, its store
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
