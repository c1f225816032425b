"""One module's gradient norm exploding, named, while the rest of the model stays put.

Per module: robust z of log(norm) against the module's own median / IQR, plus a minimum
ratio to its typical norm, plus a minimum share of the squared global norm (the sum of
squares of the module norms), plus standing out from the rest of the model: z and ratio
must also hold for the module's growth beyond the median module's growth this step.
That last test is what leaves a run-wide gradient spike (every module up together, a
dominant module included) to the grad-norm spike detector; the share alone cannot, since
a module that is large all along keeps its share when everything rises.

Gradual explosions: values half-way to a finding ("suspects", also judged beyond the
median module) are kept out of the history, and each module is also scored against a lagged baseline (its
median and scale as they were one to two windows ago), so growth over tens of steps is measured against the
norm before it began instead of being absorbed by the rolling window. After ``window`` suspect steps in a row
the new level is accepted as normal.

The history is a numpy ring buffer per module (``ModuleHistories``) rather than river ``RollingQuantile``:
with ~100 modules a Python loop over three river quantiles per module costs ~70 us per event; vectorised
scoring plus a quantile refresh every few events costs well under half that.
"""

from __future__ import annotations

import math
from datetime import datetime

import numpy as np
from pydantic import Field

from runwatch.contract.schema import StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register
from runwatch.detectors.rolling_quantile import IQR_TO_SIGMA


class ModuleGradConfig(Strict):
    """One module's gradient norm exploding while it stays a module-level, not run-level, event."""

    enabled: bool = True
    window: int = Field(default=100, ge=8, description="steps of per-module history for its typical norm")
    warmup: int = Field(default=20, ge=4, description="steps observed before any finding")
    z_threshold: float = Field(
        default=6.0, gt=0, description="robust z of log(module norm) against its own history"
    )
    min_ratio: float = Field(
        default=5.0, ge=1.0, description="module norm / its typical norm must also reach this"
    )
    min_share: float = Field(
        default=0.1, ge=0, le=1, description="the module's share of the squared global norm must reach this"
    )
    cooldown_steps: int = Field(
        default=20, ge=0, description="steps after a finding for that module before the next"
    )


NAME = "module_grad_explosion"
MIN_SCALE_LOG = 0.05  # floor on the robust scale in log units: a very flat module is not a hair trigger
# events between quantile refreshes; the history excludes suspects, so staleness is harmless
REFRESH_EVERY = 20
_max = np.maximum.reduce  # ndarray.max without its Python wrapper (the same reduction; NaN propagates)


