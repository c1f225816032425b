"""Per-module activation statistics from forward hooks, on sampled steps only (issue 37).

Which modules: the model's leaf modules (no children: ``Linear``, ``Conv``, the activation modules
``ReLU``/``GELU``..., norms, embeddings), up to ``MAX_MODULES`` in registration order. A leaf is where a
layer's output is; the activation module after a ``Linear`` is where dead units show (its output exactly
0), the ``Linear`` itself where a growing output shows. An activation applied functionally
(``F.relu`` inside a ``forward``) has no module: its dead units are not seen.

What: per module, of its floating-point tensor output (a tuple's first tensor), the sum of squares
and the count of exactly-zero entries, as device tensors, summed over the forward calls of the step
in training mode (gradient accumulation's micro-batches; ``model.eval()`` forwards are left out). The
host divides by the element count it already knows (no host sync): ``rms`` and ``zero_frac``.

When: the hooks are registered once and return at once unless armed; the watcher arms them for a
step whose number is a multiple of ``every``. The figures travel in the step's one device-to-host copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from runwatch.producer.instrument.gradstats import ROOT_MODULE

if TYPE_CHECKING:
    import torch

MAX_MODULES = 1000  # leaf modules hooked at most (the wire's module limit is far above)


class ActivationProbe:
    """Forward hooks on ``model``'s leaf modules; :meth:`arm` before a sampled step's forward,
    :meth:`take` after it (the figures and the element counts), :meth:`remove` at close."""

    def __init__(self, model: torch.nn.Module, every: int):
        self.every = every
        self.armed = False
        self.names: list[str] = []
        self._sums: dict[int, torch.Tensor] = {}  # module index -> [sum of squares, zero count]
        self._counts: dict[int, int] = {}  # module index -> elements seen
        self._handles: list[Any] = []
        for name, module in model.named_modules():
            if len(self.names) >= MAX_MODULES:
                break
            if next(module.children(), None) is not None:
                continue
            index = len(self.names)
            self.names.append(name or ROOT_MODULE)
            self._handles.append(module.register_forward_hook(self._hook(index)))

    def _hook(self, index: int) -> Any:
        def hook(module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            if not self.armed or not module.training:
                return
            self._record(index, output)

        return hook

    def _record(self, index: int, output: Any) -> None:
        import torch

        if isinstance(output, tuple | list):
            output = next((o for o in output if isinstance(o, torch.Tensor)), None)
        if not isinstance(output, torch.Tensor) or not output.is_floating_point() or output.numel() == 0:
            return
        with torch.no_grad():
            out = output.detach()
            figures = torch.stack(
                [
                    torch.linalg.vector_norm(out, dtype=torch.float32).square(),
                    (out.numel() - torch.count_nonzero(out)).to(torch.float32),
                ]
            )
        previous = self._sums.get(index)
        self._sums[index] = figures if previous is None else previous + figures
        self._counts[index] = self._counts.get(index, 0) + out.numel()

    def arm_for(self, step: int) -> None:
        """Arm the hooks when ``step`` (the next step's number) is sampled."""
        self.armed = self.every > 0 and step % self.every == 0

    def take(self) -> tuple[torch.Tensor, list[tuple[str, int]]] | None:
        """The armed step's figures, one flat device tensor ``[sumsq, zeros]`` per module that produced an
        output, with those modules' (name, element count); None when nothing was recorded. Disarms."""
        import torch

        self.armed = False
        if not self._sums:
            return None
        indices = sorted(self._sums)
        values = torch.cat([self._sums[i] for i in indices])
        seen = [(self.names[i], self._counts[i]) for i in indices]
        self._sums, self._counts = {}, {}
        return values, seen

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.armed = False


def activation_stats(values: Sequence[float], seen: list[tuple[str, int]]) -> dict[str, dict[str, float]]:
    """The host copy of :meth:`ActivationProbe.take`'s tensor as ``{module: {"rms", "zero_frac"}}``."""
    out: dict[str, dict[str, float]] = {}
    for i, (name, count) in enumerate(seen):
        sumsq, zeros = values[2 * i], values[2 * i + 1]
        out[name] = {
            "rms": (sumsq / count) ** 0.5 if sumsq >= 0 else float("nan"),
            "zero_frac": zeros / count,
        }
    return out
