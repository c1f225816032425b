"""Section timing for ``DistributedDataParallel``: this rank's own work per step, and whether it
is waiting for its peers right now.

Why: in lockstep data-parallel training the fast ranks wait inside ``backward()`` (DDP's gradient
all-reduce) for the slowest one, so every rank's step time is the same and says nothing about
which rank holds the others up. Only the time from the step's start up to the point where the
rank is ready to synchronise does: that is ``compute_s`` on step events, and what the worker's
straggler detector compares across ranks. It is the "section timing" approach of NVIDIA's
straggler detector (nvidia-resiliency-ext), taken at the one point DDP exposes: its comm hook,
called as each gradient bucket is ready and its all-reduce is launched.

The same point says whether a rank is waiting: once it has launched the last bucket of its
backward pass (``GradBucket.is_last()``: DDP launches buckets strictly in index order, so the
last index is the last launch) it has done its part of the step and ``in_sync`` is True until the
step ends (``end_step``). A hung rank's peers report True while it reports False. The last
bucket is read from DDP itself rather than counted: DDP rebuilds its buckets after the first
iteration, so a count learned from the first step need not hold for the next.

The hook wraps DDP's default ``allreduce_hook``, so the gradients are exactly what DDP computes
without it. It runs on autograd's threads, so it only stores floats (and, on CUDA, records one
event per backward pass): no lock, no allocation of note. A comm hook can be registered once per
model, before training: if something else registered one, timing is off (logged once) and
``compute_s``/``in_sync`` stay absent.

CUDA: the hook runs when the CPU launches the all-reduce, which can be well ahead of the GPU, so
there the times are CUDA events on the current stream (the step's start at ``end_step``, the last
bucket in the hook), read when the Watcher publishes the step, after its own deferred copy has
completed. ``in_sync`` then asks the GPU whether it has reached the last bucket of a step and not
yet the end of that step (the CPU may already be a step ahead). Off-step time (eval, checkpoint)
is taken out as the CPU measured it, which is exact only where that phase ends in a sync.

What compute_s does not separate: a collective of the rank's own before its last bucket (DDP
broadcasts to rebuild its buckets in the second step's forward, so that step's compute_s
includes waiting for peers; so would a user's all-reduce of the loss before backward). Steps
that launch no gradient sync (``no_sync()`` micro-steps folded into one step are fine: the step
ends with a syncing backward) have no compute_s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

KEPT_ROUNDS = 3  # closed steps kept for in_sync on CUDA, where the GPU may lag the CPU by a step or two


class SyncRound:
    """One step's marks. Written by the training thread (start, close) and the hook (launches)."""

    __slots__ = (
        "start",
        "start_event",
        "launches",
        "last_at",
        "sync_at",
        "sync_event",
        "close_event",
        "closed",
    )

    def __init__(self, start: float, start_event: Any = None):
        self.start = start
        self.start_event = start_event
        self.launches = 0  # buckets launched in this step (over every backward pass in it)
        self.last_at: float | None = None  # clock at the latest bucket launch
        self.sync_at: float | None = None  # clock at the latest launch of a backward pass's last bucket
        self.sync_event: Any = None  # CUDA: event recorded at that launch
        self.close_event: Any = None  # CUDA: event recorded at end_step
        self.closed = False


class DDPSyncTimer:
    """Times one DDP model's gradient-synchronisation point (see the module doc).

    ``register(model)`` installs the comm hook; the Watcher calls :meth:`close_round` at each
    ``end_step`` and publishes :meth:`compute_s` of the round it got; the heartbeat reads
    :meth:`in_sync`.
    """

    def __init__(self, clock: Callable[[], float], device: Any = None):
        self._clock = clock
        self._cuda_device = device if device is not None and getattr(device, "type", None) == "cuda" else None
        self.registered = False
        self._round = SyncRound(clock(), self._event())
        # Newest last; replaced as a whole (one atomic store), so the heartbeat thread
        # reads a consistent tuple.
        self._rounds: tuple[SyncRound, ...] = (self._round,)

    def register(self, model: Any) -> bool:
        """Install the comm hook on ``model`` (a ``DistributedDataParallel``);
        False, logged, if it can't be."""
        try:
            model.register_comm_hook(getattr(model, "process_group", None), self.hook)
        except Exception as exc:  # noqa: BLE001 - torch's errors vary; most often a comm hook is
            # already registered (only one is allowed)
            log.warning(
                "runwatch: could not register the DDP comm hook that times the gradient sync (%r); "
                "compute_s and in_sync will be absent. Construct the watcher before any other comm "
                "hook is registered, or pass sync_timing=False.",
                exc,
            )
            return False
        self.registered = True
        return True

    # No annotations: DDP checks them against dist.GradBucket and Future, and with postponed
    # evaluation of annotations they would be strings. mypy reads the type comment instead.
    def hook(self, process_group, bucket):  # type: (Any, Any) -> Any
        """DDP comm hook: note the launch, then DDP's own all-reduce (on the autograd thread)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        now = self._clock()
        r = self._round
        r.launches += 1
        r.last_at = now
        if bucket.is_last():
            if self._cuda_device is not None:
                r.sync_event = self._event()
            r.sync_at = now
        return allreduce_hook(process_group, bucket)

    def close_round(self) -> SyncRound:
        """End the current step (from ``end_step``) and start the next; returns the step's marks."""
        now = self._clock()
        event = self._event()
        closed = self._round
        closed.close_event = event
        closed.closed = True
        self._round = SyncRound(now, event)  # the end of one step is the start of the next
        self._rounds = (*self._rounds[-(KEPT_ROUNDS - 1) :], self._round)
        return closed

    def compute_s(self, r: SyncRound, off_step: Sequence[tuple[float, float]] = ()) -> float | None:
        """Seconds from the step's start to its last bucket launch, less the off-step time in between;
        None if no gradient sync happened in the step. On CUDA this waits for the step's last event."""
        if r.sync_at is None:
            return None
        if r.sync_event is not None and r.start_event is not None:
            r.sync_event.synchronize()  # long done by the time the Watcher publishes the step
            elapsed: float = r.start_event.elapsed_time(r.sync_event) / 1000.0
        else:
            elapsed = r.sync_at - r.start
        elapsed -= _overlap(off_step, r.start, r.sync_at)
        return max(0.0, elapsed)

    def in_sync(self) -> bool | None:
        """True: this rank has launched its gradient sync for the step and waits for its peers (or
        is finishing the step after it); False: it is still working on its part; None: not timed."""
        if not self.registered:
            return None
        rounds = self._rounds
        if self._cuda_device is None:
            return rounds[-1].sync_at is not None
        import torch

        with torch.cuda.device(self._cuda_device):  # this runs on the heartbeat thread
            for r in reversed(rounds):  # the newest step whose sync point the GPU has reached
                if r.sync_at is not None and (r.sync_event is None or r.sync_event.query()):
                    return r.close_event is None or not r.close_event.query()
        return False

    def _event(self) -> Any:
        if self._cuda_device is None:
            return None
        import torch

        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call] # torch: unannotated
        event.record(torch.cuda.current_stream(self._cuda_device))
        return event


def _overlap(spans: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Total length of ``spans`` inside ``[start, end]``."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)


def is_ddp(model: Any) -> bool:
    """Whether ``model`` is a ``torch.nn.parallel.DistributedDataParallel``."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except Exception:  # noqa: BLE001 - no torch, or one that fails to import
        return False
    return isinstance(model, DistributedDataParallel)
