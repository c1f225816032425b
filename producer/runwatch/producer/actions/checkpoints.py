"""Checkpoints in the layout a rollback restores: ``save_checkpoint`` writes one, ``torch_restore``
makes the default restore function for a model (and optimizer). torch is imported where used."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runwatch.contract.schema import CheckpointRef

RestoreFn = Callable[[CheckpointRef], None]


def save_checkpoint(path: str, model: Any, optimizer: Any = None, **extra: Any) -> None:
    """Write a checkpoint in the layout the default rollback restores."""
    import torch

    state = {"model": model.state_dict(), **extra}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    torch.save(state, path)


def torch_restore(model: Any, optimizer: Any = None) -> RestoreFn:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``)."""

    def restore(ref: CheckpointRef) -> None:
        import torch

        state = torch.load(ref.uri, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        if optimizer is not None and "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])

    return restore
