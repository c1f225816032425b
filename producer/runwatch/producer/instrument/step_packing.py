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
        """All segments as one float64 tensor on ``device`` (None when nothing was added): one ``cat``,
        which promotes the pieces' dtypes."""
        import torch

        if not self._pieces:
            return None
        pieces = [p if p.device == device else p.to(device) for p in self._pieces]
        with torch.no_grad():
            packed = torch.cat(pieces)
        self._pieces = []  # the device tensors are not needed once packed
        return packed if packed.dtype == torch.float64 else packed.double()

    def unpack(self, values: Sequence[float]) -> dict[str, Sequence[float]]:
        """The host copy of :meth:`pack`'s tensor, split back into its named segments."""
        return {name: values[where] for name, where in self._segments.items()}
