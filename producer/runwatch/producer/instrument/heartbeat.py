"""A background heartbeat: the last completed step, the current phase and the time spent in it.

The worker tells a hung rank (heartbeats go on, the step does not move) from a long
checkpoint save (phase ``checkpoint``) and from a dead one (heartbeats stop). The
training thread only sets attributes; the daemon thread reads them every ``interval_s``
and publishes, so the loop never waits on anything.

With an ``in_sync`` provider (the Watcher sets one for a DDP model) each heartbeat also says
whether the rank has done its part of the current step and waits for its peers: a hung rank's
peers say True while it says False. Without one (or when it answers None) the field is left out.
Inside :meth:`Heartbeat.waiting_for_peers` (the action listener's per-step broadcast) it is True.

Each heartbeat also carries ``host_load`` (:class:`HostLoadSampler`): the 1-minute load average,
the CPU count, the hypervisor's steal share and this process's CPU and run-queue-wait shares over
the period since the previous beat, so that the worker can say whether a slowdown came with a
busier host (a noisy neighbour) or not (a regression of the run's own). Standard library only,
a few small /proc reads per beat; a figure this host does not offer is left out, never zero.

GPU health (``gpu_health``, instrument/gpu_health.py): with a sampler (the watcher makes one for a CUDA
model where nvidia-ml-py is installed) each heartbeat also carries ``gpu``, NVML's figures for the rank's
device, sampled on this thread at most once a second; the training thread makes no NVML call.

Stacks (``stacks_after_s``, default 5 s): when the last completed step has not moved for that long while
the rank is in the ``train`` or ``dataload`` phase, this thread captures the Python stack of every thread
of the process (and PyTorch's flight recorder where it is on: instrument/stacks.py) and publishes it as
one ``evidence`` event, once per stall: again only after the step has moved. The training thread pays
nothing for it: :meth:`Heartbeat.set_step` stays one attribute store, and this thread looks at the step
every ``stacks_after_s / 5`` seconds (at most every heartbeat period), noting when it changed.
"""

from __future__ import annotations

import atexit
import glob
import inspect
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runwatch.producer.publish.publisher import HeartbeatPublisher

log = logging.getLogger(__name__)

PHASES: tuple[str, ...] = ("train", "eval", "checkpoint", "dataload", "idle")
# Entering or leaving these sends a heartbeat at once: the worker must know that a pause is an
# eval or a checkpoint save before the train phase's stall allowance runs out. (Not dataload,
# which changes on every batch.)
ANNOUNCED_PHASES = frozenset({"eval", "checkpoint", "idle"})


# Phases in which a step that does not move is worth the stacks (not eval, checkpoint or idle: long by design)
STACK_PHASES = frozenset({"train", "dataload"})
DEFAULT_STACKS_AFTER_S = 5.0  # below the worker's hung_rank and stall allowances (10 s in train by default)


MIN_PERIOD_S = 0.2  # a beat sooner than this after the last sample reuses its shares (too short to measure)


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode("ascii", "replace")
    except OSError:
        return None


def _proc_stat_cpu() -> tuple[int, int] | None:
    """(steal ticks, total ticks) of the host's CPUs from /proc/stat's ``cpu`` line; None elsewhere."""
    text = _read("/proc/stat")
    if not text or not text.startswith("cpu "):
        return None
    fields = text.split("\n", 1)[0].split()[1:]
    try:
        values = [
            int(v) for v in fields[:8]
        ]  # user nice system idle iowait irq softirq steal (guest is in user)
    except ValueError:
        return None
    if len(values) < 8:
        return None  # a kernel too old to count steal
    return values[7], sum(values)


def _run_delay_ns() -> int | None:
    """Nanoseconds this process's threads have spent runnable but waiting for a CPU, summed over
    its threads (/proc/self/task/*/schedstat, second field); None where the kernel has no schedstat."""
    total, found = 0, False
    for path in glob.glob("/proc/self/task/*/schedstat"):
        text = _read(path)
        parts = text.split() if text else []
        if len(parts) >= 2 and parts[1].isdigit():
            total += int(parts[1])
            found = True
    return total if found else None


