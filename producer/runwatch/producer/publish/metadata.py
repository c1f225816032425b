"""Run metadata for ``run_start``, and this process's rank and world size.

Everything here is best effort: a missing tool, a directory that is not a git repo or a
config value JSON cannot hold gives an absent field (or a string), never an exception,
because metadata must never keep a training run from starting. The subprocesses (git,
nvidia-smi) run concurrently with short timeouts, and torch is never imported just to
read its version (a cold ``import torch`` alone takes about a second).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence, Set
from pathlib import Path
from typing import Any

from pydantic import BaseModel

GIT_TIMEOUT_S = 1.0
NVIDIA_SMI_TIMEOUT_S = 2.0
NVIDIA_DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"
_MAX_CONFIG_DEPTH = 32  # deeper (or cyclic) structures are cut off as strings

# Launchers that export a rank and world size, in order of preference.
_RANK_WORLD_ENV = (
    ("RANK", "WORLD_SIZE"),  # torchrun, torch.distributed.launch, accelerate, deepspeed
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
)


def detect_rank_world() -> tuple[int, int]:
    """``(rank, world_size)``: from torch.distributed if initialised, else the launcher's environment,
    else ``(0, 1)``."""
    torch = sys.modules.get("torch")  # not imported means torch.distributed cannot be initialised
    if torch is not None:
        try:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                return dist.get_rank(), dist.get_world_size()
        except Exception:  # noqa: BLE001 - torch.distributed's errors vary: ask the environment
            pass
    for rank_var, world_var in _RANK_WORLD_ENV:
        try:
            rank, world = int(os.environ[rank_var]), int(os.environ[world_var])
        except (KeyError, ValueError):
            continue
        if 0 <= rank < world:
            return rank, world
    return 0, 1


# -- config -----------------------------------------------------------------------------------------


def to_jsonable(value: Any, _depth: int = 0) -> Any:
    """``value`` as plain JSON types: dicts with string keys, lists, str, int, float, bool, None.

    Dataclasses, argparse Namespaces and pydantic models become dicts; 0-d tensors and numpy scalars
    their Python number; sets a sorted list, so that the result (and its hash) does not depend on
    iteration order; anything else ``str(value)``.
    """
    if value is None or isinstance(value, bool | int | float | str):
        return value  # NaN/Inf floats travel as strings on the wire (see schema)
    if _depth >= _MAX_CONFIG_DEPTH:
        return _as_text(value)
    try:
        mapping = _as_mapping(value)
        if mapping is not None:
            return {str(key): to_jsonable(item, _depth + 1) for key, item in mapping.items()}
        if isinstance(value, Set):
            items = [to_jsonable(item, _depth + 1) for item in value]
            return sorted(items, key=lambda item: json.dumps(item, sort_keys=True, default=str))
        if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
            return [to_jsonable(item, _depth + 1) for item in value]
        if getattr(value, "shape", None) == () and hasattr(value, "item"):  # 0-d tensor, numpy scalar
            return to_jsonable(value.item(), _depth + 1)
    except Exception:  # noqa: BLE001 - an object whose conversion fails is kept as its text
        pass
    return _as_text(value)


def _as_mapping(value: Any) -> Mapping[Any, Any] | None:
    if isinstance(value, Mapping):  # dict, OmegaConf DictConfig, ...
        return value
    if isinstance(value, argparse.Namespace):
        return vars(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, BaseModel):
        return value.model_dump()
    return None


def _as_text(value: Any) -> str:
    try:
        return str(value)
    except Exception:  # noqa: BLE001 - any object's __str__ may raise anything
        return f"<{type(value).__name__}>"


def config_hash(config: Mapping[str, Any]) -> str:
    """First 16 hex digits of the SHA-256 of the canonical JSON of ``config`` (sorted keys, compact)."""
    canonical = json.dumps(to_jsonable(config), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


# -- subprocesses -----------------------------------------------------------------------------------


class _Command:
    """A subprocess started now and read later, so that git and nvidia-smi run concurrently."""

    def __init__(
        self,
        args: list[str],
        timeout_s: float,
        cwd: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
    ):
        self._deadline = time.monotonic() + timeout_s
        try:
            self._proc: subprocess.Popen[str] | None = subprocess.Popen(
                args,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except (OSError, ValueError):  # no such program, no such directory
            self._proc = None

    def output(self) -> str | None:
        """Standard output if the command succeeded within its timeout, else None."""
        if self._proc is None:
            return None
        try:
            out, _ = self._proc.communicate(timeout=max(0.0, self._deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.communicate()
            return None
        return out if self._proc.returncode == 0 else None


def _git_commands(cwd: str | os.PathLike[str] | None) -> tuple[_Command, _Command]:
    # GIT_OPTIONAL_LOCKS=0: `git status` would otherwise refresh the index and take index.lock, which
    # fails (or blocks a developer's git) when several ranks start in the same checkout at once.
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0"}
    head = _Command(["git", "rev-parse", "--verify", "HEAD"], GIT_TIMEOUT_S, cwd, env)
    status = _Command(["git", "status", "--porcelain", "--untracked-files=no"], GIT_TIMEOUT_S, cwd, env)
    return head, status


def parse_nvidia_driver_version(text: str) -> str | None:
    """The driver version from ``/proc/driver/nvidia/version`` ("... Kernel Module  550.54.15  ...")."""
    match = re.search(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)*)\b", text)
    return match.group(1) if match else None


def _driver_version_from_proc() -> str | None:
    try:
        return parse_nvidia_driver_version(Path(NVIDIA_DRIVER_VERSION_FILE).read_text())
    except OSError:
        return None


def _parse_nvidia_smi(output: str) -> tuple[str | None, list[str]]:
    """``(driver version, GPU names)`` from ``--query-gpu=driver_version,name --format=csv,noheader``."""
    driver, names = None, []
    for line in output.splitlines():
        version, _, name = (part.strip() for part in line.partition(","))
        if version:
            driver = driver or version
        if name:
            names.append(name)
    return driver, names


def _visible_gpus(names: list[str]) -> list[str]:
    """The GPUs this process may use, by CUDA_VISIBLE_DEVICES indices (UUIDs and MIG ids: all of them)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return names
    items = [item.strip() for item in visible.split(",") if item.strip()]
    if not all(item.isdigit() for item in items):
        return names
    return [names[int(item)] for item in items if int(item) < len(names)]