def _grow_snapshot(
    snap: tuple[np.ndarray, np.ndarray, np.ndarray], n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    median, scale, ready = snap
    return _grow(median, n, 0.0), _grow(scale, n, 1.0), _grow(ready, n, False)


def _grow(a: np.ndarray, n: int, fill: float | int | bool) -> np.ndarray:
    return np.concatenate([a, np.full(n, fill, dtype=a.dtype)])


def _plan(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Columns and weights of the 25/50/75% quantiles of ``n`` sorted values: each quantile is
    ``ordered[lo] * (1 - frac) + ordered[hi] * frac``, pairs of (lo, hi) and of (1 - frac, frac)."""
    columns, weights = [], []
    for q in (0.25, 0.5, 0.75):
        at = (n - 1) * q
        lo = math.floor(at)
        frac = at - lo
        columns += [lo, min(lo + 1, n - 1)]
        weights += [1 - frac, frac]
    return np.array(columns, dtype=np.intp), np.array(weights)


class ModuleHistories:
    """The recent log norms of every module: one numpy ring buffer of ``window`` slots per module (a
    row; empty slots are NaN). While every module has stored a value at every step since they all
    started (the usual case), they share one next slot, so a step is stored with one column write."""

    def __init__(self, window: int):
        self.window = window
        self._buf = np.full((0, window), np.nan)
        self._pos = np.zeros(0, dtype=np.intp)  # next slot per module (not kept while _upos >= 0)
        self._upos = 0  # the next slot of every module while they are in step (-1: they are not)
        self.count = np.zeros(0, dtype=np.int64)  # values stored per module so far (not capped)
        self._rows = np.zeros(0, dtype=np.intp)
        self._all_full = False  # every module's history holds `window` values
        self._plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # history length -> _plan(n)

    def __len__(self) -> int:
        return len(self._pos)

    def add(self, n: int) -> None:
        """``n`` new modules, with empty histories."""
        self._buf = np.vstack([self._buf, np.full((n, self.window), np.nan)])
        if self._upos >= 0 and self.count.any():  # the new modules start afresh, the others do not
            self._pos[:] = self._upos
            self._upos = -1
        self._pos = _grow(self._pos, n, 0)
        self.count = _grow(self.count, n, 0)
        self._all_full = False
        self._rows = np.arange(len(self._pos))

    def store_all(self, x: np.ndarray) -> None:
        """Append ``x`` (one value per module) to every history."""
        if self._upos >= 0:
            self._buf[:, self._upos] = x
            self._upos = (self._upos + 1) % self.window
            self.count += 1
            return
        self._buf[self._rows, self._pos] = x
        self._pos += 1
        self.count += 1
        self._pos[self._pos >= self.window] = 0

    def store(self, store: np.ndarray, x: np.ndarray) -> None:
        """Append ``x`` to the histories of the modules in ``store`` (a mask)."""
        if store.all():
            self.store_all(x)
            return
        if self._upos >= 0:  # some modules fall out of step from here on
            self._pos[:] = self._upos
            self._upos = -1
        idx = np.flatnonzero(store)
        self._buf[idx, self._pos[idx]] = x[idx]
        self._pos[idx] += 1
        self.count[idx] += 1
        self._pos[self._pos >= self.window] = 0

    def quartiles(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The 25/50/75% quantiles of every module's stored history (as river's ``RollingQuantile``
        interpolates; an empty history gives NaN)."""
        window = self.window
        ordered = np.sort(self._buf, axis=1)  # empty slots are NaN and sort last
        count = self.count
        n = None  # one history length for every module, if they have
        if self._upos >= 0:
            n = max(min(int(count[0]), window), 1)
        elif self._all_full or int(count.min()) >= window:
            self._all_full = True  # (it stays so until a module is added)
            n = window
        if n is not None:
            # The same ranks in every row (the usual case): the three quantiles come from one gather of
            # their six columns and the same interpolation as below, elementwise.
            plan = self._plans.get(n)
            if plan is None:
                plan = self._plans[n] = _plan(n)
            columns, weights = plan
            q = ordered[:, columns] * weights
            q = q[:, 0::2] + q[:, 1::2]
            return q[:, 0], q[:, 1], q[:, 2]
        lengths = np.maximum(np.minimum(count, window), 1)
        rows = self._rows

        def quantile(q: float) -> np.ndarray:
            at = (lengths - 1) * q
            lo = np.floor(at).astype(np.intp)
            hi = np.minimum(lo + 1, lengths - 1)
            frac = at - lo
            result: np.ndarray = ordered[rows, lo] * (1 - frac) + ordered[rows, hi] * frac
            return result

        return quantile(0.25), quantile(0.5), quantile(0.75)


class ModuleGradDetector(Detector):
    name = NAME

    def __init__(self, config: ModuleGradConfig):
        self.config = config
        self._log_ratio = math.log(config.min_ratio)
        self._names: list[str] = []  # column -> module name
        self._column: dict[str, int] = {}
        self._order: tuple[str, ...] = ()  # key order of the last event, whose columns are cached
        self._cols = np.zeros(0, dtype=np.intp)
        self._identity = True  # the cached order is exactly columns 0..n-1
        self._history = ModuleHistories(config.window)  # log norms
        # current robust baseline, and lagged snapshots of it (taken every `window` events)
        self._median = np.zeros(0)
        self._scale = np.ones(0)
        self._ready = np.zeros(0, dtype=bool)
        self._all_ready = False
        # (median, scale, ready) per module, at the last snapshot and the one before
        self._snap: tuple[np.ndarray, np.ndarray, np.ndarray] = (
            np.zeros(0),
            np.ones(0),
            np.zeros(0, dtype=bool),
        )
        self._old: tuple[np.ndarray, np.ndarray, np.ndarray] = (
            np.zeros(0),
            np.ones(0),
            np.zeros(0, dtype=bool),
        )
        self._any_old = False
        self._old_all_ready = False
        self._since_refresh = 0
        self._since_snapshot = 0
        # per-module episode state
        self._quiet_until = np.zeros(0, dtype=np.int64)
        # cooldowns cover [from, until]: a rollback's replay is outside
        self._quiet_from = np.zeros(0, dtype=np.int64)
        self._streak = np.zeros(0, dtype=np.int64)  # consecutive suspect steps
        self._streak_start = np.zeros(0, dtype=np.int64)
        self._reported = np.zeros(0)  # log ratio last reported in the current streak (-inf: none)
        self._any_streak = False  # some module is in a suspect streak (self._streak.any())
        self._bound: np.ndarray | None = None  # see _suspect_bound (None: to be computed)

    # -- columns ------------------------------------------------------------------------------

    def _columns_for(self, names: tuple[str, ...]) -> None:
        cols = []
        for name in names:
            col = self._column.get(name)
            if col is None:
                col = self._column[name] = len(self._names)
                self._names.append(name)
            cols.append(col)
        n = len(self._names) - len(self._history)
        if n:
            self._history.add(n)
            self._median = _grow(self._median, n, 0.0)
            self._scale = _grow(self._scale, n, 1.0)
            self._ready = _grow(self._ready, n, False)
            self._all_ready = False
            self._snap = _grow_snapshot(self._snap, n)
            self._old = _grow_snapshot(self._old, n)
            self._quiet_until = _grow(self._quiet_until, n, -1)
            self._quiet_from = _grow(self._quiet_from, n, 0)
            self._streak = _grow(self._streak, n, 0)
            self._streak_start = _grow(self._streak_start, n, 0)
            self._reported = _grow(self._reported, n, -np.inf)
        self._bound = None
        self._order = names
        self._cols = np.asarray(cols, dtype=np.intp)
        self._identity = cols == list(range(len(self._names)))

    def _refresh(self) -> None:
        """Median and robust scale of every module's stored history."""
        self._since_refresh = 0
        window = self.config.window
        q25, self._median, q75 = self._history.quartiles()
        self._scale = np.maximum((q75 - q25) / IQR_TO_SIGMA, MIN_SCALE_LOG)
        if not self._all_ready:  # (once all are ready, they stay ready until a module is added)
            self._ready = self._history.count >= self.config.warmup
            self._all_ready = bool(self._ready.all())
        if self._since_snapshot >= window:
            self._since_snapshot = 0
            self._old = self._snap
            self._snap = (self._median, self._scale, self._ready)
            self._any_old = bool(self._old[2].any())
            self._old_all_ready = bool(self._old[2].all())
        self._bound = None

    def _suspect_bound(self) -> np.ndarray:
        """Per module, the lowest baseline its deviation can be scored against this step: the current
        median, or the lagged one where that is lower (and ready). ``x - bound`` is then, value for value,
        the largest deviation the scoring can see (x - median or x - lagged median, the very same
        subtraction), so when it stays under the suspect level for every module, no module is a suspect.
        Modules without a history (NaN median) cannot be suspects: +inf takes them out of the bound."""
        median = self._median
        if self._any_old:
            old_median, _, old_ready = self._old
            # no NaN among the lagged medians of ready modules: the lower of each pair
            if self._old_all_ready:
                median = np.minimum(old_median, median)  # (where equal, either: x - either is the same value)
            else:
                median = np.where(old_ready & (old_median < median), old_median, median)
        if self._all_ready:  # every history holds a value: no NaN median
            self._bound = median
        else:
            self._bound = np.where(np.isnan(median), np.inf, median)
        return self._bound

    # -- per event ----------------------------------------------------------------------------

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent) or not event.module_grad_norms:
            return []
        cfg = self.config
        norms = event.module_grad_norms
        names = tuple(norms)
        if names != self._order:
            self._columns_for(names)
        values = np.fromiter(norms.values(), dtype=np.float64, count=len(names))
        # Every norm above 0 and none NaN (numpy's min > 0), in Python floats, which cost less on 20 values:
        # a NaN makes the sum NaN (as do an infinity and its negative, but then the min is -inf).
        total = sum(norms.values())
        positive = total == total and min(norms.values()) > 0
        if self._identity:
            v = values
        else:
            v = np.full(len(self._names), np.nan)  # modules absent from this event: neither scored nor stored
            v[self._cols] = values
        if positive:
            x = np.log(v)
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                # 0 -> -inf, negative / NaN -> NaN; non-finite grads are the non-finite detector's
                x = np.log(v)

        self._since_refresh += 1
        self._since_snapshot += 1
        if self._since_refresh >= REFRESH_EVERY or (
            not self._all_ready and bool(((self._history.count >= cfg.warmup) & ~self._ready).any())
        ):
            self._refresh()

        half = self._log_ratio / 2
        if self._identity:
            bound = self._bound if self._bound is not None else self._suspect_bound()
            # (the ufunc's reduce: ndarray.max's own wrapper costs as much again on 20 values)
            if _max(x - bound) < half:  # False for a NaN (then the full scoring below decides)
                # The usual step: no module is near a suspect, so none is scored, and every finite value
                # is stored (what the full scoring below concludes, at a fraction of its cost).
                if self._any_streak:
                    self._streak[:] = 0
                    self._reported[:] = -np.inf
                    self._any_streak = False
                if positive:  # every module stores (no NaN, no log(0))
                    self._history.store_all(x)
                else:
                    self._history.store(np.isfinite(x), x)
                return []
        return self._score(event, v, x, half)

    def _score(self, event: StepEvent, v: np.ndarray, x: np.ndarray, half: float) -> list[Finding]:
        """The full scoring of one step's module norms ``v`` (log: ``x``) against their histories."""
        cfg = self.config
        finite = np.isfinite(x)
        sq = np.where(finite, v * v, 0.0)
        global_sq = float(sq.sum())

        median, scale, ready = self._median, self._scale, self._ready
        dev = x - median  # log(norm / typical)
        z = dev / scale
        if self._any_old:  # the lagged baseline wins where it says "higher": growth the window absorbed
            old_median, old_scale, old_ready = self._old
            dev_old = x - old_median
            use_old = old_ready & (dev_old > dev)
            if use_old.any():
                median = np.where(use_old, old_median, median)
                scale = np.where(use_old, old_scale, scale)
                dev = np.where(use_old, dev_old, dev)
                z = dev / scale
                ready = ready | use_old

        suspect = finite & ready & (z >= cfg.z_threshold / 2) & (dev >= half)
        findings: list[Finding] = []
        step = event.step
        if suspect.any():
            # Every test is on the growth beyond the typical (median) module's this step: a run-wide
            # rise (a spike, or all gradients growing as the LR warms up) is not one module exploding.
            scored = dev[finite & ready]
            mid = (len(scored) - 1) // 2  # lower median (np.median costs ~5x more)
            rest = max(float(np.partition(scored, mid)[mid]), 0.0)
            relative = dev - rest
            rel_z = relative / scale
            suspect &= (relative >= half) & (rel_z >= cfg.z_threshold / 2)
        if suspect.any():
            self._streak_start = np.where(self._streak == 0, step, self._streak_start)
            self._streak = np.where(suspect, self._streak + 1, 0)
            self._reported = np.where(suspect, self._reported, -np.inf)
            candidate = (
                suspect
                & (rel_z >= cfg.z_threshold)
                & (relative >= self._log_ratio)
                & (sq >= cfg.min_share * global_sq)
                & ((self._quiet_until < step) | (step < self._quiet_from))
                # within one explosion, report again only once it has grown by another min_ratio
                & (dev >= self._reported + self._log_ratio)
            )
            for col in np.flatnonzero(candidate).tolist():
                findings.append(
                    self._finding(
                        event,
                        col,
                        float(v[col]),
                        float(median[col]),
                        float(scale[col]),
                        float(dev[col]),
                        float(rel_z[col]),
                        float(sq[col]) / global_sq,
                        rest,
                    )
                )
                self._quiet_from[col], self._quiet_until[col] = step + 1, step + cfg.cooldown_steps
                self._reported[col] = dev[col]
        elif self._streak.any():
            self._streak[:] = 0
            self._reported[:] = -np.inf

        self._any_streak = bool(self._streak.any())
        # Keep suspects out of the history unless they have lasted a full window (a new normal).
        self._history.store(finite & (~suspect | (self._streak >= cfg.window)), x)
        return findings

    def _finding(
        self,
        event: StepEvent,
        col: int,
        value: float,
        median: float,
        scale: float,
        dev: float,
        z: float,
        share: float,
        rest: float,
    ) -> Finding:
        cfg = self.config
        name = self._names[col]
        typical = math.exp(median)
        ratio = math.exp(dev)
        onset = int(self._streak_start[col])
        evidence = {
            "module": name,
            "typical_norm": typical,
            "ratio": ratio,
            "share_of_global_sq": share,
            "median_module_ratio": math.exp(rest),
            "robust_scale_log": scale,
            "window": cfg.window,
        }
        since = ""
        if onset < event.step:
            evidence["onset_step"] = onset
            since = f", rising since step {onset}"
        return Finding(
            detector=NAME,
            metric=f"module_grad_norms.{name}",
            step=event.step,
            rank=event.rank,
            severity="critical" if ratio >= cfg.min_ratio**2 else "warning",
            value=value,
            threshold=typical * math.exp(rest + max(cfg.z_threshold * scale, self._log_ratio)),
            score=z,
            message=(
                f"module {name} gradient norm {value:.4g} is {ratio:.1f}x its typical {typical:.4g} and "
                f"{share:.0%} of the squared global norm, while the median module is at "
                f"{math.exp(rest):.2f}x (robust z {z:.1f}){since}"
            ),
            evidence=evidence,
        )


register(
    DetectorSpec(
        name=NAME,
        config=ModuleGradConfig,
        build=lambda d: ModuleGradDetector(d.module_grad_explosion),
        view="joined",
        knob="z_threshold",
        summary=(
            "one module's gradient norm exploding while the "
            "global norm may still look fine (names the module)"
        ),
    )
)
