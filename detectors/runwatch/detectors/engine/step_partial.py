"""A step's figures across ranks as a partial that merges (issue 36), and the joined step it makes.

``partial_of`` sums up the step events of some ranks (one rank group of a split run, or every rank of a
run that is not split); ``merge`` combines partials of disjoint rank sets into the partial of their union;
``joined_fields`` and ``joined_record`` turn a partial into the run's joined step event and its
``JoinedStep`` record. The combining rules are rank_join's (its module doc): the root of the sum of
squares of sharded norms, else the largest; the mean loss; summed throughput; extremes with their rank;
per-category losses weighted by count. A NaN on any rank makes the extremes NaN, as ``max`` alone would
not.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from typing import Any

from runwatch.contract.group_report import SLOWEST_LISTED, StepPartial
from runwatch.contract.schema import (
    DIGEST_GROUPS,
    DIGEST_RANKS_LISTED,
    RANKS_LISTED,
    ActivationStats,
    CategoryLoss,
    DigestGroup,
    JoinedStep,
    MemoryStats,
    RankExtreme,
    ReplicaDigests,
    StepEvent,
)
from runwatch.contract.schema import UpdateSkipped as SkipReason

NORMS = ("grad_norm", "grad_norm_clipped", "param_norm", "update_norm")
_NAN = math.nan


def _hi(a: float | None, b: float | None) -> float | None:
    """The larger, NaN if either is (``max`` would keep whichever came first)."""
    if a is None:
        return b
    if b is None:
        return a
    if a != a or b != b:  # NaN
        return _NAN
    return a if a >= b else b


def _lo(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    if a != a or b != b:
        return _NAN
    return a if a <= b else b


def _add(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _skip_reason(a: SkipReason | None, b: SkipReason) -> SkipReason:
    """A step whose update any rank's guard skipped is skipped (the non-finite reason first)."""
    return "nonfinite" if "nonfinite" in (a, b) else b


def _memory_figure(memory: MemoryStats | None) -> int | None:
    """Device memory where there is a device, else the host process's."""
    if memory is None:
        return None
    return memory.allocated if memory.allocated is not None else memory.host_rss


