"""Per-module activation statistics from forward hooks, on sampled steps only (issue 37).

Which modules: the model's leaf modules (no children: ``Linear``, ``Conv``, the activation modules
``ReLU``/``GELU``..., norms, embeddings), up to ``MAX_MODULES`` in registration order. A leaf is where a
layer's output is; the activation module after a ``Linear`` is where dead units show (its output exactly
0), the ``Linear`` itself where a growing output shows. An activation applied functionally
(``F.relu`` inside a ``forward``) has no module: its dead units are not seen.

What: per module, of its floating-point tensor output (a tuple's first tensor), the 2-norm and the
count of non-zero entries, as device tensors (two kernels per output), summed over the step's forward
calls in training mode (gradient accumulation's micro-batches; ``model.eval()`` forwards are left out).
The host divides by the element count it already knows (no host sync): ``rms`` and ``zero_frac``.

When: the hooks are registered only for a step whose number is a multiple of ``every`` (at the
previous ``end_step``) and removed before an unsampled one: the other steps run no hook at all (a hook
that returned at once would still cost a Python call per module and ``nn.Module.__call__``'s slower
hooked path on every step). The figures travel in the step's one device-to-host copy. A
``torch.compile``'d model recompiles when its hooks change: leave the probe off there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from runwatch.producer.instrument.gradstats import ROOT_MODULE

if TYPE_CHECKING:
    import torch

MAX_MODULES = 1000  # leaf modules hooked at most (the wire's module limit is far above)


class ActivationProbe:
    """Forward hooks on ``model``'s leaf modules, registered by :meth:`arm_for` before a sampled step's
    forward (and removed by it before an unsampled one); :meth:`take` after the step gives the figures
    and the element counts; :meth:`remove` at close."""

    def __init__(self, model: torch.nn.Module, every: int):
        self.every = every
        self.armed = False
        self.names: list[str] = []
        self._modules: list[torch.nn.Module] = []
        self._records: list[int] = []  # the module index of each output recorded this step
        self._norms: list[torch.Tensor] = []  # its 2-norm (float32 accumulation)
        self._nonzeros: list[torch.Tensor] = []  # its count of non-zero entries
        self._counts: dict[int, int] = {}  # module index -> elements seen
        self._handles: list[Any] = []
        for name, module in model.named_modules():
            if len(self.names) >= MAX_MODULES:
                break
            if next(module.children(), None) is not None:
                continue
            self.names.append(name or ROOT_MODULE)
            self._modules.append(module)

    def _hook(self, index: int) -> Any:
        def hook(module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            if module.training:
                self._record(index, output)

        return hook

    def _record(self, index: int, output: Any) -> None:
        """Two kernels per output (a norm, a count of non-zeros), kept as they are: the arithmetic on
        them is done once for every module at :meth:`take`."""
        import torch

        if isinstance(output, tuple | list):
            output = next((o for o in output if isinstance(o, torch.Tensor)), None)
        if not isinstance(output, torch.Tensor) or not output.is_floating_point() or output.numel() == 0:
            return
        with torch.no_grad():
            out = output.detach()
            self._records.append(index)
            self._norms.append(torch.linalg.vector_norm(out, dtype=torch.float32))
            self._nonzeros.append(torch.count_nonzero(out))
        self._counts[index] = self._counts.get(index, 0) + out.numel()

    def arm_for(self, step: int) -> None:
        """Hooks registered when ``step`` (the next step's number) is sampled, removed when it is not (kept
        across consecutive sampled steps: ``every=1`` registers them once)."""
        armed = self.every > 0 and step % self.every == 0
        if armed and not self._handles:
            self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self._modules)]
        elif not armed and self._handles:
            self.remove()
        self.armed = armed

    def take(self) -> tuple[torch.Tensor, list[tuple[str, int]]] | None:
        """The sampled step's figures as one flat device tensor, the sums of squares of the modules that
        produced an output then their non-zero counts, with those modules' (name, element count); None
        when nothing was recorded."""
        import torch

        if not self._records:
            return None
        records, norms, nonzeros = self._records, self._norms, self._nonzeros
        self._records, self._norms, self._nonzeros = [], [], []
        with torch.no_grad():
            squares = torch.stack(norms).square()
            counted = torch.stack(nonzeros).to(torch.float32)
            if len(set(records)) == len(records):  # one forward per module (no accumulation): as recorded
                order = records
            else:  # micro-batches: each module's records summed (a few ops per module, on such steps only)
                order = sorted(set(records))
                rows = {m: [i for i, r in enumerate(records) if r == m] for m in order}
                squares = torch.stack([squares[rows[m]].sum() for m in order])
                counted = torch.stack([counted[rows[m]].sum() for m in order])
            values = torch.cat([squares, counted])
        seen = [(self.names[i], self._counts[i]) for i in order]
        self._counts = {}
        return values, seen

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.armed = False


def activation_stats(values: Sequence[float], seen: list[tuple[str, int]]) -> dict[str, dict[str, float]]:
    """The host copy of :meth:`ActivationProbe.take`'s tensor as ``{module: {"rms", "zero_frac"}}``."""
    out: dict[str, dict[str, float]] = {}
    n = len(seen)
    for i, (name, count) in enumerate(seen):
        squares, nonzero = values[i], values[n + i]
        rms = math.sqrt(squares / count) if squares >= 0 else math.nan  # (NaN: a non-finite output)
        out[name] = {"rms": rms, "zero_frac": min(1.0, max(0.0, 1.0 - nonzero / count))}
    return out
