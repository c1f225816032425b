"""A rank's last words (issue 39): what a dying process can say about itself, published as a ``crash``
event before it goes. Facts only (the exception, its traceback, the signal, the last completed step, the
host): the worker classifies them; a trainer is never trusted to name the class.

- ``sys.excepthook`` and ``threading.excepthook``, chained (the hooks found are called too, so the traceback
  is printed as before and a framework's hook still runs). An uncaught exception in the main thread ends the
  process: its crash event is published and the run closed (``run_end`` ``failed``) within
  ``flush_timeout_s``. One in another thread does not end it: its event goes out as the publisher sends
  (the worker notes it, and acts only if the process then dies).
- SIGTERM (the scheduler's preemption or cancel): a crash event with ``signal`` 15, then the handler found
  (a user's: it still runs, and decides what happens next), or, where that was the default, the run is
  closed and the signal re-raised with the default handler, so the process dies of SIGTERM as the scheduler
  expects. Installed only from the main thread, and never over ``SIG_IGN`` (a process that ignores SIGTERM
  is not preempted by it).
- Fatal signals (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL) leave no time to publish: under
  ``runwatch launch`` (``$RUNWATCH_CRASH_DIR`` set) ``faulthandler`` writes the stacks to a file there and
  the launcher, which sees the death, reports it (``cli/runwatch/cli/launch.py``). A process whose
  faulthandler is already on is left as it is (its text goes to stderr, whose tail the launcher keeps).

When it has published, the capture leaves a ``reported`` file in ``$RUNWATCH_CRASH_DIR``: the launcher then
does not report the same death again.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, Protocol

from runwatch.contract.schema import CrashEvent, bound_crash
from runwatch.producer.publish.run_end import truncate

log = logging.getLogger(__name__)

CRASH_DIR_ENV = "RUNWATCH_CRASH_DIR"  # set by `runwatch launch` for its child: where the last words go
FAULTHANDLER_FILE = "faulthandler.txt"  # in $RUNWATCH_CRASH_DIR: a fatal signal's stacks
REPORTED_FILE = "reported"  # in $RUNWATCH_CRASH_DIR: the process published its own crash event
CLOSED_FILE = "closed"  # in $RUNWATCH_CRASH_DIR: its RunWatch closed the run, with this status
DEFAULT_FLUSH_TIMEOUT_S = 2.0

_Handler = Callable[[int, FrameType | None], Any] | int | None


class CrashPublisher(Protocol):
    """What the capture needs of a ``RunWatch``: its run, a way to publish, its last step, and a close."""

    @property
    def run_id(self) -> str: ...

    last_step: int | None

    def publish_crash(self, **fields: Any) -> bool: ...

    def close(
        self, timeout: float = 10.0, status: str | None = None, summary: dict[str, Any] | None = None
    ) -> Any: ...


def host_name() -> str:
    """The host a crash is reported from: ``$RUNWATCH_HOST`` (a launcher's own name for the node), else the
    machine's host name."""
    return os.environ.get("RUNWATCH_HOST") or socket.gethostname()


def format_traceback(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> str:
    return "".join(traceback.format_exception(exc_type, exc, tb))


class CrashCapture:
    """Installs the hooks for one ``RunWatch`` (``install``) and takes them off again (``uninstall``, at its
    close). ``crash_dir``: the launcher's folder (default ``$RUNWATCH_CRASH_DIR``; None: no launcher)."""

    def __init__(
        self,
        rw: CrashPublisher,
        *,
        flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
        crash_dir: str | os.PathLike[str] | None = None,
        signals: bool = True,
    ):
        self.rw = rw
        self.flush_timeout_s = flush_timeout_s
        env_dir = os.environ.get(CRASH_DIR_ENV)
        self.crash_dir = Path(crash_dir) if crash_dir is not None else Path(env_dir) if env_dir else None
        self.signals = signals
        self.reported = False  # a crash event of the process's end went out (once per process)
        self._prev_excepthook: Callable[..., Any] | None = None
        self._prev_thread_hook: Callable[[threading.ExceptHookArgs], Any] | None = None
        self._prev_sigterm: _Handler = None
        self._sigterm_installed = False
        self._fault_file: IO[str] | None = None
        self._installed = False

    # -- installing -------------------------------------------------------------------------

    def install(self) -> CrashCapture:
        if self._installed:
            return self
        self._installed = True
        self._prev_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        self._prev_thread_hook = threading.excepthook
        threading.excepthook = self._thread_hook
        if self.signals:
            self._install_sigterm()
        self._enable_faulthandler()
        return self

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # (signal handlers are the main thread's to set)
        try:
            previous = signal.getsignal(signal.SIGTERM)
        except (ValueError, OSError):
            return
        if previous == signal.SIG_IGN:
            return  # the process chose not to die of SIGTERM: no preemption to report
        self._prev_sigterm = previous
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._sigterm_installed = True

    def _enable_faulthandler(self) -> None:
        if self.crash_dir is None or faulthandler.is_enabled():
            return
        try:
            self.crash_dir.mkdir(parents=True, exist_ok=True)
            self._fault_file = open(self.crash_dir / FAULTHANDLER_FILE, "w")
            faulthandler.enable(self._fault_file, all_threads=True)
        except OSError as exc:
            log.warning("runwatch: faulthandler not enabled in %s: %s", self.crash_dir, exc)

    def uninstall(self) -> None:
        """Put back the hooks found, where ours are still the ones in place (a later hook is left alone)."""
        if not self._installed:
            return
        self._installed = False
        if sys.excepthook == self._excepthook and self._prev_excepthook is not None:
            sys.excepthook = self._prev_excepthook
        if threading.excepthook == self._thread_hook and self._prev_thread_hook is not None:
            threading.excepthook = self._prev_thread_hook
        if self._sigterm_installed and threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, self._prev_sigterm or signal.SIG_DFL)
            except (ValueError, OSError):
                pass
            self._sigterm_installed = False
        # faulthandler stays on: a fatal signal during the interpreter's own shutdown is still written

    # -- the hooks ----------------------------------------------------------------------------

    def _excepthook(
        self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        previous = self._prev_excepthook or sys.__excepthook__
        try:
            previous(exc_type, exc, tb)  # the traceback printed first, as the user expects
        finally:
            if not issubclass(exc_type, KeyboardInterrupt):
                self.report_exception(exc_type, exc, tb, source="exception", final=True)

    def _thread_hook(self, args: threading.ExceptHookArgs) -> None:
        previous = self._prev_thread_hook or threading.__excepthook__
        try:
            previous(args)
        finally:
            if args.exc_type is not SystemExit and args.exc_value is not None:
                name = args.thread.name if args.thread is not None else "?"
                self.report_exception(
                    args.exc_type,
                    args.exc_value,
                    args.exc_traceback,
                    source="thread_exception",
                    final=False,
                    thread=name,
                )

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        previous = self._prev_sigterm
        user_handler = callable(previous)
        self.report_signal(signum, final=not user_handler)
        if callable(previous):
            previous(signum, frame)  # the user's handler decides (a checkpoint, a graceful exit)
            return
        # The default: die of the signal, as the scheduler expects (exit status 128 + 15)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    # -- reporting -----------------------------------------------------------------------------

    def report_exception(
        self,
        exc_type: type[BaseException],
        exc: BaseException,
        tb: TracebackType | None,
        *,
        source: str,
        final: bool,
        thread: str | None = None,
    ) -> bool:
        """Publish a crash event for ``exc``; ``final``: the process is going (close the run within the
        flush bound, once)."""
        if final and self.reported:
            return False
        try:
            message = str(exc)
        except Exception:  # noqa: BLE001 - a hostile __str__ must not stop the report
            message = f"<unprintable {exc_type.__name__}>"
        fields: dict[str, Any] = {
            "source": source,
            "exception_type": exc_type.__qualname__,
            "message": message,
            "traceback": format_traceback(exc_type, exc, tb),
        }
        if thread is not None:
            fields["thread"] = thread[:128]
        summary = {"error_type": exc_type.__name__, "error": truncate(message)}
        return self._report(fields, final, status="failed", summary=summary)

    def report_signal(self, signum: int, *, final: bool) -> bool:
        if self.reported:
            return False
        name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else str(signum)
        return self._report(
            {"source": "signal", "signal": signum, "message": f"received {name}"},
            final,
            status="interrupted",
            summary={"signal": signum},
        )

    def _report(self, fields: dict[str, Any], final: bool, *, status: str, summary: dict[str, Any]) -> bool:
        rw = self.rw
        try:
            sent = rw.publish_crash(step=rw.last_step, host=host_name(), **fields)
        except Exception:
            log.debug("runwatch: the crash event could not be built", exc_info=True)
            return False
        if final:
            self.reported = True
            self._mark_reported()
            try:
                rw.close(timeout=self.flush_timeout_s, status=status, summary=summary)
            except Exception:
                log.debug("runwatch: closing after a crash failed", exc_info=True)
        return sent

    def mark_closed(self, status: str) -> None:
        """The run was closed (``run_end`` sent) with ``status``: a launcher reads ``stopped`` as an exit
        the run's own stop explains (never a crash to restart)."""
        if self.crash_dir is None:
            return
        try:
            (self.crash_dir / CLOSED_FILE).write_text(status)
        except OSError:
            pass

    def _mark_reported(self) -> None:
        if self.crash_dir is None:
            return
        try:
            (self.crash_dir / REPORTED_FILE).write_text("1")
        except OSError:
            pass


def crash_event(run_id: str, rank: int, **fields: Any) -> CrashEvent:
    """A bounded crash event (``bound_crash``)."""
    return bound_crash(CrashEvent(run_id=run_id, rank=rank, **fields))