def partial_of(
    key: tuple[int, int], events: list[StepEvent], expected: int, missing: list[int]
) -> StepPartial:
    """The partial of one step (``key``: generation, step) from the step events of the ranks that reported it
    (``events``, in rank order), out of ``expected`` ranks; ``missing``: the ranks that did not (sorted)."""
    first = events[0]
    loss_sum = mfu_sum = None
    loss_n = mfu_n = 0
    loss_max: float | None = None
    loss_max_rank = grad_max_rank = None
    grad_max: float | None = None
    grad_n = 0
    digests: dict[str, list[Any]] = {}
    sharded = True
    norms: dict[str, list[float]] = {}
    modules: dict[str, list[float]] = {}
    categories: dict[str, list[float]] = {}
    spread: dict[str, list[float]] = {}  # [sum of sumsq, tail count] of the ranks that sent them
    unspread: set[str] = set()  # categories some rank sent without their spread
    activations: dict[str, list[float]] = {}
    clip = wait = st_max = st_min = c_max = c_min = samples = tokens = None
    st_rank = c_rank = None
    st_best: float | None = None
    c_best: float | None = None
    nonfinite: int | None = None
    skipped: SkipReason | None = None
    mem_max = mem_min = None
    mem_max_rank = mem_min_rank = None
    mem_max_stats: MemoryStats | None = None
    work: list[tuple[float, int]] = []
    ts = first.ts
    for e in events:
        rank = e.rank
        if e.ts > ts:
            ts = e.ts
        if e.loss is not None:
            loss_sum = e.loss if loss_sum is None else loss_sum + e.loss
            loss_n += 1
            if math.isfinite(e.loss) and (loss_max is None or e.loss > loss_max):
                loss_max, loss_max_rank = e.loss, rank
        if e.param_digest is not None:
            group = digests.setdefault(e.param_digest, [0, []])
            group[0] += 1
            if len(group[1]) < DIGEST_RANKS_LISTED:
                group[1].append(rank)
        if e.grad_norm is not None:
            grad_n += 1
            if math.isfinite(e.grad_norm) and (grad_max is None or e.grad_norm > grad_max):
                grad_max, grad_max_rank = e.grad_norm, rank
        if e.mfu is not None:
            mfu_sum = e.mfu if mfu_sum is None else mfu_sum + e.mfu
            mfu_n += 1
        if not e.grad_sharded:
            sharded = False
        for name in NORMS:
            value = getattr(e, name)
            if value is not None:
                acc = norms.get(name)
                if acc is None:
                    norms[name] = [value * value, value]
                else:
                    acc[0] += value * value
                    acc[1] = _hi(acc[1], value)  # type: ignore[assignment] # (both present: a float)
        for name, value in e.module_grad_norms.items():
            acc = modules.get(name)
            if acc is None:
                modules[name] = [value * value, value]
            else:
                acc[0] += value * value
                acc[1] = _hi(acc[1], value)  # type: ignore[assignment]
        for name, stats in e.module_activations.items():
            had = activations.get(name)
            if had is None:
                activations[name] = [stats.rms * stats.rms, 1, stats.zero_frac]
            else:
                had[0] += stats.rms * stats.rms
                had[1] += 1
                had[2] = _hi(had[2], stats.zero_frac)  # type: ignore[assignment]
        for name, category in e.category_loss.items():
            if category.count > 0:
                acc = categories.setdefault(name, [0.0, 0])
                acc[0] += category.mean * category.count
                acc[1] += category.count
                if category.sumsq is None or category.tail_count is None:
                    unspread.add(name)
                else:
                    sp = spread.setdefault(name, [0.0, 0])
                    sp[0] += category.sumsq
                    sp[1] += category.tail_count
        clip = _lo(clip, e.clip_ratio)
        wait = _hi(wait, e.data_wait_s)
        st = e.step_time_s
        if st is not None:
            if st_best is None or st > st_best:  # (the rank of the largest comparable figure)
                st_best, st_rank = st, rank
            st_max, st_min = _hi(st_max, st), _lo(st_min, st)
        c = e.compute_s
        if c is not None:
            if c_best is None or c > c_best:
                c_best, c_rank = c, rank
            c_max, c_min = _hi(c_max, c), _lo(c_min, c)
        mine = c if c is not None else st
        if mine is not None and mine == mine:
            work.append((mine, rank))
        samples = _add(samples, e.samples_per_s)
        tokens = _add(tokens, e.tokens_per_s)
        if e.nonfinite_grads is not None:
            nonfinite = e.nonfinite_grads + (nonfinite or 0)
        if e.update_skipped is not None:
            skipped = _skip_reason(skipped, e.update_skipped)
        figure = _memory_figure(e.memory)
        if figure is not None:
            if mem_max is None or figure > mem_max:
                mem_max, mem_max_rank, mem_max_stats = figure, rank, e.memory
            if mem_min is None or figure < mem_min:
                mem_min, mem_min_rank = figure, rank
    slowest = heapq.nlargest(SLOWEST_LISTED, work)
    return StepPartial.model_construct(
        generation=key[0],
        step=key[1],
        ts=ts,
        expected=expected,
        reported=len(events),
        missing_count=len(missing),
        missing_first=missing[:RANKS_LISTED],
        reported_first=[e.rank for e in events[:RANKS_LISTED]],
        first_rank=first.rank,
        lr=first.lr,
        loss_sum=loss_sum,
        loss_count=loss_n,
        loss_max=loss_max,
        loss_max_rank=loss_max_rank,
        grad_norm_max_rank=grad_max_rank,
        grad_norm_count=grad_n,
        **_bounded_digests({d: (g[0], g[1]) for d, g in digests.items()}, 0),
        mfu_sum=mfu_sum,
        mfu_count=mfu_n,
        sharded=sharded,
        norms={name: (acc[0], acc[1]) for name, acc in norms.items()},
        modules={name: (acc[0], acc[1]) for name, acc in modules.items()},
        categories={name: (acc[0], int(acc[1])) for name, acc in categories.items()},
        category_spread={name: (acc[0], int(acc[1])) for name, acc in spread.items() if name not in unspread},
        activations={name: (acc[0], int(acc[1]), acc[2]) for name, acc in activations.items()},
        clip_ratio_min=clip,
        data_wait_max=wait,
        step_time_max=st_max,
        step_time_max_rank=st_rank,
        step_time_min=st_min,
        compute_max=c_max,
        compute_max_rank=c_rank,
        compute_min=c_min,
        samples_sum=samples,
        tokens_sum=tokens,
        nonfinite_sum=nonfinite,
        update_skipped=skipped,
        memory_max_bytes=mem_max,
        memory_max_rank=mem_max_rank,
        memory_max=mem_max_stats,
        memory_min_bytes=mem_min,
        memory_min_rank=mem_min_rank,
        slowest=[(rank, value) for value, rank in slowest],
    )


