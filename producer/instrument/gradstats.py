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

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROOT_MODULE = "(root)"  # name for parameters owned by the model object itself
CLIP_EPS = 1e-6  # the same epsilon torch.nn.utils.clip_grad_norm_ adds to the norm


def _by_device_dtype(tensors: list[torch.Tensor]) -> dict[tuple, list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype): a fused kernel takes one of each."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


def _foreach_norms(tensors: list[torch.Tensor], out_device: torch.device) -> torch.Tensor:
    """Per-tensor 2-norms as one float64 vector on ``out_device``, in input order.

    Low-precision tensors are reduced in float32.
    """
    import torch

    groups = _by_device_dtype(tensors)
    if len(groups) == 1:
        ((device, dtype), _), = groups.items()
        norms = torch._foreach_norm(tensors, 2, dtype=_acc_dtype(dtype))
        return torch.stack(norms).to(out_device, torch.float64)
    out = torch.empty(len(tensors), dtype=torch.float64, device=out_device)
    for (_device, dtype), idx in groups.items():
        norms = torch._foreach_norm([tensors[i] for i in idx], 2, dtype=_acc_dtype(dtype))
        out[torch.tensor(idx, device=out_device)] = torch.stack(norms).to(out_device, torch.float64)
    return out


def _acc_dtype(dtype: torch.dtype) -> torch.dtype | None:
    import torch

    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else None


@dataclass
class GradNorms:
    """One step's gradient figures, all device tensors (0-d unless noted)."""

    total: torch.Tensor  # global norm before clipping
    clip_coef: torch.Tensor  # factor the gradients were (or would be) multiplied by, <= 1
    modules: torch.Tensor  # per-module norms before clipping, shape (n_modules,)
    nonfinite: torch.Tensor  # parameter tensors whose gradient holds a NaN or Inf


@dataclass
class UpdateNorms:
    param: torch.Tensor  # norm of all trainable parameters before the step
    update: torch.Tensor  # norm of (after - before) over all trainable parameters


ShardSpec = Iterable[str] | Callable[[str, Any], bool]


class ParamLayout:
    """Trainable parameters in a fixed order, each tagged with the module that owns it.

    ``shard``: the parameters this rank owns, as parameter names (``model.named_parameters()``
    names; a tied parameter may be named by any of its names) or a callable ``(name, param) ->
    bool``. Only those are kept; a module that owns none of them has no entry. ``n_params`` still
    counts every trainable parameter of the model (each rank computes with the whole model).
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
            own = [(f"{name}.{pname}" if name else pname, p) for pname, p in module.named_parameters(recurse=False)
                   if p.requires_grad and id(p) not in seen]
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
                raise ValueError("shard selects none of the model's trainable parameters: pass the names "
                                 "(as model.named_parameters() gives them) or a predicate of the parameters "
                                 "this rank owns")
            raise ValueError("the model has no trainable parameters to watch")
        self.device = self.params[0].device
        self.owner_index = torch.tensor(owners, dtype=torch.long, device=self.device)
        self.n_params = n_params

    def grads(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Gradients that exist this step and the owner index of each."""
        grads = [p.grad for p in self.params]
        if all(g is not None for g in grads):
            return grads, self.owner_index  # the common case: no per-step index building
        present = [i for i, g in enumerate(grads) if g is not None]
        index = self.owner_index[torch_tensor(present, self.device)] if present else self.owner_index[:0]
        return [grads[i] for i in present], index


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
        raise ValueError(f"shard names parameters the model does not have: {', '.join(unknown[:5])}"
                         + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""))
    return lambda _name, p: not wanted.isdisjoint(aliases.get(id(p), ()))


def torch_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    import torch

    return torch.tensor(values, dtype=torch.long, device=device)


def grad_norms(layout: ParamLayout, max_norm: float | None = None, apply_clip: bool = True) -> GradNorms | None:
    """Per-module and global gradient norms, and the clip factor for ``max_norm``.

    With ``apply_clip`` the gradients are scaled in place by that factor, as
    ``clip_grad_norm_`` would; without it the factor only describes clipping done
    elsewhere. Returns None when no parameter has a gradient.
    """
    import torch

    grads, owner_index = layout.grads()
    if not grads:
        return None
    per_param = _foreach_norms(grads, layout.device)
    module_sq = torch.zeros(len(layout.module_names), dtype=torch.float64, device=layout.device)
    module_sq.index_add_(0, owner_index, per_param.square())
    total = module_sq.sum().sqrt()
    nonfinite = (~torch.isfinite(per_param)).sum()
    limit = max_norm if max_norm is not None else float("inf")
    clip_coef = torch.clamp(limit / (total + CLIP_EPS), max=1.0)
    if max_norm is not None and apply_clip:
        _scale_(grads, clip_coef)
    return GradNorms(total=total, clip_coef=clip_coef, modules=module_sq.sqrt(), nonfinite=nonfinite)


def _scale_(tensors: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply in place by ``coef`` as torch's clip_grad_norm_ does (fused, per device/dtype)."""
    import torch

    for (device, dtype), idx in _by_device_dtype(tensors).items():
        torch._foreach_mul_([tensors[i] for i in idx], coef.to(device, dtype))


class UpdateProbe:
    """Keeps a device copy of the parameters across one optimizer step to measure the update.

    Costs one parameter-sized buffer on the device while armed, which is why it runs every
    K steps rather than every step.
    """

    def __init__(self, layout: ParamLayout):
        self.layout = layout
        self._before: list[torch.Tensor] | None = None

    @property
    def armed(self) -> bool:
        return self._before is not None

    def arm(self) -> None:
        import torch

        with torch.no_grad():
            self._before = _fused_copy([p.detach() for p in self.layout.params])

    def measure(self) -> UpdateNorms | None:
        """Norms of the parameters before the step and of the step's change; frees the copy."""
        import torch

        before, self._before = self._before, None
        if before is None:
            return None
        with torch.no_grad():
            param = _foreach_norms(before, self.layout.device).square().sum().sqrt()
            after = [p.detach() for p in self.layout.params]
            _sub_from_(before, after)  # before := after - before, reusing the copy's memory
            update = _foreach_norms(before, self.layout.device).square().sum().sqrt()
        return UpdateNorms(param=param, update=update)


def _fused_copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    import torch

    out: list[torch.Tensor | None] = [None] * len(tensors)
    for idx in _by_device_dtype(tensors).values():
        for i, c in zip(idx, torch._foreach_mul([tensors[i] for i in idx], 1.0), strict=True):
            out[i] = c
    return out  # type: ignore[return-value]


def _sub_from_(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    """``before[i] = after[i] - before[i]`` in place, fused per device/dtype."""
    import torch

    for idx in _by_device_dtype(before).values():
        b = [before[i] for i in idx]
        torch._foreach_neg_(b)
        torch._foreach_add_(b, [after[i] for i in idx])
