"""Long-running commands stop on SIGINT/SIGTERM."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Protocol


class _Consumer(Protocol):
    """A sink or remediate consumer: ``run()`` until ``stopping`` is set."""

    @property
    def stopping(self) -> threading.Event: ...

    @property
    def assigned(self) -> threading.Event: ...

    def run(self) -> None: ...


class _Store(Protocol):
    def close(self) -> None: ...


def run_until_signalled(consumer: _Consumer, store: _Store, ready_file: Path | None = None) -> None:
    """Run ``consumer`` until SIGINT/SIGTERM asks it to stop, then close ``store``. ``ready_file`` is
    written once the consumer has its partitions."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: consumer.stopping.set())
    if ready_file is not None:
        threading.Thread(
            target=_write_when_assigned, args=(consumer, ready_file), name="ready-file", daemon=True
        ).start()
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


def _write_when_assigned(consumer: _Consumer, ready_file: Path) -> None:
    while not consumer.stopping.is_set():
        if consumer.assigned.wait(0.5):
            ready_file.write_text("assigned\n")
            return