def merge(partials: list[StepPartial], expected: int, missing_groups: Iterable[range] = ()) -> StepPartial:
    """The partial of the union of ``partials`` (disjoint ranks, one step), out of ``expected`` ranks in all;
    ``missing_groups``: the rank ranges of groups that sent no partial (every one of their ranks missing)."""
    parts = sorted(partials, key=lambda p: p.first_rank)
    first = parts[0]
    out: dict[str, Any] = {"generation": first.generation, "step": first.step, "expected": expected}
    out["ts"] = max(p.ts for p in parts)
    out["reported"] = sum(p.reported for p in parts)
    out["first_rank"], out["lr"] = first.first_rank, first.lr
    absent = sorted(missing_groups, key=lambda r: r.start)
    out["missing_count"] = sum(p.missing_count for p in parts) + sum(len(r) for r in absent)
    missing: list[int] = []
    for p in parts:
        missing.extend(p.missing_first)
    for r in absent:
        missing.extend(r[:RANKS_LISTED])
    out["missing_first"] = sorted(missing)[:RANKS_LISTED]
    reported: list[int] = []
    for p in parts:
        if len(reported) >= RANKS_LISTED:
            break
        reported.extend(p.reported_first)
    out["reported_first"] = reported[:RANKS_LISTED]
    for total, count in (("loss_sum", "loss_count"), ("mfu_sum", "mfu_count")):
        out[total] = _fold(_add, (getattr(p, total) for p in parts))
        out[count] = sum(getattr(p, count) for p in parts)
    out["grad_norm_count"] = sum(p.grad_norm_count for p in parts)
    out.update(_merged_digests(parts))
    finite = [p for p in parts if p.loss_max is not None]
    highest = max(finite, key=lambda p: p.loss_max or 0.0) if finite else None
    out["loss_max"] = highest.loss_max if highest else None
    out["loss_max_rank"] = highest.loss_max_rank if highest else None
    out["sharded"] = all(p.sharded for p in parts)
    for name in ("norms", "modules"):
        merged: dict[str, tuple[float, float]] = {}
        for p in parts:
            for key, (squares, largest) in getattr(p, name).items():
                had = merged.get(key)
                merged[key] = (squares, largest) if had is None else (had[0] + squares, _hi(had[1], largest))  # type: ignore[assignment]
        out[name] = merged
    graded = [p for p in parts if p.grad_norm_max_rank is not None]
    top_grad = max(graded, key=lambda p: p.norms["grad_norm"][1]) if graded else None
    out["grad_norm_max_rank"] = top_grad.grad_norm_max_rank if top_grad else None
    categories: dict[str, tuple[float, int]] = {}
    for p in parts:
        for category, (losses, n) in p.categories.items():
            had_c = categories.get(category, (0.0, 0))
            categories[category] = (had_c[0] + losses, had_c[1] + n)
    out["categories"] = categories
    # a category's spread is known when every part that saw the category knew it
    spreads: dict[str, tuple[float, int]] = {}
    unspread: set[str] = set()
    for p in parts:
        for category in p.categories:
            if category not in p.category_spread:
                unspread.add(category)
        for category, (squares, tail) in p.category_spread.items():
            had_s = spreads.get(category, (0.0, 0))
            spreads[category] = (had_s[0] + squares, had_s[1] + tail)
    out["category_spread"] = {c: v for c, v in spreads.items() if c not in unspread}
    activations: dict[str, tuple[float, int, float]] = {}
    for p in parts:
        for module, (squares, ranks, zeros) in p.activations.items():
            had_a = activations.get(module)
            if had_a is not None:
                squares, ranks = had_a[0] + squares, had_a[1] + ranks
                zeros = _hi(had_a[2], zeros)  # type: ignore[assignment] # (both present: a float)
            activations[module] = (squares, ranks, zeros)
    out["activations"] = activations
    out["clip_ratio_min"] = _fold(_lo, (p.clip_ratio_min for p in parts))
    out["data_wait_max"] = _fold(_hi, (p.data_wait_max for p in parts))
    for figure in ("step_time", "compute"):
        top = _extreme(parts, f"{figure}_max", f"{figure}_max_rank")
        out[f"{figure}_max"], out[f"{figure}_max_rank"] = top
        out[f"{figure}_min"] = _fold(_lo, (getattr(p, f"{figure}_min") for p in parts))
    out["samples_sum"] = _fold(_add, (p.samples_sum for p in parts))
    out["tokens_sum"] = _fold(_add, (p.tokens_sum for p in parts))
    nonfinite = [p.nonfinite_sum for p in parts if p.nonfinite_sum is not None]
    out["nonfinite_sum"] = sum(nonfinite) if nonfinite else None
    skipped: SkipReason | None = None
    for p in parts:
        if p.update_skipped is not None:
            skipped = _skip_reason(skipped, p.update_skipped)
    out["update_skipped"] = skipped
    most = [p for p in parts if p.memory_max_bytes is not None]
    best = max(most, key=lambda p: p.memory_max_bytes or 0) if most else None
    out["memory_max_bytes"] = best.memory_max_bytes if best else None
    out["memory_max_rank"] = best.memory_max_rank if best else None
    out["memory_max"] = best.memory_max if best else None
    least = [p for p in parts if p.memory_min_bytes is not None]
    low = min(least, key=lambda p: p.memory_min_bytes or 0) if least else None
    out["memory_min_bytes"] = low.memory_min_bytes if low else None
    out["memory_min_rank"] = low.memory_min_rank if low else None
    slow = [(value, rank) for p in parts for rank, value in p.slowest]
    out["slowest"] = [(rank, value) for value, rank in heapq.nlargest(SLOWEST_LISTED, slow)]
    return StepPartial.model_construct(**out)


