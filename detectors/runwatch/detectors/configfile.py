"""Reading a YAML file into a pydantic model, with one-line errors a user can act on.

Shared by the detector/policy config, the remediation config and its targets file; ``Strict`` is
the base of every config section in both.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    pass


class Strict(BaseModel):
    """Every config section: unknown keys are errors, so a typo never falls back to a default."""

    model_config = ConfigDict(extra="forbid")


def load_yaml_model(path: str | Path, model: type[M], what: str = "config") -> M:
    """Parse ``path`` and validate it as ``model``; any problem is a ``ConfigError`` naming the file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text (UTF-8) file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in e['loc']) or '<file>'}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(f"invalid {what} {path}:\n" + "\n".join(lines)) from None
