"""``OffStepTime``: the time a loop spends in eval, checkpoint or idle phases, left out of its steps.

``Watcher.phase`` and ``Watcher.set_phase`` open and close the stretches (nested ones count once, under
the outermost phase); ``Watcher.end_step`` takes what accumulated since the previous step: the seconds
it leaves out of ``step_time_s``, the stretches as (start, end) for DDP's ``compute_s``, and the seconds
by phase for the step event's ``off_step_s`` (goodput).
"""

from __future__ import annotations

from collections.abc import Callable

# Time in these phases is not part of any step: it is left out of the next step's step_time_s.
OFF_STEP_PHASES = frozenset({"eval", "checkpoint", "idle"})


class OffStepTime:
    """Off-step stretches on ``clock`` (seconds), accumulated until :meth:`take`."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._since: float | None = None  # start of the current eval/checkpoint/idle stretch
        self._depth = 0
        self._seconds = 0.0  # off-step time since the last take
        self._spans: list[tuple[float, float]] = []  # the same stretches as (start, end), for compute_s
        # The same time by phase (the outermost off-step phase of a stretch), published as off_step_s
        self._phase: str = "idle"
        self._by_phase: dict[str, float] = {}

    def begin(self, phase: str) -> None:
        self._depth += 1
        if self._depth == 1:
            self._since = self._clock()
            self._phase = phase

    def end(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._since is not None:
            self._count(self._since, self._clock())
            self._since = None

    def take(self, timed: bool) -> tuple[float, list[tuple[float, float]], dict[str, float]]:
        """The off-step seconds, stretches and seconds by phase since the last take, and starts again. The
        seconds only for a ``timed`` step (one with a step time to take them from): an untimed step's stay
        for the next one."""
        seconds = 0.0
        if timed:
            if self._since is not None:  # still inside one: count up to now, restart from now
                now = self._clock()
                self._count(self._since, now)
                self._since = now
            seconds, self._seconds = self._seconds, 0.0
        spans, self._spans = self._spans, []
        by_phase, self._by_phase = self._by_phase, {}
        return seconds, spans, by_phase

    def _count(self, start: float, end: float) -> None:
        self._seconds += end - start
        self._spans.append((start, end))
        self._by_phase[self._phase] = self._by_phase.get(self._phase, 0.0) + (end - start)