# -- torch ----------------------------------------------------------------------------------------


def _torch_versions_without_import() -> tuple[str | None, str | None]:
    """``(torch.__version__, torch.version.cuda)`` read from torch/version.py as literals, not imported."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    source = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    found: dict[str, Any] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id in ("__version__", "cuda"):
                    found[target.id] = ast.literal_eval(node.value)
    return found.get("__version__"), found.get("cuda")


def _torch_facts(torch: Any) -> tuple[str | None, str | None, list[str] | None]:
    """``(torch version, CUDA version, GPU names or None if unknown)``."""
    if torch is None:
        version, cuda = _torch_versions_without_import()
        return version, cuda, None
    version, cuda = str(torch.__version__), torch.version.cuda
    names: list[str] = []
    if torch.cuda.is_available():  # false: CUDA is not initialised just to learn there is none
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return version, cuda, names


# -- run_start --------------------------------------------------------------------------------------


def _attempt(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - best-effort: a field that cannot be collected is absent
        return None


def collect_run_start(
    *,
    world_size: int | None = None,
    config: Mapping[str, Any] | Any = None,
    seed: int | None = None,
    dataset_version: str | None = None,
    tags: Mapping[str, Any] | None = None,
    baseline_key: str | None = None,
    job_id: str | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Fields for ``RunStartEvent`` (everything except run_id and rank); what cannot be found is left out.

    git sha and dirty flag come from ``cwd`` (default: the current directory); the job id, unless
    given, from ``RUNWATCH_JOB_ID`` or ``SLURM_JOB_ID``; the world size, unless given, from
    :func:`detect_rank_world`.
    """
    git_head, git_status = _git_commands(cwd)
    torch = sys.modules.get("torch")
    driver = _driver_version_from_proc()
    smi = _start_nvidia_smi() if driver is None or torch is None else None

    fields = _launch_fields(world_size, baseline_key, job_id)
    fields.update(_caller_fields(config, seed, dataset_version, tags))
    fields.update(_gpu_fields(torch, driver, smi))
    fields.update(_git_fields(git_head, git_status))
    return {name: value for name, value in fields.items() if value is not None}


