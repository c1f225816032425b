"""A background heartbeat: the last completed step, the current phase and the time spent in it.

The worker tells a hung rank (heartbeats go on, the step does not move) from a long
checkpoint save (phase ``checkpoint``) and from a dead one (heartbeats stop). The
training thread only sets attributes; the daemon thread reads them every ``interval_s``
and publishes, so the loop never waits on anything.

With an ``in_sync`` provider (the Watcher sets one for a DDP model) each heartbeat also says
whether the rank has done its part of the current step and waits for its peers: a hung rank's
peers say True while it says False. Without one (or when it answers None) the field is left out.
Inside :meth:`Heartbeat.waiting_for_peers` (the action listener's per-step broadcast) it is True.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

PHASES: tuple[str, ...] = ("train", "eval", "checkpoint", "dataload", "idle")
# Entering or leaving these sends a heartbeat at once: the worker must know that a pause is an
# eval or a checkpoint save before the train phase's stall allowance runs out. (Not dataload,
# which changes on every batch.)
ANNOUNCED_PHASES = frozenset({"eval", "checkpoint", "idle"})


def _checked(phase: str) -> str:
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; use one of {', '.join(PHASES)}")
    return phase


class Heartbeat:
    """Publishes ``rw.heartbeat(step, phase, time_in_phase_s)`` every ``interval_s`` from a daemon thread.

    Call :meth:`set_step` after each completed step and mark phases with :meth:`phase`
    (a context manager) or :meth:`enter`. Phase changes belong to the training thread.
    ``in_sync``: a callable returning True/False/None, called on the heartbeat thread at each
    beat; its answer goes out as ``in_sync`` (left out when None).
    """

    def __init__(
        self,
        rw: Any,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        initial_phase: str = "train",
        in_sync: Callable[[], bool | None] | None = None,
    ):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.rw = rw
        self.interval_s = interval_s
        self._clock = clock
        self._step: int | None = None
        # (phase, entered_at) in one tuple, so the heartbeat thread never reads a phase with the
        # start time of another; replacing it is a single atomic attribute store under the GIL.
        self._state: tuple[str, float] = (_checked(initial_phase), clock())
        self._outer: list[tuple[str, float]] = []  # states that push() covered, restored by pop()
        self._lifecycle = threading.Lock()  # start/stop only, never on the per-step path
        self._stopping = threading.Event()
        self._wake = threading.Event()  # set to beat before the interval is up (and to stop)
        self._thread: threading.Thread | None = None
        self._warned = False
        self.in_sync = in_sync
        self._waiting = 0  # > 0 inside waiting_for_peers()

    # -- called from the training loop ------------------------------------------------------

    def set_step(self, step: int | None) -> None:
        """Record the last completed step."""
        self._step = step

    def enter(self, phase: str) -> None:
        """Switch to ``phase`` and restart the time-in-phase count (even if it is the current phase)."""
        previous = self._state[0]
        self._state = (_checked(phase), self._clock())
        self._announce_if(previous, phase)

    def push(self, phase: str) -> None:
        """Enter ``phase``, remembering the current phase and its start time for :meth:`pop`."""
        new_state = (_checked(phase), self._clock())
        self._outer.append(self._state)
        self._state = new_state
        self._announce_if(phase)

    def pop(self) -> None:
        """Return to the phase (and its original start time) that the matching :meth:`push` covered."""
        if self._outer:  # an unmatched pop is a caller's slip; not worth crashing training over
            left = self._state[0]
            self._state = self._outer.pop()
            self._announce_if(left)

    @contextmanager
    def phase(self, name: str) -> Iterator[Heartbeat]:
        """``with hb.phase("checkpoint"): ...``; on exit the outer phase resumes with its own start time."""
        self.push(name)
        try:
            yield self
        finally:
            self.pop()

    @contextmanager
    def waiting_for_peers(self) -> Iterator[None]:
        """Mark a wait in a collective with the other ranks: heartbeats meanwhile say ``in_sync``."""
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1

    @property
    def current(self) -> tuple[int | None, str, float]:
        """``(last completed step, phase, seconds in phase)``."""
        phase, entered_at = self._state
        return self._step, phase, max(0.0, self._clock() - entered_at)

    # -- publishing ----------------------------------------------------------------------------

    def beat(self) -> bool:
        """Publish one heartbeat now; False if it was not queued. Never raises."""
        step, phase, seconds = self.current
        in_sync = self._in_sync()
        try:
            if in_sync is None:  # (left out when not measured)
                return bool(self.rw.heartbeat(step, phase, seconds, interval_s=self.interval_s))
            return bool(self.rw.heartbeat(step, phase, seconds, in_sync=in_sync, interval_s=self.interval_s))
        except Exception as exc:  # the publisher should not raise; if it does, keep beating
            if not self._warned:
                self._warned = True
                log.warning("runwatch: heartbeat failed (further failures are not logged): %r", exc)
            return False

    def _in_sync(self) -> bool | None:
        if self._waiting:
            return True
        provider = self.in_sync
        if provider is None:
            return None
        try:
            value = provider()
        except Exception as exc:  # a measurement that fails is absent, not a reason to stop beating
            if not self._warned:
                self._warned = True
                log.warning("runwatch: in_sync failed (further failures are not logged): %r", exc)
            return None
        return None if value is None else bool(value)

    def start(self) -> None:
        """Start the thread (a no-op if it runs); it beats at once, then every ``interval_s``."""
        with self._lifecycle:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(self._stopping,), name="runwatch-heartbeat", daemon=True
            )
            self._thread.start()
            atexit.register(self.stop)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread and wait up to ``timeout`` s for it; idempotent."""
        with self._lifecycle:
            thread, self._thread = self._thread, None
            self._stopping.set()
            self._wake.set()
            atexit.unregister(self.stop)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def __enter__(self) -> Heartbeat:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _announce_if(self, *phases: str) -> None:
        if ANNOUNCED_PHASES.intersection(phases):
            self._wake.set()

    def _run(self, stopping: threading.Event) -> None:
        while True:
            self.beat()
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if stopping.is_set():
                return
