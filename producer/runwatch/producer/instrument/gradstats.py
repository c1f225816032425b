"""Gradient, parameter and update norms computed on the device with fused ops.

Everything here stays a device tensor: the caller packs the results into one small
tensor and copies it to the host once per step. No per-parameter ``.item()``, no host
snapshot of the weights. Norms are 2-norms; the per-module norm of a module is the
norm of the concatenation of the gradients of the parameters it owns directly
(``recurse=False``), so module norms combine into the global norm by sum of squares.

Sharded models (ZeRO/FSDP style, each rank owning a subset of the parameters): a
``ParamLayout`` built with ``shard=`` holds only this rank's parameters, so every norm here
covers that shard, and the shards' norms combine into the model's by sum of squares too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch

ROOT_MODULE = "(root)"  # name for parameters owned by the model object itself
CLIP_EPS = 1e-6  # the same epsilon torch.nn.utils.clip_grad_norm_ adds to the norm


def _by_device_dtype(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), in order of first appearance: a fused kernel
    takes one of each. Computed once per layout (gradients share their parameter's device and dtype)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


def _acc_dtype(dtype: torch.dtype) -> torch.dtype | None:
    import torch

    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else None


@dataclass
class GradNorms:
    """One step's gradient figures, all device tensors.

    ``figures``: per-module norms before clipping, then the global norm (shape ``(n_modules + 1,)``,
    float64); ``clip_coef``: the factor the gradients were (or would be) multiplied by, <= 1, shape
    ``(1,)``; ``nonfinite``: how many parameter tensors have a gradient holding a NaN or Inf, shape ``(1,)``.
    """

    figures: torch.Tensor
    clip_coef: torch.Tensor
    nonfinite: torch.Tensor

    @property
    def total(self) -> torch.Tensor:
        return self.figures[-1]

    @property
    def modules(self) -> torch.Tensor:
        return self.figures[:-1]


@dataclass
class HostGradNorms:
    """One step's gradient figures as host numbers, for a layout whose tensors are in host memory (reading
    them costs no device sync): what :class:`GradNorms` holds, already read, so the step event needs no copy.

    ``figures``: per-module norms before clipping, then the global norm; ``clip_coef``: the factor the
    gradients were (or would be) multiplied by, <= 1; ``nonfinite``: how many parameter tensors have a
    gradient holding a NaN or Inf.
    """

    figures: list[float]
    clip_coef: float
    nonfinite: int

    @property
    def total(self) -> float:
        return self.figures[-1]


@dataclass
class UpdateNorms:
    norms: torch.Tensor  # (norm of the trainable parameters before the step, norm of the step's change)

    @property
    def param(self) -> torch.Tensor:
        return self.norms[0]

    @property
    def update(self) -> torch.Tensor:
        return self.norms[1]


ShardSpec = Iterable[str] | Callable[[str, Any], bool]

# Module sums by one matrix-vector product while the 0/1 matrix stays small; past this many entries
# (float64) by index_add_.
_MAX_SUM_MATRIX = 1 << 22


class ParamLayout:
    """Trainable parameters in a fixed order, each tagged with the module that owns it.

    ``shard``: the parameters this rank owns, as parameter names (``model.named_parameters()``
    names; a tied parameter may be named by any of its names) or a callable ``(name, param) ->
    bool``. Only those are kept; a module that owns none of them has no entry. ``n_params`` still
    counts every trainable parameter of the model (each rank computes with the whole model).

    What a step needs is resolved here, once: the parameters grouped by device and dtype (one fused
    kernel per group), and the matrix that sums squared per-tensor norms into per-module and global
    sums in one product, so a step runs no Python loop over parameters or modules.
    """

    def __init__(self, model: torch.nn.Module, shard: ShardSpec | None = None):
        import torch

        select = _shard_selector(model, shard) if shard is not None else None
        self.sharded = select is not None
        self.module_names: list[str] = []
        self.params: list[torch.Tensor] = []
        owners: list[int] = []
        seen: set[int] = set()
        n_params = 0
        for name, module in model.named_modules():
            own = [
                (f"{name}.{pname}" if name else pname, p)
                for pname, p in module.named_parameters(recurse=False)
                if p.requires_grad and id(p) not in seen
            ]
            seen.update(id(p) for _, p in own)  # a shared (tied) parameter counts once, for its first owner
            n_params += sum(p.numel() for _, p in own)
            if select is not None:
                own = [(pname, p) for pname, p in own if select(pname, p)]
            if not own:
                continue
            self.module_names.append(name or ROOT_MODULE)
            owners.extend([len(self.module_names) - 1] * len(own))
            self.params.extend(p for _, p in own)
        if not self.params:
            if select is not None and n_params:
                raise ValueError(
                    "shard selects none of the model's trainable parameters: pass the names "
                    "(as model.named_parameters() gives them) or a predicate of the parameters "
                    "this rank owns"
                )
            raise ValueError("the model has no trainable parameters to watch")
        self.device = self.params[0].device
        self.owners = owners
        self.owner_index = torch.tensor(owners, dtype=torch.long, device=self.device)
        self.n_params = n_params
        self.groups = _by_device_dtype(self.params)
        # Every tensor in host memory: the step's figures are read at once (host_grad_norms), no copy needed
        self.on_host = all(self.params[idx[0]].device.type == "cpu" for idx in self.groups)
        self._sum_matrix = _sum_matrix(owners, len(self.module_names), self.device)

    def grads(self) -> tuple[list[torch.Tensor], list[int] | None]:
        """Gradients that exist this step, and which parameters they belong to (None: all of them)."""
        grads = [p.grad for p in self.params]
        if all(g is not None for g in grads):  # (`None in grads` would compare tensors with ==)
            return cast("list[torch.Tensor]", grads), None  # the common case: no per-step index building
        present = [i for i, g in enumerate(grads) if g is not None]
        return cast("list[torch.Tensor]", [grads[i] for i in present]), present

    def per_tensor_norms(self, tensors: list[torch.Tensor], which: list[int] | None = None) -> torch.Tensor:
        """2-norms of ``tensors`` (one per parameter, or those listed in ``which``) as one vector on the
        layout's device, in order; low-precision tensors are reduced in float32."""
        import torch

        groups = self.groups if which is None else _by_device_dtype(tensors)
        if len(groups) == 1:
            return torch.stack(torch._foreach_norm(tensors, 2, dtype=_acc_dtype(tensors[0].dtype)))
        pieces = []
        for idx in groups:
            part = [tensors[i] for i in idx]
            norms = torch._foreach_norm(part, 2, dtype=_acc_dtype(part[0].dtype))
            pieces.append(torch.stack(norms).to(self.device, torch.float64))
        order = torch.tensor([i for idx in groups for i in idx], dtype=torch.long, device=self.device)
        out = torch.empty(len(tensors), dtype=torch.float64, device=self.device)
        return out.index_copy_(0, order, torch.cat(pieces))

    def module_sums(self, squares: torch.Tensor, which: list[int] | None) -> torch.Tensor:
        """Per-module sums of ``squares`` (float64, one per tensor of ``which``), then their total."""
        import torch

        if which is None and self._sum_matrix is not None:
            return torch.mv(self._sum_matrix, squares)
        index = self.owner_index if which is None else self.owner_index[torch_tensor(which, self.device)]
        sums = torch.zeros(len(self.module_names) + 1, dtype=torch.float64, device=self.device)
        sums.index_add_(0, index, squares)
        sums[-1] = squares.sum()
        return sums

    def scale_(self, tensors: list[torch.Tensor], coef: torch.Tensor, which: list[int] | None) -> None:
        """Multiply ``tensors`` in place by the 1-element ``coef``, one fused kernel per device/dtype (as
        torch's ``clip_grad_norm_`` does)."""
        import torch

        for idx in self.groups if which is None else _by_device_dtype(tensors):
            part = [tensors[i] for i in idx] if len(idx) != len(tensors) else tensors
            torch._foreach_mul_(part, coef.to(part[0].device, part[0].dtype).view(()))

    def scale_host_(self, tensors: list[torch.Tensor], coef: float, which: list[int] | None) -> None:
        """:meth:`scale_` by a host number: float32 and float64 tensors take it as a scalar (the kernel
        rounds it to their dtype, as ``scale_``'s cast does); lower precisions a tensor of their dtype, as
        ``scale_`` gives them."""
        import torch

        for idx in self.groups if which is None else _by_device_dtype(tensors):
            part = [tensors[i] for i in idx] if len(idx) != len(tensors) else tensors
            dtype = part[0].dtype
            if dtype in (torch.float32, torch.float64):
                torch._foreach_mul_(part, coef)
            else:
                factor = torch.tensor(coef, dtype=torch.float64).to(part[0].device, dtype)
                torch._foreach_mul_(part, factor)


