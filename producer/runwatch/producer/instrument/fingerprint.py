"""An exact fingerprint of a replica's parameters, every ``every`` steps (issue 38: replica divergence).

Data-parallel replicas hold bit-identical parameters: every rank applies the same averaged gradient to the
same weights. Silent data corruption (a flipped bit in one rank's memory or arithmetic) breaks that on one
rank only, and nothing else in the telemetry need show it for thousands of steps. Each rank therefore
sends a digest of its parameters' bits every ``every`` steps, and the worker compares the replicas'.

The digest is exact and cheap: each tensor's bits read as integers of its width and summed in int64 on
the device (integer addition is exact and does not depend on the order of the reduction, so equal
replicas give equal sums on any device), then two 64-bit combinations of the per-tensor sums (their sum,
and a sum weighted by position, so that two tensors cannot trade a difference). Any single changed bit
changes the first by exactly plus or minus a power of two, never 0 modulo 2 ** 64. The four 32-bit halves
travel in the step's one device-to-host copy (step_packing.py), as exact float64 values; the host turns
them into 32 hex digits. No host sync is added: the copy is the one the step already makes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DIGEST_VALUES = 4  # the packed halves: low and high 32 bits of each of the two combinations
_MASK = 0xFFFFFFFF
# an odd 63-bit multiplier for the positional weights (Knuth's golden ratio constant, halved)
_WEIGHT = 0x4F1BBCDCBFA53E0B


def _integer_view(dtype: torch.dtype) -> torch.dtype | None:
    import torch

    return {
        torch.float32: torch.int32,
        torch.float64: torch.int64,
        torch.float16: torch.int16,
        torch.bfloat16: torch.int16,
    }.get(dtype)


class ReplicaFingerprint:
    """``values(step)`` -> the digest's packed halves (a device tensor) on the steps it is due, else None."""

    def __init__(self, params: Sequence[torch.Tensor], every: int):
        if every < 0:
            raise ValueError(f"fingerprint_every must be >= 0 (0 turns it off), got {every!r}")
        self.every = every
        self._params = [p for p in params if _integer_view(p.dtype) is not None]
        self._weights: torch.Tensor | None = None

    @property
    def tensors(self) -> int:
        return len(self._params)

    def due(self, step: int) -> bool:
        return bool(self.every) and bool(self._params) and step % self.every == 0

    def values(self, step: int) -> torch.Tensor | None:
        if not self.due(step):
            return None
        import torch

        with torch.no_grad():
            sums = torch.stack([self._bits_sum(p) for p in self._params])
            if self._weights is None or self._weights.device != sums.device:
                positions = torch.arange(1, len(self._params) + 1, dtype=torch.int64, device=sums.device)
                self._weights = positions * _WEIGHT  # (wraps modulo 2 ** 64, as intended)
            first = sums.sum()
            second = (sums * self._weights).sum()
            both = torch.stack([first, second])
            halves = torch.stack([both & _MASK, (both >> 32) & _MASK], dim=1).reshape(-1)
        return halves

    @staticmethod
    def _bits_sum(p: torch.Tensor) -> torch.Tensor:
        import torch

        view = _integer_view(p.dtype)
        assert view is not None  # (only such tensors are kept)
        data = p.detach()
        if not data.is_contiguous():
            data = data.contiguous()
        return data.view(view).sum(dtype=torch.int64)

    @staticmethod
    def digest(halves: Sequence[float]) -> str:
        """The 32 hex digits of the packed halves (their host copy)."""
        low1, high1, low2, high2 = (int(v) & _MASK for v in halves)
        return f"{high1:08x}{low1:08x}{high2:08x}{low2:08x}"
