"""Detector history rewound with the run: a snapshot of the detectors' state at each checkpoint,
restored when the run rolls back to it.

After a rollback to checkpoint ``c`` the trainer replays the steps after ``c``. Left alone, the
detectors would judge the replay against a history that includes the faulty steps they already
saw (a rolling median raised by a long fault, a throughput baseline that adapted to the slow
level, a memory trend, a cooldown): the same fault, replayed, might not be found again. So the
monitor snapshots the step-indexed detectors (every detector but the episodic liveness ones,
stall and hung rank, whose state is about wall time, not steps) when a checkpoint is registered,
and puts that state back when a rollback to that checkpoint is acknowledged: the replay is judged
exactly as the first pass was.

Bounded: snapshots are kept for pending checkpoints and the newest ``keep_good`` confirmed ones
(what a rollback can target); the rest are dropped. Pickled bytes, so a snapshot is a copy that
later events cannot change; except objects whose class says ``shared_in_snapshots`` (a baseline
band: large, and never changed once built), which every snapshot refers to instead of copying.
"""

from __future__ import annotations

import io
import pickle
from typing import Generic, TypeVar

State = TypeVar("State")


class _SharingPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, shared: dict[int, object]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.shared = shared

    def persistent_id(self, obj: object) -> int | None:
        if getattr(type(obj), "shared_in_snapshots", False) is True:
            self.shared[id(obj)] = obj  # (kept alive here, so its id is not reused)
            return id(obj)
        return None


class _SharingUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, shared: dict[int, object]):
        super().__init__(file)
        self.shared = shared

    def persistent_load(self, pid: object) -> object:
        if not isinstance(pid, int) or pid not in self.shared:
            raise pickle.UnpicklingError(f"unknown shared object {pid!r}")
        return self.shared[pid]


class DetectorSnapshots(Generic[State]):
    def __init__(self, keep_good: int = 3):
        self.keep_good = keep_good
        self._by_step: dict[int, bytes] = {}
        self._shared: dict[int, object] = {}  # the objects snapshots refer to, by id
        self.unpicklable = 0  # snapshots not taken: some detector's state would not pickle

    def take(self, step: int, state: State) -> None:
        try:
            buffer = io.BytesIO()
            _SharingPickler(buffer, self._shared).dump(state)
            self._by_step[step] = buffer.getvalue()
        except (pickle.PicklingError, TypeError, AttributeError):
            # A detector whose state does not pickle (outside the contract; the conformance suite
            # catches it for registered ones): no rewind to this checkpoint, and no crash either.
            self.unpicklable += 1

    def restore(self, step: int) -> State | None:
        """The state at checkpoint ``step`` (None without a snapshot); later snapshots belong to
        the abandoned timeline and are dropped."""
        blob = self._by_step.get(step)
        self._by_step = {s: b for s, b in self._by_step.items() if s <= step}
        if blob is None:
            return None
        state: State = _SharingUnpickler(io.BytesIO(blob), self._shared).load()  # what take() pickled
        return state

    def prune(self, pending: list[int], good: list[int]) -> None:
        keep = set(pending) | set(sorted(good)[-self.keep_good :])
        self._by_step = {s: b for s, b in self._by_step.items() if s in keep}

    @property
    def steps(self) -> list[int]:
        return sorted(self._by_step)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self._by_step.values())
