"""Verified recovery: after a rollback the run must come back to where it was before the fault.

When a rollback is decided, the run-level losses of the healthy steps before the onset are kept
as the reference. Once the trainer acknowledges the rollback as applied (to checkpoint step
``c``), the replayed steps ``c + 1, c + 2, ...`` are compared with the reference *at the same
step* (a step past the healthy ones is compared with the level the run had at the onset: the
median of the last ``judged_over`` healthy losses). The run must be back ``within_steps`` steps
past the fault's onset (not merely replay the healthy steps before it: a fault that strikes again
at the same step would pass that): at step ``onset + within_steps - 1`` the median of the last
``judged_over`` ratios ``loss / reference`` must be inside the band of the healthy steps:
``exp(band_z * robust scale of log loss)``, never tighter than ``1 + min_band``.
If it is not, a ``not_recovered`` finding (critical) says so; the policy turns it into another
rollback, counting towards the cap, or a stop. If it is, a ``recovered`` finding (info) says so, and
the monitor sends the trainer a ``recovered`` action, so the training log shows the rollback worked.
A run that reports no loss is not judged.

Pure and picklable, like every detector.
"""

from __future__ import annotations

import math

from pydantic import Field, model_validator

from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import Strict
from runwatch.detectors.rolling_quantile import IQR_TO_SIGMA


class RecoveryConfig(Strict):
    """After a rollback, the run must return to its pre-fault loss
    (``detectors/runwatch/detectors/engine/recovery.py``)."""

    enabled: bool = True
    within_steps: int = Field(
        default=20,
        ge=1,
        description="the run must be back this many steps past the fault's onset, when it is judged",
    )
    judged_over: int = Field(
        default=5, ge=1, description="the median of the last this many steps' loss ratios"
    )
    healthy_window: int = Field(
        default=20, ge=4, description="healthy steps before the onset that set the band"
    )
    band_z: float = Field(
        default=3.0, gt=0, description="band: exp(band_z x robust scale of their log loss) ..."
    )
    min_band: float = Field(default=0.1, ge=0, description="... and never tighter than 1 + this")

    @model_validator(mode="after")
    def _judged_fits(self) -> RecoveryConfig:
        if self.judged_over > self.within_steps:
            raise ValueError(
                f"judged_over ({self.judged_over}) must not exceed within_steps ({self.within_steps})"
            )
        return self


NAME = "not_recovered"
RECOVERED = "recovered"
NOT_FINITE_RATIO = 1e9  # a non-finite loss: far out of any band (and the anomaly stays valid JSON)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class RecoveryCheck:
    """One rollback's verification: ``arm`` on the applied ack, then ``update`` with joined steps."""

    def __init__(
        self,
        config: RecoveryConfig,
        action_id: str,
        onset_step: int,
        healthy: dict[int, float],
        fault_onset_step: int | None = None,
    ):
        """``onset_step``: the first suspect step (the reference is the steps before it);
        ``fault_onset_step``: where the fault first showed, when a failed recovery brought the
        rollback (its onset is earlier): the run is judged past the later of the two."""
        self.config = config
        self.action_id = action_id
        self.onset_step = max(onset_step, fault_onset_step or onset_step)
        self.reference = {
            s: v for s, v in healthy.items() if s < onset_step
        }  # step -> loss, the healthy steps
        recent = [math.log(v) for _, v in sorted(self.reference.items())[-config.healthy_window :]]
        if len(recent) >= 4:
            q25, q75 = _quantile(recent, 0.25), _quantile(recent, 0.75)
            scale = (q75 - q25) / IQR_TO_SIGMA
        else:
            scale = 0.0
        self.tolerance = max(math.exp(config.band_z * scale), 1.0 + config.min_band)
        tail = [v for _, v in sorted(self.reference.items())[-config.judged_over :]]
        self.level = _quantile(tail, 0.5) if tail else None  # the loss the run had at the onset
        self.to_step: int | None = None  # armed: the checkpoint step the run went back to
        self.ratios: list[float] = []
        self.done = False

    @property
    def armed(self) -> bool:
        return self.to_step is not None and not self.done

    def arm(self, to_step: int) -> None:
        self.to_step = to_step

    def update(self, step: int, loss: float | None) -> Finding | None:
        """The verdict once the run is judged (``recovered`` or ``not_recovered``), None before."""
        if self.to_step is None or self.done or step <= self.to_step or self.level is None:  # (not armed)
            return None
        if loss is None:
            return None
        ref = self.reference.get(step, self.level)
        self.ratios.append(loss / ref if math.isfinite(loss) and ref > 0 else NOT_FINITE_RATIO)
        if (
            step < self.onset_step + self.config.within_steps - 1
            or len(self.ratios) < self.config.judged_over
        ):
            return None
        self.done = True
        last = self.ratios[-self.config.judged_over :]
        ratio = _quantile(last, 0.5)
        evidence = {
            "fault_onset_step": self.onset_step,
            "rolled_back_to": self.to_step,
            "ratio": ratio,
            "tolerance": self.tolerance,
            "steps_replayed": len(self.ratios),
            "action_id": self.action_id,
        }
        assert self.to_step is not None  # (armed)
        where = (
            f"after the rollback to step {self.to_step}: {step - self.onset_step + 1} steps past the fault's "
            f"onset at step {self.onset_step} its loss is {ratio:.2f}x what it was before the fault"
        )
        recovered = ratio <= self.tolerance
        if not recovered:
            # the restored checkpoint did not bring the run back: a further rollback must go before it
            evidence = {"onset_step": self.to_step + 1, **evidence}
        return Finding(
            detector=RECOVERED if recovered else NAME,
            metric="loss",
            step=step,
            severity="info" if recovered else "critical",
            value=ratio,
            threshold=self.tolerance,
            score=ratio / self.tolerance,
            message=(
                f"the run recovered {where} (within the healthy band of {self.tolerance:.2f}x)"
                if recovered
                else f"the run did not recover {where} (the healthy band allows {self.tolerance:.2f}x)"
            ),
            evidence=evidence,
        )
