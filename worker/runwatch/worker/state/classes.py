"""What a run's state snapshot may name: the unpickler that reads ``runwatch.state`` bodies.

A pickle is a small program: its GLOBAL / STACK_GLOBAL instructions import any module and fetch any
name from it, and REDUCE calls what they fetched. ``StateUnpickler`` resolves only the names a run's
state is made of, and refuses every other before importing or calling anything, so a record that
names ``os.system`` (or ``builtins.eval``, ``subprocess.Popen``...) is refused whichever key signed it.

What is admitted:

- **runwatch's own classes**: a class defined in a module a run's state is made of (``OWN_MODULES``:
  the engine, the policy, the baselines, the wire schema; and the module of every registered detector
  and of its config, so that a new detector's classes are admitted by its registration). Only a class
  defined there under exactly that name: no function, no name the module imported from elsewhere, no
  dotted path (``module.os.system``);
- **others' pieces**, by exact (module, name) (``FOREIGN``): the river quantiles the detectors hold,
  numpy's array and scalar reconstruction and its dtype, ``datetime``'s types, a few ``collections``
  containers and harmless builtin constructors.

``tests/worker/test_state_classes.py`` pickles real runs' states (every registered detector, the monitor
through the worker's processor, a baseline band) and checks with ``referenced_globals`` that every name
they reference is admitted: a detector that starts holding something new fails that test, not a restore.
"""

from __future__ import annotations

import importlib
import pickle
import pickletools
from functools import cache

from runwatch.worker.state.moved_modules import MOVED_MODULES

# Modules whose classes (defined there) a run's state is made of, besides the registered detectors'.
OWN_MODULES = frozenset(
    {
        "runwatch.detectors.config",
        "runwatch.detectors.cooldown",
        "runwatch.detectors.findings",
        "runwatch.detectors.gpu_health",
        "runwatch.detectors.host_load",
        "runwatch.detectors.rank_outlier",
        "runwatch.detectors.rolling_quantile",
        "runwatch.detectors.engine.ack_watch",
        "runwatch.detectors.engine.checkpoints",
        "runwatch.detectors.engine.crashes",
        "runwatch.detectors.engine.evidence",
        "runwatch.detectors.engine.group_join",
        "runwatch.detectors.engine.group_monitor",
        "runwatch.detectors.engine.merge_monitor",
        "runwatch.detectors.engine.monitor",
        "runwatch.detectors.engine.policy",
        "runwatch.detectors.engine.progress",
        "runwatch.detectors.engine.rank_join",
        "runwatch.detectors.engine.recovery",
        "runwatch.detectors.engine.rewind",
        "runwatch.detectors.baselines.band",
        "runwatch.detectors.baselines.compare",
        "runwatch.detectors.baselines.gate",
        "runwatch.detectors.baselines.summary",
        "runwatch.contract.schema",
        "runwatch.contract.group_report",
    }
)

# Everything else a snapshot may name, exactly. (numpy's modules moved from numpy.core to numpy._core in
# numpy 2: both spellings, so a snapshot taken beside either numpy reads.)
FOREIGN: dict[str, frozenset[str]] = {
    "runwatch.worker.processor": frozenset({"RunState"}),
    "builtins": frozenset({"set", "frozenset", "slice", "complex", "bytearray", "range"}),
    "collections": frozenset({"OrderedDict", "deque", "defaultdict", "Counter"}),
    "datetime": frozenset({"date", "time", "datetime", "timedelta", "timezone"}),
    "river.stats.quantile": frozenset({"Quantile", "RollingQuantile"}),
    "river._river_rust.stats": frozenset({"RsQuantile", "RsRollingQuantile"}),
    "numpy": frozenset({"dtype", "ndarray"}),
    "numpy._core.multiarray": frozenset({"_reconstruct", "scalar"}),
    "numpy.core.multiarray": frozenset({"_reconstruct", "scalar"}),
    "numpy._core.numeric": frozenset({"_frombuffer"}),
    "numpy.core.numeric": frozenset({"_frombuffer"}),
}