def _merged_digests(parts: list[StepPartial]) -> dict[str, Any]:
    """The union of the partials' digest groups, bounded as one partial's."""
    groups: dict[str, tuple[int, list[int]]] = {}
    for p in parts:
        for digest, (count, named) in p.digests.items():
            had = groups.get(digest)
            groups[digest] = (count, named) if had is None else (had[0] + count, sorted(had[1] + named))
    return _bounded_digests(groups, sum(p.digests_other for p in parts))


def _bounded_digests(groups: dict[str, tuple[int, list[int]]], other: int) -> dict[str, Any]:
    """The partial's ``digests`` (the DIGEST_GROUPS largest groups, each naming its lowest ranks) and
    ``digests_other`` (the ranks of the groups left out, plus ``other``)."""
    ordered = sorted(groups.items(), key=lambda item: (-item[1][0], item[0]))
    kept = {d: (count, named[:DIGEST_RANKS_LISTED]) for d, (count, named) in ordered[:DIGEST_GROUPS]}
    return {"digests": kept, "digests_other": other + sum(count for _, (count, _) in ordered[DIGEST_GROUPS:])}


def _fold(combine: Any, values: Iterable[float | None]) -> float | None:
    result = None
    for value in values:
        result = combine(result, value)
    return result


def _extreme(parts: list[StepPartial], value_name: str, rank_name: str) -> tuple[float | None, int | None]:
    """The largest of the partials' extremes (NaN if any is) and the rank of the largest finite one."""
    value: float | None = None
    rank: int | None = None
    best: float | None = None
    for p in parts:
        v = getattr(p, value_name)
        value = _hi(value, v)
        if v is not None and v == v and (best is None or v > best):  # (v == v: not NaN)
            best, rank = v, getattr(p, rank_name)
    return value, rank


def joined_fields(run_id: str, partial: StepPartial) -> dict[str, Any]:
    """The joined step event's fields (a ``StepEvent`` the run-level detectors read) from the run's
    partial of the step."""
    sharded = partial.sharded

    def norm(squares_largest: tuple[float, float] | None) -> float | None:
        if squares_largest is None:
            return None
        return math.sqrt(squares_largest[0]) if sharded else squares_largest[1]

    norms = partial.norms
    fields: dict[str, Any] = {
        "run_id": run_id,
        "rank": partial.first_rank,
        "step": partial.step,
        "ts": partial.ts,
        "event_id": f"joined|{partial.generation}|{partial.step}",
        "lr": partial.lr,
        "loss": partial.loss_sum / partial.loss_count
        if partial.loss_count and partial.loss_sum is not None
        else None,
        "grad_norm": norm(norms.get("grad_norm")),
        "grad_norm_clipped": norm(norms.get("grad_norm_clipped")),
        "clip_ratio": partial.clip_ratio_min,
        "param_norm": norm(norms.get("param_norm")),
        "update_norm": norm(norms.get("update_norm")),
        "module_grad_norms": {name: norm(value) for name, value in partial.modules.items()},
        "module_activations": {
            name: ActivationStats.model_construct(rms=math.sqrt(squares / ranks), zero_frac=zeros)
            for name, (squares, ranks, zeros) in partial.activations.items()
            if ranks > 0
        },
        "category_loss": {
            name: _joined_category(total, count, partial.category_spread.get(name))
            for name, (total, count) in partial.categories.items()
            if count > 0
        },
        "step_time_s": partial.step_time_max,
        "data_wait_s": partial.data_wait_max,
        "samples_per_s": partial.samples_sum,
        "tokens_per_s": partial.tokens_sum,
        "mfu": partial.mfu_sum / partial.mfu_count
        if partial.mfu_count and partial.mfu_sum is not None
        else None,
        "nonfinite_grads": partial.nonfinite_sum,
        "grad_sharded": sharded or None,
        "update_skipped": partial.update_skipped,
    }
    if fields["param_norm"] and fields["update_norm"] is not None:
        fields["relative_update_norm"] = fields["update_norm"] / fields["param_norm"]
    clipped = fields["grad_norm_clipped"] if fields["grad_norm_clipped"] is not None else fields["grad_norm"]
    if fields["update_norm"] is not None and clipped and math.isfinite(clipped):
        fields["effective_lr_ratio"] = fields["update_norm"] / clipped
    if partial.memory_max is not None:
        fields["memory"] = partial.memory_max
    extremes = rank_extremes(partial)
    if extremes:
        fields["rank_extremes"] = extremes
    if partial.digests:
        fields["replicas"] = ReplicaDigests.model_construct(
            groups=[
                DigestGroup.model_construct(digest=d, count=count, ranks=named)
                for d, (count, named) in partial.digests.items()
            ],
            other=partial.digests_other,
        )
    return fields


