"""The platform's targets mapping: where a run really runs (job id, host, pod), as the platform knows it,
inline in the remediation config or in a ``targets_file`` re-read when it changes.

A leaf of remediate/: the config (config.py) holds these entries and the templates (templates.py) fill
placeholders from them, so neither needs the other for it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import RootModel, field_validator

from runwatch.detectors.configfile import Strict, load_yaml_model

log = logging.getLogger(__name__)


class Target(Strict):
    """Where a run really runs, as the platform knows it."""

    job_id: str | None = None
    host: str | None = None
    pod: str | None = None

    @field_validator("job_id", "host", "pod", mode="before")
    @classmethod
    def _number_as_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    def values(self) -> dict[str, str | None]:
        return {name: getattr(self, name) for name in ("job_id", "host", "pod")}


class TargetsMapping(RootModel[dict[str, Target]]):
    """A targets file: a YAML mapping of run id -> {job_id, host, pod}."""


def read_targets_file(path: Path) -> dict[str, Target]:
    """The targets file's entries; raises ``ConfigError`` (a ``ValueError``) saying what is wrong."""
    return load_yaml_model(path, TargetsMapping, "targets file").root


class TargetsFile:
    """The platform's mapping file, re-read when its modification time or size changes; if a
    re-read fails (a half-written file), the last good contents stay in use."""

    def __init__(self, path: Path):
        self.path = path
        self.entries = read_targets_file(path)  # raises: a config pointing at a bad file is refused
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def get(self, run_id: str) -> Target | None:
        stamp = self._stat()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self.entries = read_targets_file(self.path)
            except ValueError as exc:
                log.warning(
                    "remediate: targets file re-read failed (%s); keeping its last good contents", exc
                )
        return self.entries.get(run_id)