def _start_nvidia_smi() -> _Command | None:
    """nvidia-smi's query for the driver version and GPU names, started now; None if it is not installed."""
    if not shutil.which("nvidia-smi"):
        return None
    query = ["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"]
    return _Command(query, NVIDIA_SMI_TIMEOUT_S)


def _launch_fields(world_size: int | None, baseline_key: str | None, job_id: str | None) -> dict[str, Any]:
    """The job id, baseline key, world size and host: given, or read from the launcher's environment."""
    fields: dict[str, Any] = {}
    job_id = job_id or os.environ.get("RUNWATCH_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if job_id:
        fields["job_id"] = str(job_id)
    if baseline_key is not None:
        fields["baseline_key"] = str(baseline_key)
    if isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1:
        fields["world_size"] = world_size
    else:
        fields["world_size"] = detect_rank_world()[1]
    fields["host"] = _attempt(socket.gethostname)
    return fields


def _caller_fields(
    config: Mapping[str, Any] | Any,
    seed: int | None,
    dataset_version: str | None,
    tags: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """What only the caller knows: the config (and its hash), seed, dataset version and tags."""
    fields: dict[str, Any] = {}
    if config is not None:
        jsonable = _attempt(to_jsonable, config)
        if isinstance(jsonable, dict):
            fields["config"] = jsonable
            fields["config_hash"] = config_hash(jsonable)
    if seed is not None:
        fields["seed"] = _attempt(_as_seed, seed)
    if dataset_version is not None:
        fields["dataset_version"] = str(dataset_version)
    if tags is not None:
        fields["tags"] = _attempt(lambda: {str(key): str(value) for key, value in tags.items()})
    return fields


def _gpu_fields(torch: Any, driver: str | None, smi: _Command | None) -> dict[str, Any]:
    """torch's and CUDA's versions, the driver version and the visible GPUs' names; nvidia-smi fills in
    what /proc and torch did not say."""
    fields: dict[str, Any] = {}
    versions = _attempt(_torch_facts, torch) or (None, None, None)
    fields["torch_version"], fields["cuda_version"], gpu_names = versions

    smi_driver, smi_names = _attempt(_parse_nvidia_smi, smi.output() if smi else "") or (None, [])
    fields["driver_version"] = driver or smi_driver
    if gpu_names is None:
        gpu_names = _visible_gpus(smi_names)
    if gpu_names:
        fields["gpu_names"] = gpu_names
    return fields


def _git_fields(git_head: _Command, git_status: _Command) -> dict[str, Any]:
    """The checkout's commit sha and whether it has uncommitted changes."""
    fields: dict[str, Any] = {}
    sha = git_head.output()
    if sha and re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", sha.strip()):
        fields["git_sha"] = sha.strip()
    status = git_status.output()
    if status is not None:
        fields["git_dirty"] = bool(status.strip())
    return fields


def _as_seed(seed: Any) -> int | None:
    return None if isinstance(seed, bool) else int(seed)  # int() also takes numpy and 0-d tensor seeds


def run_start_fields(world_size: int, collect: bool, **metadata: Any) -> dict[str, Any]:
    """``run_start``'s fields (all but run_id and rank): collected by :func:`collect_run_start`, or
    with ``collect=False`` only what the caller passed (a ``config`` only when it is a dict)."""
    if collect:
        return collect_run_start(world_size=world_size, **metadata)
    return {
        "world_size": world_size,
        **{k: v for k, v in metadata.items() if v is not None and (k != "config" or isinstance(v, dict))},
    }
