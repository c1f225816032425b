"""The stop watchdog: a hard exit for a process that a stop action did not end.

With ``stop_exit_after_s`` the listener arms it when a stop is *received* (by the consumer thread,
since a rank blocked in a collective or hung elsewhere never reaches ``poll``): a daemon thread
calls ``os._exit(exit_code)`` unless the process has exited within the timeout (a graceful exit
ends the thread with the process) or it is disarmed. Arming it again keeps one watchdog, with the
earlier deadline (and its exit code).
"""

from __future__ import annotations

import os
import sys
import threading
import time


class StopWatchdog:
    """One hard-exit watchdog per listener. ``thread`` is the armed one (None: never armed),
    ``deadline`` its ``time.monotonic()`` deadline."""

    def __init__(self, exit_after_s: float | None, exit_code: int):
        self.exit_after_s = exit_after_s  # None: not armed on a stop (arm() by hand still works)
        self.exit_code = exit_code
        self.thread: threading.Thread | None = None
        self.deadline = 0.0
        self._lock = threading.Condition()
        self._disarmed = threading.Event()
        self._code = exit_code
        self._timeout_s = 0.0

    def arm_on_stop(self) -> None:
        if self.exit_after_s is not None:
            self.arm(self.exit_after_s)

    def arm(self, timeout_s: float, exit_code: int | None = None) -> threading.Thread:
        """Exit with ``exit_code`` (default: the listener's) ``timeout_s`` from now unless disarmed."""
        code = self.exit_code if exit_code is None else exit_code
        deadline = time.monotonic() + timeout_s
        with self._lock:
            thread = self.thread
            if thread is not None and thread.is_alive() and not self._disarmed.is_set():
                if deadline < self.deadline:
                    self.deadline, self._code, self._timeout_s = deadline, code, timeout_s
                    self._lock.notify_all()
                return thread
            self._disarmed = disarmed = threading.Event()
            self.deadline, self._code, self._timeout_s = deadline, code, timeout_s
            thread = threading.Thread(
                target=self._run, args=(disarmed,), name="runwatch-stop-watchdog", daemon=True
            )
            self.thread = thread
            thread.start()
            return thread

    def disarm(self) -> None:
        with self._lock:
            self._disarmed.set()
            self._lock.notify_all()

    def _run(self, disarmed: threading.Event) -> None:
        with self._lock:
            while True:
                if disarmed.is_set():
                    return
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._lock.wait(remaining)
            code, timeout_s = self._code, self._timeout_s
        msg = f"runwatch: still running {timeout_s:g} s after a stop action; exiting with code {code}\n"
        try:
            sys.stderr.write(msg)
            sys.stderr.flush()
        finally:
            os._exit(code)
