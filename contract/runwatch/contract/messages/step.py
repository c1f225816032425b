"""A training step (``kind`` ``step``) and the figures it carries: category losses, activations, memory,
the joined step's rank extremes and replica digests."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from runwatch.contract.limits import Within
from runwatch.contract.messages.base import EventBase, Phase, WireFloat, WireModel


class CategoryLoss(WireModel):
    """One category's loss in a step or eval. Optional spread (``category_loss`` fills both, issue 37):
    ``sumsq``, the count times the category's weighted mean of squared per-sample losses (without
    weights, their plain sum of squares: ``sumsq / count - mean**2`` is the variance, and sums merge
    across ranks); ``tail_count``, its samples above the batch's 90th percentile of per-sample loss."""

    mean: WireFloat
    count: int = Field(ge=0)
    sumsq: WireFloat | None = None
    tail_count: int | None = Field(default=None, ge=0)


class ActivationStats(WireModel):
    """One module's output on a sampled step (``rw.watch(..., activations=True)``, instrument/activations.py):
    ``rms`` the root mean square of its entries, ``zero_frac`` the fraction exactly 0 (dead units, for a
    ReLU-like output), over the step's training-mode forward calls."""

    rms: WireFloat
    zero_frac: WireFloat = Field(ge=0, le=1)


class RankExtreme(WireModel):
    """The rank with the largest figure of a joined step (issue 38): its ``rank``, its ``value`` and the
    other ranks' ``others`` (the mean of their losses; the root mean square of their gradient norms), so a
    spike of one rank is judged as that rank's, not averaged away in the joined mean. Set by the worker's
    join on the joined step only; a rank's own step event has none."""

    rank: int = Field(ge=0)
    value: WireFloat
    others: WireFloat
    ranks: int = Field(ge=2, description="ranks whose figures the step combined")


class DigestGroup(WireModel):
    """The ranks of one joined step whose ``param_digest`` is ``digest``: how many, and the lowest few."""

    digest: str
    count: int = Field(ge=1)
    ranks: list[int] = Field(default_factory=list)


class ReplicaDigests(WireModel):
    """A joined step's parameter digests by value, largest group first (at most ``DIGEST_GROUPS``; the
    ranks of the rest are counted in ``other``)."""

    groups: list[DigestGroup] = Field(default_factory=list)
    other: int = Field(default=0, ge=0)


DIGEST_GROUPS = 8  # the digest groups a joined step keeps
DIGEST_RANKS_LISTED = 8  # and the ranks it names in each


class MemoryStats(WireModel):
    """Bytes. A source that is not available is absent, never zero."""

    allocated: int | None = None
    reserved: int | None = None
    peak: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    host_rss: int | None = None
    cgroup_usage: int | None = None
    cgroup_limit: int | None = None
    device_total: int | None = None  # CUDA device capacity: the limit allocated/reserved grow towards


# Why the trainer's step guard skipped an update (StepEvent.update_skipped)
UpdateSkipped = Literal["nonfinite", "grad_spike"]
# What is wrong with the producer's own instrumentation (StepEvent.instrumentation)
Instrumentation = Literal["optimizer_not_stepping"]


class StepEvent(EventBase):
    kind: Literal["step"] = "step"
    step: int = Field(ge=0)
    loss: WireFloat | None = None
    lr: list[WireFloat] = Field(default_factory=list)
    grad_norm: WireFloat | None = None
    grad_norm_clipped: WireFloat | None = None
    clip_ratio: WireFloat | None = None
    param_norm: WireFloat | None = None
    update_norm: WireFloat | None = None
    relative_update_norm: WireFloat | None = None
    effective_lr_ratio: WireFloat | None = None
    module_grad_norms: dict[str, WireFloat] = Field(default_factory=dict)
    category_loss: dict[str, CategoryLoss] = Field(default_factory=dict)
    # Per leaf module, on the steps the activation probe samples (every ``activations_every`` steps;
    # absent on the others and when ``activations`` is off): its output's RMS and fraction of exact
    # zeros. At most ``WireLimits.max_modules`` entries, like module_grad_norms.
    module_activations: dict[str, ActivationStats] = Field(default_factory=dict)
    step_time_s: Annotated[WireFloat | None, Within("max_duration_s")] = None
    data_wait_s: Annotated[WireFloat | None, Within("max_duration_s")] = None
    samples_per_s: Annotated[WireFloat | None, Within("max_rate")] = None
    tokens_per_s: Annotated[WireFloat | None, Within("max_rate")] = None
    mfu: Annotated[WireFloat | None, Within(100.0)] = None
    memory: MemoryStats | None = None
    nonfinite_grads: int | None = Field(default=None, ge=0)
    # True: grad_norm, grad_norm_clipped, module_grad_norms, param_norm and update_norm cover only
    # this rank's shard of the parameters (FSDP/ZeRO style); the worker's cross-rank join takes the
    # root of the sum of squares. Absent/False: every rank holds the full (replicated) figures.
    grad_sharded: bool | None = None
    # Seconds of this rank's own work in the step (from the step's start until it was ready to
    # synchronise gradients with its peers), without the time spent waiting for slower peers.
    # What straggler detection compares; absent where it is not measured.
    compute_s: Annotated[WireFloat | None, Within("max_duration_s")] = Field(default=None, ge=0)
    # The trainer's step guard skipped this step's update before it landed (instrument/guard.py): its
    # gradient was not finite, or its norm an outlier of the recent band. Absent: the update was applied.
    update_skipped: UpdateSkipped | None = None
    # A rollback's LR scale in force in this step's update (held in every step, then returned to 1:
    # publish/lr_hold.py); absent at 1.
    lr_scale: WireFloat | None = Field(default=None, gt=0, le=1)
    # The watcher's instrumentation has lost its hold on the run. ``optimizer_not_stepping``: the
    # optimizer given to rw.watch has not stepped for 3+ steps in a row while the model had gradients
    # (the loop most likely replaced it without calling rw.watch again): the step carries no gradient,
    # weight or update figures, and its LR is the old optimizer's. Absent: instrumented as watched.
    instrumentation: Instrumentation | None = None
    # The joined step's rank with the largest loss and gradient norm, against the other ranks (the
    # worker's join sets it; a rank's own event has none): keyed by the metric, ``loss`` or ``grad_norm``.
    rank_extremes: dict[str, RankExtreme] | None = None
    # An exact digest of this rank's parameters' bits (producer/runwatch/producer/instrument/fingerprint.py),
    # every ``fingerprint_every`` steps on a data-parallel replica: replicas must agree (issue 38).
    param_digest: str | None = Field(default=None, pattern=r"^[0-9a-f]{8,64}$")
    # The joined step's replica digests, grouped (the worker's join sets it; a rank's own event has none)
    replicas: ReplicaDigests | None = None
    # Seconds of each off-step phase (eval, checkpoint, idle) since the previous step, which step_time_s
    # leaves out (issue 39: what goodput counts as checkpoint saves and evals). Absent: none, or not measured.
    off_step_s: Annotated[dict[Phase, WireFloat] | None, Within("max_duration_s")] = None