class HostLoadSampler:
    """``sample()`` -> the ``host_load`` of a heartbeat: a dict of the figures this host offers.

    ``load1`` (os.getloadavg) and ``cpus`` (os.cpu_count) are read at the beat; ``steal_frac``
    (the steal share of all CPU ticks, /proc/stat), ``process_cpu_frac`` (this process's CPU
    seconds, all threads, per wall second: time.process_time) and ``cpu_wait_frac`` (seconds its
    threads waited in the run queue per wall second: schedstat) cover the time since the previous
    sample, so the first sample has none of them. Never raises; returns None when nothing is known.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._last: tuple[float, float, tuple[int, int] | None, int | None] | None = None
        self._shares: dict[str, float] = {}

    def sample(self) -> dict[str, Any] | None:
        try:
            return self._sample()
        except Exception:  # noqa: BLE001 - a measurement that fails is absent
            return None

    def _sample(self) -> dict[str, Any] | None:
        out: dict[str, Any] = {}
        try:
            load1 = os.getloadavg()[0]
        except (OSError, AttributeError):
            load1 = None
        if load1 is not None and load1 >= 0:
            out["load1"] = round(load1, 3)
        cpus = os.cpu_count()
        if cpus:
            out["cpus"] = cpus
        now, cpu_time = self._clock(), time.process_time()
        stat, delay = _proc_stat_cpu(), _run_delay_ns()
        last = self._last
        if last is None or now - last[0] >= MIN_PERIOD_S:
            shares: dict[str, float] = {}
            if last is not None:
                wall = now - last[0]
                shares["process_cpu_frac"] = round(max(0.0, cpu_time - last[1]) / wall, 4)
                if stat is not None and last[2] is not None and stat[1] > last[2][1]:
                    steal = (stat[0] - last[2][0]) / (stat[1] - last[2][1])
                    shares["steal_frac"] = round(min(max(steal, 0.0), 1.0), 4)
                if delay is not None and last[3] is not None:
                    shares["cpu_wait_frac"] = round(max(0, delay - last[3]) / 1e9 / wall, 4)
            self._shares = shares
            self._last = (now, cpu_time, stat, delay)
        out.update(self._shares)
        if not out:
            return None
        from runwatch.contract.schema import HostLoad

        HostLoad(**out)  # within the wire's bounds, or (raising) none at all: never a dropped heartbeat
        return out


def _host_name() -> str | None:
    try:
        name = socket.gethostname()
    except OSError:
        return None
    return name[:255] or None


def _takes(rw: HeartbeatPublisher, name: str) -> bool:
    """Whether ``rw.heartbeat`` takes the keyword ``name`` (every runwatch publisher's takes host)."""
    heartbeat = getattr(rw, "heartbeat", None)
    try:
        return heartbeat is not None and name in inspect.signature(heartbeat).parameters
    except (TypeError, ValueError):
        return False


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
    ``stacks_after_s``: publish every thread's stack (``rw.evidence``) once the last completed step has not
    moved for this many seconds in the train or dataload phase, once per stall (see the module doc); None
    or 0: never. The training thread is the one that creates the heartbeat (``training_thread``: another).
    ``gpu_health``: an object whose ``sample()`` gives the heartbeat's ``gpu`` (a
    :class:`~runwatch.producer.instrument.gpu_health.GpuHealthSampler`), called on the heartbeat thread at
    each beat and closed (``close()``, where it has one) when the thread ends; None: no ``gpu``.
    """

    def __init__(
        self,
        rw: HeartbeatPublisher,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        initial_phase: str = "train",
        in_sync: Callable[[], bool | None] | None = None,
        host_load: bool | None = None,
        stacks_after_s: float | None = DEFAULT_STACKS_AFTER_S,
        training_thread: int | None = None,
        gpu_health: Any = None,
    ):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        if stacks_after_s is not None and not stacks_after_s >= 0:
            raise ValueError(f"stacks_after_s must be >= 0 (0 or None: off), got {stacks_after_s!r}")
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
        # Host figures are the real machine's, over wall-time periods: by default only on the wall clock
        # (a simulated run's heartbeats, on a clock of its own, carry none); host_load=False: never.
        if host_load is None:
            host_load = clock is time.monotonic
        self.host_load = HostLoadSampler() if host_load else None
        self.gpu_health = gpu_health
        self._takes: frozenset[str] | None = None  # the optional fields rw.heartbeat takes (first beat)
        # The first heartbeat says the rank's host (issue 39: findings naming a rank are mapped to its
        # machine); None once sent, or where the publisher's heartbeat takes no host.
        self._host: str | None = _host_name() if _takes(rw, "host") else None
        # Stacks: the heartbeat thread's own notes (the training thread never touches them): the step it
        # last saw and when it first saw it, and whether this stall's stacks were sent.
        self.stacks_after_s = stacks_after_s or None
        self.training_thread = threading.get_ident() if training_thread is None else training_thread
        self._seen: tuple[int | None, float] = (None, clock())
        self._seen_phase: tuple[str, float] = self._state  # (a phase left and resumed counts from then)
        self._stacks_sent = False
        self.stacks_published = 0

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
        host_load = self.host_load.sample() if self.host_load is not None else None
        gpu = self._gpu()
        try:
            fields: dict[str, Any] = {"interval_s": self.interval_s}
            if in_sync is not None:  # (left out when not measured)
                fields["in_sync"] = in_sync
            if self._host is not None:
                fields["host"], self._host = self._host, None
            if host_load is not None or gpu is not None:
                takes = self._optional_fields()
                if host_load is not None and "host_load" in takes:
                    fields["host_load"] = host_load
                if gpu is not None and "gpu" in takes:
                    fields["gpu"] = gpu
            return bool(self.rw.heartbeat(step, phase, seconds, **fields))
        except Exception as exc:  # noqa: BLE001 - the publisher should not raise; if it does, keep beating
            if not self._warned:
                self._warned = True
                log.warning("runwatch: heartbeat failed (further failures are not logged): %r", exc)
            return False

    def check_stacks(self) -> bool:
        """Publish every thread's stack if the step has not moved for ``stacks_after_s`` (train or dataload
        phase) and this stall's are not out yet; True when it published. The heartbeat thread calls it;
        a caller that drives :meth:`beat` itself (a clock of its own) may too. Never raises."""
        after = self.stacks_after_s
        if after is None:
            return False
        step, now = self._step, self._clock()
        phase, entered_at = self._state
        if phase != self._seen_phase[0]:  # (an eval that ended: the train phase it resumes counts from now)
            self._seen_phase = (phase, min(now, entered_at) if phase != "train" else now)
        seen_step, seen_at = self._seen
        if step != seen_step:  # progress (or the first step): a new episode
            self._seen, self._stacks_sent = (step, now), False
            return False
        if step is None or self._stacks_sent or phase not in STACK_PHASES:
            return False
        if now - max(seen_at, self._seen_phase[1], entered_at) < after:
            return False
        self._stacks_sent = True
        return self._publish_stacks(step, phase, now - seen_at)

    def _publish_stacks(self, step: int, phase: str, since_s: float) -> bool:
        send = getattr(self.rw, "evidence", None)
        if send is None:
            return False
        try:
            from runwatch.producer.instrument.stacks import capture_threads, flight_recorder_dump

            me = threading.get_ident()  # (left out, unless the caller is the training thread itself)
            threads, source = capture_threads(
                self.training_thread, exclude=None if me == self.training_thread else me
            )
            recorder, status = flight_recorder_dump()
            sent = bool(
                send(
                    step,
                    reason="no_progress",
                    phase=phase,
                    seconds_since_step=max(0.0, since_s),
                    threads=threads,
                    source=source,
                    flight_recorder=recorder,
                    flight_recorder_status=status,
                )
            )
        except Exception as exc:  # noqa: BLE001 - evidence that fails is absent; the heartbeat goes on
            if not self._warned:
                self._warned = True
                log.warning("runwatch: capturing stacks failed (further failures are not logged): %r", exc)
            return False
        self.stacks_published += sent
        return sent

    def _stack_poll_s(self) -> float:
        """How often the heartbeat thread looks at the step for the stacks' sake."""
        after = self.stacks_after_s
        return self.interval_s if after is None else min(self.interval_s, max(0.1, after / 5))

    def _gpu(self) -> dict[str, Any] | None:
        sampler = self.gpu_health
        if sampler is None:
            return None
        try:
            figures = sampler.sample()
        except Exception as exc:  # noqa: BLE001 - a measurement that fails is absent
            if not self._warned:
                self._warned = True
                log.warning("runwatch: GPU health failed (further failures are not logged): %r", exc)
            return None
        return figures if isinstance(figures, dict) and figures else None

    def _optional_fields(self) -> frozenset[str]:
        """Which of ``host_load`` and ``gpu`` ``rw.heartbeat`` takes (every runwatch publisher's takes both;
        a field it does not take goes out without it)."""
        if self._takes is None:
            heartbeat = getattr(self.rw, "heartbeat", None)
            try:
                params = inspect.signature(heartbeat).parameters if heartbeat is not None else {}
            except (TypeError, ValueError):
                params = {}
            self._takes = frozenset(p for p in ("host_load", "gpu") if p in params)
        return self._takes

    def _in_sync(self) -> bool | None:
        if self._waiting:
            return True
        provider = self.in_sync
        if provider is None:
            return None
        try:
            value = provider()
        except Exception as exc:  # noqa: BLE001 - a measurement that fails is absent, not a reason to
            # stop beating
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
        try:
            self._beat_until(stopping)
        finally:
            close = getattr(self.gpu_health, "close", None)
            if close is not None:  # (NVML is released on the thread that used it)
                try:
                    close()
                except Exception:  # noqa: BLE001 - nothing to do about a release that fails
                    pass

    def _beat_until(self, stopping: threading.Event) -> None:
        poll = self._stack_poll_s()
        while True:
            self.beat()
            deadline = time.monotonic() + self.interval_s
            while True:  # (looking at the step between beats, for the stacks)
                left = deadline - time.monotonic()
                woke = self._wake.wait(min(poll, left)) if left > 0 else False
                if stopping.is_set():
                    return
                self.check_stacks()
                if woke or time.monotonic() >= deadline:
                    break
            self._wake.clear()
            if stopping.is_set():
                return
