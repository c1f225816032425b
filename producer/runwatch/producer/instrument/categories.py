"""Per-category loss: the signal that shows one data category diverging while the mean looks fine.

Each category's mean is weighted within that category only (by sample weight, or by
length so a category of long sequences is a token-level mean), so categories of
different sizes are comparable with one another and with earlier steps. The sums stay
on the device until the step's single host copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runwatch.producer.wire.schema import CategoryLoss

if TYPE_CHECKING:
    import torch


@dataclass
class CategoryLossBatch:
    """Weighted loss sums, weight sums and sample counts per category (device tensors).

    Batches from micro-steps add up with ``+``; :meth:`resolve` turns them into the wire form.
    """

    names: list[str]
    loss_sum: torch.Tensor  # (K,) sum of weight * loss
    weight_sum: torch.Tensor  # (K,) sum of weights
    count: torch.Tensor  # (K,) samples

    def __add__(self, other: CategoryLossBatch) -> CategoryLossBatch:
        names = self.names if other.names == self.names else list(dict.fromkeys(self.names + other.names))
        a, b = _reindex(self, names), _reindex(other, names)
        return CategoryLossBatch(
            names, a.loss_sum + b.loss_sum, a.weight_sum + b.weight_sum, a.count + b.count
        )

    def packed(self) -> torch.Tensor:
        """The three vectors as one float64 tensor, for the step's single device-to-host copy."""
        import torch

        return torch.cat([self.loss_sum.double(), self.weight_sum.double(), self.count.double()])

    def from_packed(self, values: Sequence[float]) -> dict[str, CategoryLoss]:
        k = len(self.names)
        return means_from_sums(self.names, values[:k], values[k : 2 * k], values[2 * k : 3 * k])

    def resolve(self) -> dict[str, CategoryLoss]:
        """Host values now (one copy); use it outside a watched step."""
        return self.from_packed(self.packed().cpu().tolist())


def means_from_sums(
    names: Sequence[str], loss_sum: Sequence[float], weight_sum: Sequence[float], count: Sequence[float]
) -> dict[str, CategoryLoss]:
    """Categories with no sample in the batch are absent, not zero."""
    out: dict[str, CategoryLoss] = {}
    for name, s, w, n in zip(names, loss_sum, weight_sum, count, strict=True):
        if n <= 0:
            continue
        mean = s / w if w > 0 else float("nan")
        out[name] = CategoryLoss(mean=mean, count=int(round(n)))
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

    return CategoryLossBatch(names, spread(batch.loss_sum), spread(batch.weight_sum), spread(batch.count))


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

    return CategoryLossBatch(
        labels, by_category(w * losses), by_category(w), by_category(torch.ones_like(losses))
    )