def rank_extremes(partial: StepPartial) -> dict[str, RankExtreme]:
    """The rank with the largest loss and the one with the largest gradient norm, each with the other
    ranks' figure (the mean of their losses; the root mean square of their replicated gradient norms),
    where at least two ranks sent finite ones. None for sharded norms: a shard's norm is not the rank's."""
    out: dict[str, RankExtreme] = {}
    n, total, top = partial.loss_count, partial.loss_sum, partial.loss_max
    if n >= 2 and total is not None and top is not None and partial.loss_max_rank is not None:
        others = (total - top) / (n - 1)
        if math.isfinite(others):
            out["loss"] = RankExtreme.model_construct(
                rank=partial.loss_max_rank, value=top, others=others, ranks=n
            )
    norm = partial.norms.get("grad_norm")
    n, rank = partial.grad_norm_count, partial.grad_norm_max_rank
    if not partial.sharded and norm is not None and rank is not None and n >= 2 and math.isfinite(norm[0]):
        rest = max(0.0, norm[0] - norm[1] * norm[1]) / (n - 1)
        out["grad_norm"] = RankExtreme.model_construct(
            rank=rank, value=norm[1], others=math.sqrt(rest), ranks=n
        )
    return out


def joined_record(
    run_id: str, partial: StepPartial, world_size: int, fields: dict[str, Any], late: int, duplicates: int
) -> JoinedStep:
    """The ``JoinedStep`` record of the run's partial of a step (``fields``: ``joined_fields``'s)."""
    return JoinedStep.model_construct(
        run_id=run_id,
        step=partial.step,
        generation=partial.generation,
        ts=fields["ts"],
        world_size=world_size,
        complete=partial.missing_count == 0,
        ranks_reported=list(partial.reported_first) if world_size <= RANKS_LISTED else [],
        ranks_missing=list(partial.missing_first),
        reported_count=partial.reported,
        missing_count=partial.missing_count,
        loss_mean=fields["loss"],
        grad_norm=fields["grad_norm"],
        grad_sharded=bool(fields["grad_sharded"]),
        step_time_max_s=partial.step_time_max,
        step_time_max_rank=partial.step_time_max_rank,
        step_time_min_s=partial.step_time_min,
        compute_max_s=partial.compute_max,
        compute_max_rank=partial.compute_max_rank,
        compute_min_s=partial.compute_min,
        memory_max_bytes=partial.memory_max_bytes,
        memory_max_rank=partial.memory_max_rank,
        memory_min_bytes=partial.memory_min_bytes,
        memory_min_rank=partial.memory_min_rank,
        samples_per_s=partial.samples_sum,
        tokens_per_s=partial.tokens_sum,
        late_events=late,
        duplicate_events=duplicates,
    )


def _joined_category(total: float, count: int, spread: tuple[float, int] | None) -> CategoryLoss:
    if spread is None:
        return CategoryLoss.model_construct(mean=total / count, count=int(count))
    return CategoryLoss.model_construct(
        mean=total / count, count=int(count), sumsq=spread[0], tail_count=int(spread[1])
    )