def _sum_matrix(owners: list[int], n_modules: int, device: torch.device) -> torch.Tensor | None:
    """``(n_modules + 1, n_tensors)`` float64: row m sums module m's tensors, the last row all of them."""
    import torch

    n = len(owners)
    if n * (n_modules + 1) > _MAX_SUM_MATRIX:
        return None
    matrix = torch.zeros(n_modules + 1, n, dtype=torch.float64)
    matrix[torch.tensor(owners, dtype=torch.long), torch.arange(n)] = 1.0
    matrix[-1] = 1.0
    return matrix.to(device)


def _shard_selector(model: torch.nn.Module, shard: ShardSpec) -> Callable[[str, Any], bool]:
    """``shard`` as a predicate ``(name, param) -> bool``; names are checked against the model."""
    if callable(shard):
        return shard
    if isinstance(shard, str):
        raise TypeError("shard must be an iterable of parameter names or a callable, not a single string")
    wanted = set(shard)
    aliases: dict[int, set[str]] = {}  # a tied parameter answers to each of its names
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), set()).add(name)
    known = set().union(*aliases.values()) if aliases else set()
    unknown = sorted(wanted - known)
    if unknown:
        raise ValueError(
            f"shard names parameters the model does not have: {', '.join(unknown[:5])}"
            + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else "")
        )
    return lambda _name, p: not wanted.isdisjoint(aliases.get(id(p), ()))


