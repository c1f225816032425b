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

    def add(self, name: str, values: torch.Tensor) -> None:
        """A 1-d tensor becomes the segment ``name``."""
        n = values.numel()
        self._segments[name] = slice(self._size, self._size + n)
        self._size += n
        self._pieces.append(values)

    def add_scalars(self, scalars: dict[str, torch.Tensor]) -> None:
        """Each 0-d tensor becomes a one-value segment of its name; stacked in one op, not one piece each."""
        import torch

        for name in scalars:
            self._segments[name] = slice(self._size, self._size + 1)
            self._size += 1
        # Stacking tensors of one dtype is faster than letting stack promote a mixed list.
        self._pieces.append(torch.stack([t if t.dtype == torch.float64 else t.double() for t in scalars.values()]))

    def pack(self, device: torch.device) -> torch.Tensor | None:
        """All segments as one float64 tensor on ``device`` (None when nothing was added)."""
        import torch

        if not self._pieces:
            return None
        with torch.no_grad():
            packed = torch.cat([p.to(device, torch.float64) for p in self._pieces])
        self._pieces = []  # the device tensors are not needed once packed
        return packed

    def unpack(self, values: Sequence[float]) -> dict[str, Sequence[float]]:
        """The host copy of :meth:`pack`'s tensor, split back into its named segments."""
        return {name: values[where] for name, where in self._segments.items()}
