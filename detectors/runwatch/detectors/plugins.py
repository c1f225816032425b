"""Detectors from installed packages: the entry-point group ``runwatch.detectors`` (docs/detectors.md).

A package declares its detectors in its own pyproject.toml::

    [project.entry-points."runwatch.detectors"]
    toy_loss_ceiling = "toy_detector:SPEC"

Each entry point names a ``DetectorSpec`` (registered here, under the entry point's name, which must be
the detector's) or a module whose import registers its detectors with ``registry.register``. They are
loaded once, after the built-in detectors and before the config model is built from the registry
(detectors/runwatch/detectors/config.py), in every process that builds a config: the worker, its
detector process, ``runwatch replay`` and ``runwatch evaluate``.

A plugin that cannot be loaded stops that process with ``DetectorPluginError``, naming the entry point,
its distribution and what went wrong: a worker that silently ran without a detector its policy names
would be worse (and a rule naming it would fail anyway, less clearly).
"""

from __future__ import annotations

import types
from importlib.metadata import EntryPoint, entry_points

from runwatch.detectors import registry

GROUP = "runwatch.detectors"


class DetectorPluginError(RuntimeError):
    """An installed detector plugin could not be loaded (not an ImportError: the CLI reads those as a
    missing extra)."""


def _where(entry: EntryPoint) -> str:
    dist = entry.dist
    origin = f" of {dist.name} {dist.version}" if dist is not None else ""
    return f"detector plugin {entry.name!r} ({GROUP} entry point {entry.value!r}{origin})"


def load_entry(entry: EntryPoint) -> list[str]:
    """Load one entry point and register what it declares; returns the detector names it added.

    Raises ``DetectorPluginError`` if it cannot be imported, names neither a ``DetectorSpec`` nor a module
    that registers one, names a spec under another name, or would replace a detector already registered
    (a built-in's or another plugin's)."""
    before = dict(registry.registered())
    try:
        loaded = entry.load()
    except Exception as exc:  # any failure of a plugin's import is reported as the plugin's
        raise DetectorPluginError(f"{_where(entry)} failed to load: {type(exc).__name__}: {exc}") from exc
    if isinstance(loaded, registry.DetectorSpec):
        if loaded.name != entry.name:
            raise DetectorPluginError(
                f"{_where(entry)} names the detector {loaded.name!r}: an entry point is named for its "
                "detector"
            )
        if before.get(loaded.name, loaded) is not loaded:
            raise DetectorPluginError(f"{_where(entry)} would replace the detector {loaded.name!r}")
        registry.register(loaded)
    elif not isinstance(loaded, types.ModuleType):
        raise DetectorPluginError(
            f"{_where(entry)} is a {type(loaded).__name__}: it must name a DetectorSpec or a module that "
            "registers detectors"
        )
    now = registry.registered()
    replaced = [name for name, spec in before.items() if now[name] is not spec]
    if replaced:
        raise DetectorPluginError(f"{_where(entry)} replaced the detector(s) {', '.join(replaced)}")
    added = [name for name in now if name not in before]
    if isinstance(loaded, types.ModuleType) and not any(
        loaded.__name__ in (spec.config.__module__, spec.build.__module__) for spec in now.values()
    ):
        raise DetectorPluginError(f"{_where(entry)} registers no detector")
    return added


def load_plugins() -> list[str]:
    """Load every installed plugin of ``GROUP``, in name order; returns the detector names they added."""
    added: list[str] = []
    for entry in sorted(entry_points(group=GROUP), key=lambda e: (e.name, e.value)):
        added += load_entry(entry)
    return added
