"""Several rolling quantiles of one series from one sorted window: the numbers river's
``stats.RollingQuantile`` gives, at a fraction of the cost of one river object per quantile.

river keeps a sorted copy of the window per ``RollingQuantile`` and interpolates linearly
between the two nearest ranks (``idx = q * (n - 1)``; ``lo + (hi - lo) * frac``). A detector
that wants the median and both quartiles of the same series paid for three sorted windows
and six calls through river's Python wrapper per event; here one ``bisect.insort`` and one
deletion keep the window sorted, and a quantile is two list reads. The interpolation is the
same expression in the same order, so the values are identical bit for bit (a unit test
compares them with river's over random streams). Values must not be NaN (river refuses them too).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque

# A robust spread as a standard deviation, for a normal distribution: its interquartile range is 1.349
# standard deviations, its median absolute deviation 1 / 1.4826 of one.
IQR_TO_SIGMA = 1.349
MAD_TO_SIGMA = 1.4826


class RollingQuantiles:
    """The rolling window of the last ``window_size`` values, kept sorted; ``get(q)`` as
    river's ``RollingQuantile(q)``."""

    __slots__ = ("_full", "_median_plan", "_ordered", "_quartile_plans", "_values", "window_size")

    def __init__(self, window_size: int):
        if window_size < 1:
            raise ValueError("window_size must be at least 1")
        self.window_size = window_size
        self._values: deque[float] = deque()  # arrival order, to know which value leaves the window
        self._ordered: list[float] = []  # the same values, sorted
        self._full: dict[float, tuple[int, int, float]] = {}  # q -> (lower, higher, frac) of a full window
        self._median_plan = _plan(0.5, window_size, full=True)
        self._quartile_plans: tuple[tuple[int, int, float], ...] | None = None

    def __len__(self) -> int:
        return len(self._ordered)

    def update(self, x: float) -> None:
        values = self._values
        ordered = self._ordered
        if len(values) == self.window_size:
            del ordered[bisect_left(ordered, values.popleft())]
        values.append(x)
        insort(ordered, x)

    def median(self) -> float:
        """``get(0.5)`` of a window that is not empty: the per-event call of a hot loop."""
        ordered = self._ordered
        n = len(ordered)
        if n == self.window_size:
            lo, hi, frac = self._median_plan
        elif n:
            lo, hi, frac = _plan(0.5, n, full=False)
        else:
            raise ValueError("the window is empty")
        low = ordered[lo]
        return low + (ordered[hi] - low) * frac

    def learn_if_below(self, x: float, limit: float) -> float:
        """``x - median()`` of a window that is not empty, and ``update(x)`` when that is below ``limit``:
        the usual step of a detector that learns only what does not stand out, in one call."""
        ordered = self._ordered
        n = len(ordered)
        window = self.window_size
        if n == window:
            lo, hi, frac = self._median_plan
        elif n:
            lo, hi, frac = _plan(0.5, n, full=False)
        else:
            raise ValueError("the window is empty")
        low = ordered[lo]
        deviation = x - (low + (ordered[hi] - low) * frac)
        if deviation < limit:
            values = self._values
            if n == window:  # (the sorted copy holds as many values as the arrival order)
                del ordered[bisect_left(ordered, values.popleft())]
            values.append(x)
            insort(ordered, x)
        return deviation

    def get(self, q: float) -> float | None:
        """The ``q`` quantile of the window (None while it is empty)."""
        ordered = self._ordered
        n = len(ordered)
        if n == self.window_size:
            plan = self._full.get(q)
            if plan is None:
                plan = self._full[q] = _plan(q, n, full=True)
            lo, hi, frac = plan
        elif n:
            lo, hi, frac = _plan(q, n, full=False)
        else:
            return None
        low = ordered[lo]
        return low + (ordered[hi] - low) * frac

    def quartiles(self) -> tuple[float, float, float]:
        """(``get(0.25)``, ``get(0.5)``, ``get(0.75)``) in one call; the window must not be empty."""
        ordered = self._ordered
        n = len(ordered)
        if n == self.window_size:
            plans = self._quartile_plans
            if plans is None:
                plans = self._quartile_plans = tuple(_plan(q, n, full=True) for q in (0.25, 0.5, 0.75))
        else:
            plans = tuple(_plan(q, n, full=False) for q in (0.25, 0.5, 0.75))
        (lo1, hi1, f1), (lo2, hi2, f2), (lo3, hi3, f3) = plans
        a, b, c = ordered[lo1], ordered[lo2], ordered[lo3]
        return a + (ordered[hi1] - a) * f1, b + (ordered[hi2] - b) * f2, c + (ordered[hi3] - c) * f3

    # The state pickles as plain data (``__slots__`` has no ``__dict__``).
    def __getstate__(self) -> tuple[int, list[float], list[float]]:
        return self.window_size, list(self._values), self._ordered

    def __setstate__(self, state: tuple[int, list[float], list[float]]) -> None:
        self.window_size, values, self._ordered = state
        self._values = deque(values)
        self._full = {}
        self._median_plan = _plan(0.5, self.window_size, full=True)
        self._quartile_plans = None


def _plan(q: float, n: int, full: bool) -> tuple[int, int, float]:
    """(lower rank, higher rank, interpolation fraction) of quantile ``q`` in ``n`` sorted values, as river
    (which, for q = 1 on a full window, interpolates towards the rank below with a fraction of 0)."""
    idx = q * (n - 1.0)
    lo = math.floor(idx)
    hi = lo + 1
    if hi > n - 1:
        hi = lo - 1 if full and n > 1 else n - 1
    return lo, hi, idx - lo
