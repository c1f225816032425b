"""``StepPacking``: one step's device figures as named segments of one tensor.

A step's figures (loss, gradient norms, per-module norms, parameter and update norms,
per-category loss sums) travel to the host in a single copy. Each figure is added under its
name; the same object then gives the host values back by name, so what lies where is written
down once, not as position arithmetic on both sides of the copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class StepPacking:
    """Named segments, in the order added; :meth:`pack` joins them, :meth:`unpack` splits the host copy."""

    __slots__ = ("_pieces", "_segments", "_size")

    def __init__(self) -> None:
        self._pieces: list[torch.Tensor] = []
        self._segments: dict[str, slice] = {}
        self._size = 0

    def add(self, name: str, values: torch.Tensor, size: int | None = None) -> None:
        """A 1-d tensor (of ``size`` values, when the caller knows it) becomes the segment ``name``."""
        n = values.numel() if size is None else size
        self._segments[name] = slice(self._size, self._size + n)
        self._size += n
        self._pieces.append(values)

    def pack(self, device: torch.device) -> torch.Tensor | None:
        """All segments as one float64 tensor on ``device`` (None when nothing was added): one ``cat``.
        Pieces of other dtypes are converted into the float64 result as they are copied (``out=``), each
        exactly: a ``cat`` of its own would promote to the widest piece's dtype first, and an int64 digest
        half next to float32 figures would be rounded to float32 on the way."""
        import torch

        if not self._pieces:
            return None
        pieces = [p if p.device == device else p.to(device) for p in self._pieces]
        self._pieces = []  # the device tensors are not needed once packed
        with torch.no_grad():
            if all(p.dtype == torch.float64 for p in pieces):
                return torch.cat(pieces)
            return torch.cat(pieces, out=torch.empty(self._size, dtype=torch.float64, device=device))

    def unpack(self, values: Sequence[float]) -> dict[str, Sequence[float]]:
        """The host copy of :meth:`pack`'s tensor, split back into its named segments."""
        return {name: values[where] for name, where in self._segments.items()}
