"""What a group report carries (``GroupReport.body``, issue 36): one rank group's joined steps as
partials, its findings for the run's policy, and its ranks' run-level events, in the group's order.

A ``StepPartial`` is what one group saw of one step, in figures that merge without the ranks: counts,
sums, sums of squares, extremes with their rank, the slowest few ranks, the first few missing ranks. Its
size does not grow with the group. Merging partials (detectors/runwatch/detectors/engine/step_partial.py)
gives the partial of their union, so the run's joined step is the same whichever worker joined which
group.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from runwatch.contract.schema import MemoryStats, UpdateSkipped, WireFloat, WireModel, WireTime

SLOWEST_LISTED = 4  # the slowest ranks a partial names, with their work time


class StepPartial(WireModel):
    generation: int = Field(default=0, ge=0)
    step: int = Field(ge=0)
    ts: WireTime
    expected: int = Field(
        ge=0, description="ranks expected to report (the group's, or the run's once merged)"
    )
    reported: int = Field(ge=0)
    missing_count: int = Field(ge=0)
    missing_first: list[int] = Field(default_factory=list)  # the lowest missing ranks, RANKS_LISTED at most
    reported_first: list[int] = Field(
        default_factory=list
    )  # the lowest reporting ranks, RANKS_LISTED at most
    first_rank: int = Field(ge=0)  # the lowest reporting rank (its lr is the step's)
    lr: list[WireFloat] = Field(default_factory=list)
    loss_sum: WireFloat | None = None
    loss_count: int = 0
    # The largest finite loss and its rank; the largest finite grad_norm's rank and how many ranks sent a
    # grad_norm (issue 38: one rank's spike is judged against the others, not averaged away)
    loss_max: WireFloat | None = None
    loss_max_rank: int | None = None
    grad_norm_max_rank: int | None = None
    grad_norm_count: int = 0
    # the ranks' param_digest by value: digest -> [ranks, the lowest DIGEST_RANKS_LISTED], at most
    # DIGEST_GROUPS digests (the largest groups); ranks of the rest counted in digests_other
    digests: dict[str, tuple[int, list[int]]] = Field(default_factory=dict)
    digests_other: int = 0
    mfu_sum: WireFloat | None = None
    mfu_count: int = 0
    sharded: bool = False  # every reporting rank's norms are of its shard
    # per norm (grad_norm, grad_norm_clipped, param_norm, update_norm): [sum of squares, largest]
    norms: dict[str, tuple[WireFloat, WireFloat]] = Field(default_factory=dict)
    modules: dict[str, tuple[WireFloat, WireFloat]] = Field(default_factory=dict)  # the same per module
    categories: dict[str, tuple[WireFloat, int]] = Field(default_factory=dict)  # [sum of losses, count]
    # per category whose every reporting rank sent its spread (CategoryLoss.sumsq, tail_count; issue 37):
    # [sum of sumsq, sum of tail counts]; absent for a category any rank sent without it
    category_spread: dict[str, tuple[WireFloat, int]] = Field(default_factory=dict)
    # per module of module_activations: [sum of rms squared, ranks, largest zero_frac]; joined as the
    # root mean square of the ranks' rms and the largest zero fraction
    activations: dict[str, tuple[WireFloat, int, WireFloat]] = Field(default_factory=dict)
    clip_ratio_min: WireFloat | None = None
    data_wait_max: WireFloat | None = None
    step_time_max: WireFloat | None = None
    step_time_max_rank: int | None = None
    step_time_min: WireFloat | None = None
    compute_max: WireFloat | None = None
    compute_max_rank: int | None = None
    compute_min: WireFloat | None = None
    samples_sum: WireFloat | None = None
    tokens_sum: WireFloat | None = None
    nonfinite_sum: int | None = None
    update_skipped: UpdateSkipped | None = None  # any rank's guard skipped the update
    memory_max_bytes: int | None = None
    memory_max_rank: int | None = None
    memory_max: MemoryStats | None = None  # the memory figures of the rank using the most
    memory_min_bytes: int | None = None
    memory_min_rank: int | None = None
    slowest: list[tuple[int, WireFloat]] = Field(default_factory=list)  # (rank, work s), slowest first


class ReportItem(WireModel):
    """One item of a group report: exactly one of a step's ``partial``, a ``finding`` (a detector's finding
    with its event time ``finding_ts`` and ``cause``, for the run's policy) or a run-level ``event`` of one of
    the group's ranks (run_start, eval, checkpoint, action_ack, run_end) as the worker decoded it."""

    partial: StepPartial | None = None
    finding: dict[str, Any] | None = None
    finding_ts: WireTime | None = None
    cause: str | None = None
    event: dict[str, Any] | None = None


class ReportBody(WireModel):
    group_size: int = Field(ge=1)
    world_size: int = Field(ge=1)
    late: int = Field(default=0, ge=0)  # the group's events that came after their step was joined
    duplicates: int = Field(default=0, ge=0)
    items: list[ReportItem] = Field(default_factory=list)
