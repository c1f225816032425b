"""The one module the contract's classes are known by: ``runwatch.contract.schema``, whichever module of
``messages``, ``limits`` or ``decoding`` defines them.

A run's state is pickled, and pickle names a class by its ``__module__``; the state's unpickler admits a
class only where it says it lives (worker/runwatch/worker/state/classes.py admits
``runwatch.contract.schema``). Snapshots written before the contract was split into modules name its
classes there, and so do the ones written since: a worker of either side restores the other's.
"""

from __future__ import annotations

from typing import TypeVar

SCHEMA_MODULE = "runwatch.contract.schema"

_Class = TypeVar("_Class", bound=type)


def known_as_schema(cls: _Class) -> _Class:
    """``cls``, named as a class of ``runwatch.contract.schema`` (which hands it on)."""
    cls.__module__ = SCHEMA_MODULE
    return cls