def torch_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    import torch

    return torch.tensor(values, dtype=torch.long, device=device)


def grad_norms(
    layout: ParamLayout, max_norm: float | None = None, apply_clip: bool = True
) -> GradNorms | None:
    """Per-module and global gradient norms, and the clip factor for ``max_norm``.

    One pass over the gradients (the fused per-tensor norms that clipping needs) gives all the norms;
    with ``apply_clip`` the gradients are then scaled in place by the factor, as ``clip_grad_norm_``
    would; without it the factor only describes clipping done elsewhere. Returns None when no
    parameter has a gradient.
    """
    import torch

    grads, which = layout.grads()
    if not grads:
        return None
    with torch.no_grad():
        per_tensor = layout.per_tensor_norms(grads, which)
        figures = layout.module_sums(per_tensor.double().square(), which).sqrt_()
        # x * 0 is 0 for a finite norm and NaN for an infinite or NaN one (fewer kernels than isfinite)
        nonfinite = torch.mul(per_tensor, 0).ne_(0).sum(0, keepdim=True)
        if max_norm is None:
            clip_coef = torch.ones(1, dtype=torch.float64, device=layout.device)
        else:
            clip_coef = (figures[-1:] + CLIP_EPS).reciprocal_().mul_(max_norm).clamp_max_(1.0)
            if apply_clip:
                layout.scale_(grads, clip_coef, which)
    return GradNorms(figures=figures, clip_coef=clip_coef, nonfinite=nonfinite)


def host_grad_norms(
    layout: ParamLayout, max_norm: float | None = None, apply_clip: bool = True
) -> HostGradNorms | None:
    """:func:`grad_norms` for a layout in host memory (``layout.on_host``), with the same figures to the
    last bit and fewer operations: the norms are read as soon as they are computed (on the host that is no
    sync), so the clip factor is worked out in Python floats (the same IEEE double operations, in the same
    order, as the tensor expression), the non-finite count is taken only when the global norm is not finite
    (a finite sum of squares has no NaN or Inf term), and gradients are multiplied only when the factor is
    below 1 (a multiplication by 1 leaves every value as it is). Returns None when no parameter has a
    gradient."""
    import torch

    grads, which = layout.grads()
    if not grads:
        return None
    with torch.no_grad():
        per_tensor = layout.per_tensor_norms(grads, which)
        figures = layout.module_sums(per_tensor.double().square(), which).sqrt_().tolist()
        total = figures[-1]
        nonfinite = 0 if math.isfinite(total) else int(torch.mul(per_tensor, 0).ne_(0).sum().item())
        if max_norm is None:
            return HostGradNorms(figures, 1.0, nonfinite)
        coef = (1.0 / (total + CLIP_EPS)) * max_norm  # (figures[-1:] + CLIP_EPS).reciprocal_().mul_(max_norm)
        coef = 1.0 if coef > 1.0 else coef  # .clamp_max_(1.0), which keeps a NaN
        if apply_clip and not coef == 1.0:
            layout.scale_host_(grads, coef, which)
    return HostGradNorms(figures, coef, nonfinite)


class UpdateProbe:
    """Keeps a device copy of the parameters across one optimizer step to measure the update.

    Costs one parameter-sized buffer on the device while armed, which is why it runs every
    K steps rather than every step. Four passes over the parameters in all: the copy, its norm,
    the in-place difference, and the difference's norm.
    """

    def __init__(self, layout: ParamLayout):
        self.layout = layout
        self._before: list[torch.Tensor] | None = None

    @property
    def armed(self) -> bool:
        return self._before is not None

    def arm(self) -> None:
        import torch

        with torch.no_grad():  # no detach() per parameter: no graph is built under no_grad
            self._before = _fused_copy(self.layout)

    def measure(self) -> UpdateNorms | None:
        """Norms of the parameters before the step and of the step's change; frees the copy."""
        import torch

        before, self._before = self._before, None
        if before is None:
            return None
        layout = self.layout
        with torch.no_grad():
            param = layout.per_tensor_norms(before)
            _sub_(before, layout)  # before := before - after: the step's change, negated (same norm)
            update = layout.per_tensor_norms(before)
            norms = torch.linalg.vector_norm(torch.stack([param.double(), update.double()]), dim=1)
        return UpdateNorms(norms=norms)


def _sub_(before: list[torch.Tensor], layout: ParamLayout) -> None:
    import torch

    if len(layout.groups) == 1:
        torch._foreach_sub_(before, layout.params)
        return
    for idx in layout.groups:
        torch._foreach_sub_([before[i] for i in idx], [layout.params[i] for i in idx])


def _fused_copy(layout: ParamLayout) -> list[torch.Tensor]:
    import torch

    if len(layout.groups) == 1:
        return list(torch._foreach_mul(layout.params, 1.0))
    out: list[torch.Tensor | None] = [None] * len(layout.params)
    for idx in layout.groups:
        for i, c in zip(idx, torch._foreach_mul([layout.params[i] for i in idx], 1.0), strict=True):
            out[i] = c
    return out  # type: ignore[return-value]
