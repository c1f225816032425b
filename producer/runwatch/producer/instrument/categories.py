"""Per-category loss: the signal that shows one data category diverging while the mean looks fine.

Each category's mean is weighted within that category only (by sample weight, or by
length so a category of long sequences is a token-level mean), so categories of
different sizes are comparable with one another and with earlier steps. The sums stay
on the device until the step's single host copy.

The spread rides in the same copy: each category's weighted sum of squared per-sample losses (so the
join merges the variance exactly) and how many of its samples lie above the batch's 90th percentile of
per-sample loss (``TAIL_QUANTILE``; the batch's own quantile, unweighted, strictly above it). The tail
count shows a category whose mean barely moves while more of its samples land among the batch's worst:
a tenth of the batch is the tail by construction, so a category's share of it compares with its share
of the samples at any batch size or world size; the 90th rather than the 99th keeps a few samples in
the tail of a batch of 64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runwatch.contract.schema import CategoryLoss

if TYPE_CHECKING:
    import torch

TAIL_QUANTILE = 0.9  # the batch's per-sample loss quantile above which a sample is in the tail


@dataclass
class CategoryLossBatch:
    """Weighted loss sums, weight sums, sample counts, weighted sums of squares and tail counts per
    category (device tensors).

    Batches from micro-steps add up with ``+`` (each micro-batch's tail is above its own quantile);
    :meth:`resolve` turns them into the wire form.
    """

    names: list[str]
    loss_sum: torch.Tensor  # (K,) sum of weight * loss
    weight_sum: torch.Tensor  # (K,) sum of weights
    count: torch.Tensor  # (K,) samples
    square_sum: torch.Tensor | None = None  # (K,) sum of weight * loss**2
    tail: torch.Tensor | None = None  # (K,) samples above the batch's TAIL_QUANTILE of per-sample loss

    def __add__(self, other: CategoryLossBatch) -> CategoryLossBatch:
        names = self.names if other.names == self.names else list(dict.fromkeys(self.names + other.names))
        a, b = _reindex(self, names), _reindex(other, names)
        spread = a.square_sum is not None and b.square_sum is not None
        tails = a.tail is not None and b.tail is not None
        return CategoryLossBatch(
            names,
            a.loss_sum + b.loss_sum,
            a.weight_sum + b.weight_sum,
            a.count + b.count,
            a.square_sum + b.square_sum if spread else None,  # type: ignore[operator]
            a.tail + b.tail if tails else None,  # type: ignore[operator]
        )

    def packed(self) -> torch.Tensor:
        """The vectors as one float64 tensor, for the step's single device-to-host copy."""
        import torch

        parts = [self.loss_sum, self.weight_sum, self.count]
        if self.square_sum is not None and self.tail is not None:
            parts += [self.square_sum, self.tail]
        return torch.cat([v.double() for v in parts])

    def from_packed(self, values: Sequence[float]) -> dict[str, CategoryLoss]:
        k = len(self.names)
        spread = len(values) >= 5 * k
        return means_from_sums(
            self.names,
            values[:k],
            values[k : 2 * k],
            values[2 * k : 3 * k],
            values[3 * k : 4 * k] if spread else None,
            values[4 * k : 5 * k] if spread else None,
        )

    def resolve(self) -> dict[str, CategoryLoss]:
        """Host values now (one copy); use it outside a watched step."""
        return self.from_packed(self.packed().cpu().tolist())


def means_from_sums(
    names: Sequence[str],
    loss_sum: Sequence[float],
    weight_sum: Sequence[float],
    count: Sequence[float],
    square_sum: Sequence[float] | None = None,
    tail: Sequence[float] | None = None,
) -> dict[str, CategoryLoss]:
    """Categories with no sample in the batch are absent, not zero. With ``square_sum`` and ``tail``,
    each category's ``sumsq`` is its count times its weighted mean of squared losses (without weights,
    the plain sum of squares), so ``sumsq / count - mean**2`` is its weighted variance and the join's
    count-weighted merge keeps it; ``tail_count`` is its samples above the batch's quantile."""
    out: dict[str, CategoryLoss] = {}
    for i, (name, s, w, n) in enumerate(zip(names, loss_sum, weight_sum, count, strict=True)):
        if n <= 0:
            continue
        mean = s / w if w > 0 else float("nan")
        if square_sum is None or tail is None:
            out[name] = CategoryLoss(mean=mean, count=int(round(n)))
            continue
        sumsq = n * square_sum[i] / w if w > 0 else float("nan")
        out[name] = CategoryLoss(mean=mean, count=int(round(n)), sumsq=sumsq, tail_count=int(round(tail[i])))
    return out


def _reindex(batch: CategoryLossBatch, names: list[str]) -> CategoryLossBatch:
    import torch

    if batch.names == names:
        return batch
    where = torch.tensor(
        [names.index(n) for n in batch.names], dtype=torch.long, device=batch.loss_sum.device
    )

    def spread(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(names), dtype=v.dtype, device=v.device).index_add_(0, where, v)

    return CategoryLossBatch(
        names,
        spread(batch.loss_sum),
        spread(batch.weight_sum),
        spread(batch.count),
        None if batch.square_sum is None else spread(batch.square_sum),
        None if batch.tail is None else spread(batch.tail),
    )


def category_loss(
    losses: torch.Tensor,
    categories: torch.Tensor | Sequence[str] | Sequence[int],
    *,
    weights: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    names: Sequence[str] | None = None,
) -> CategoryLossBatch:
    """Per-category weighted mean loss of one batch.

    ``losses``: per-sample losses, shape (B,) (``reduction='none'``, averaged over tokens
    if per token). ``categories``: a label per sample: an integer tensor (named by
    ``names[i]``, or ``str(i)``) or a list of strings. ``weights`` or ``lengths`` (not both):
    per-sample weights; with lengths, each category's mean is its token-level mean.

    The spread is of the per-sample losses as given (a sequence's mean over its tokens, with lengths):
    the weighted sum of their squares, so with weights or lengths the variance on the wire is the
    weighted one around the weighted mean; the tail is counted per sample, unweighted, above the batch's
    ``TAIL_QUANTILE`` of the per-sample losses (unweighted too: the tail is of samples, not tokens).
    """
    import torch

    losses = losses.detach()
    if losses.dim() != 1:
        raise ValueError(f"losses must be per-sample, shape (B,), got {tuple(losses.shape)}")
    if weights is not None and lengths is not None:
        raise ValueError("give weights or lengths, not both")
    device = losses.device
    if isinstance(categories, torch.Tensor):
        index = categories.to(device=device, dtype=torch.long).reshape(-1)
        k = len(names) if names is not None else int(index.max().item()) + 1 if index.numel() else 0
        labels = list(names) if names is not None else [str(i) for i in range(k)]
    else:
        labels = list(names) if names is not None else []
        positions = {n: i for i, n in enumerate(labels)}
        idx = []
        for c in categories:
            c = str(c)
            if c not in positions:
                positions[c] = len(labels)
                labels.append(c)
            idx.append(positions[c])
        index = torch.tensor(idx, dtype=torch.long, device=device)
    if index.numel() != losses.numel():
        raise ValueError(f"{losses.numel()} losses but {index.numel()} category labels")
    w = weights if weights is not None else lengths
    w = torch.ones_like(losses) if w is None else w.detach().to(device=device, dtype=losses.dtype).reshape(-1)
    if w.numel() != losses.numel():
        raise ValueError(f"{losses.numel()} losses but {w.numel()} weights/lengths")
    k = len(labels)

    def by_category(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(k, dtype=torch.float64, device=device).index_add_(0, index, values.double())

    ones = torch.ones_like(losses)
    if losses.numel():
        cut = torch.quantile(losses.float(), TAIL_QUANTILE)
        in_tail = (losses.float() > cut).to(losses.dtype)
    else:
        in_tail = ones
    return CategoryLossBatch(
        labels,
        by_category(w * losses),
        by_category(w),
        by_category(ones),
        by_category(w.double() * losses.double() * losses.double()),
        by_category(in_tail),
    )


def per_category_metrics(
    per_category: dict[str, Any] | CategoryLossBatch | None,
) -> dict[str, dict[str, float]]:
    """An eval event's ``per_category`` (a ``category_loss`` batch, or by category a ``CategoryLoss``, a dict
    of metrics or a loss) as the wire's metrics by category (``Watcher.eval``)."""
    if per_category is None:
        return {}
    if isinstance(per_category, CategoryLossBatch):
        per_category = per_category.resolve()
    out: dict[str, dict[str, float]] = {}
    for name, value in per_category.items():
        if isinstance(value, CategoryLoss):
            out[name] = {"loss": value.mean, "count": float(value.count)}
        elif isinstance(value, dict):
            out[name] = {k: float(v) for k, v in value.items()}
        else:
            out[name] = {"loss": float(value)}
    return out