@cache
def own_modules() -> frozenset[str]:
    """``OWN_MODULES`` and the modules of every registered detector and its config."""
    from runwatch.detectors import config, registry  # (config registers the built-in detectors)

    del config
    found = set(OWN_MODULES)
    for spec in registry.specs():
        found.add(spec.config.__module__)
        build_module = getattr(spec.build, "__module__", None)
        if isinstance(build_module, str) and build_module.startswith("runwatch."):
            found.add(build_module)
    return frozenset(found)


class RefusedName(pickle.UnpicklingError):
    """A state record names something a run's state is not made of."""


_resolved: dict[tuple[str, str], object] = {}  # (module, name) -> the admitted object, once checked


def resolve(module: str, name: str) -> object:
    """The object a snapshot's (``module``, ``name``) stands for, if admitted; else ``RefusedName``,
    raised before ``module`` is imported."""
    key = (module, name)
    found = _resolved.get(key)
    if found is not None:
        return found
    if module in MOVED_MODULES:
        # A snapshot taken before its module moved: the class where it is now, admitted (or not) by the
        # rules of the module that defines it (the new path may be a facade that re-exports it).
        if not name.isidentifier():
            raise _refused(module, name)
        moved = getattr(importlib.import_module(MOVED_MODULES[module]), name, None)
        if not isinstance(moved, type):
            raise _refused(module, name)
        found = resolve(moved.__module__, moved.__qualname__)
        _resolved[key] = found
        return found
    if module in FOREIGN:
        if name not in FOREIGN[module]:
            raise _refused(module, name)
        found = getattr(importlib.import_module(module), name)
    elif module in own_modules():
        if not name.isidentifier():
            raise _refused(module, name)  # (a dotted path reaches through the module to what it imported)
        found = getattr(importlib.import_module(module), name, None)
        if not (isinstance(found, type) and found.__module__ == module and found.__qualname__ == name):
            raise _refused(module, name)  # a function, or a name imported from elsewhere
    else:
        raise _refused(module, name)
    _resolved[key] = found
    return found


def is_admitted(module: str, name: str) -> bool:
    try:
        resolve(module, name)
    except RefusedName:
        return False
    return True


def _refused(module: str, name: str) -> RefusedName:
    return RefusedName(f"it names {module}.{name}, which a run's state is not made of (refused, not loaded)")


class StateUnpickler(pickle.Unpickler):
    """Reads a snapshot body, resolving only admitted names (``resolve``); no persistent ids."""

    def find_class(self, module: str, name: str) -> object:
        return resolve(module, name)


_STRINGS = {
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "UNICODE",
    "STRING",
    "BINSTRING",
    "SHORT_BINSTRING",
}


def referenced_globals(data: bytes) -> set[tuple[str, str]]:
    """Every (module, name) a pickle's GLOBAL, INST and STACK_GLOBAL instructions reference, read with
    ``pickletools`` (nothing is imported or run). For pickles as ``pickle.dumps`` writes them: the two
    strings a STACK_GLOBAL takes are the last two values pushed, directly or from the memo."""
    found: set[tuple[str, str]] = set()
    memo: dict[int, object] = {}
    pushed: list[object] = []  # what each instruction that pushes left (a string, or None for anything else)
    for opcode, arg, _ in pickletools.genops(data):
        op = opcode.name
        if op in ("GLOBAL", "INST"):
            module, _, name = str(arg).partition(" ")
            found.add((module, name))
            pushed.append(None)
        elif op == "STACK_GLOBAL":
            module_name, global_name = (pushed[-2], pushed[-1]) if len(pushed) >= 2 else (None, None)
            if isinstance(module_name, str) and isinstance(global_name, str):
                found.add((module_name, global_name))
            else:
                found.add(("?", "?"))  # (a pickle not as pickle.dumps writes them: the test fails on it)
            pushed.append(None)
        elif op in ("EXT1", "EXT2", "EXT4"):
            found.add(("copyreg extension", str(arg)))
            pushed.append(None)
        elif op == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif op in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = pushed[-1] if pushed else None  # type: ignore[arg-type]
        elif op in ("GET", "BINGET", "LONG_BINGET"):
            pushed.append(memo.get(int(arg)))  # type: ignore[arg-type]
        elif op in _STRINGS:
            pushed.append(arg)
        elif op not in ("FRAME", "PROTO", "STOP"):
            pushed.append(None)
    return found
