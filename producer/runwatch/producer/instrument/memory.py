"""Memory of one rank: CUDA caching allocator, host RSS and the cgroup limit that binds the process.

Sampled every step, so everything that can be resolved once (file paths, which cgroup's
limit applies, the page size) is resolved at construction; a sample is then a few small
reads. A source that is not there is an absent field, never a zero: the leak and
fragmentation detectors must not mistake "unknown" for "empty".
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runwatch.contract.schema import MemoryStats

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value (it depends on the page
# size); anything beyond 1 EiB is no real limit either.
_UNLIMITED_V1 = 1 << 60


@dataclass(frozen=True)
class CgroupMemoryFiles:
    """The usage and limit files to read, both of the cgroup whose limit binds this process."""

    version: int  # 1 or 2
    usage: str
    limit: str | None  # None: no limit anywhere up the hierarchy


def _read_int(path: str) -> int | None:
    # os.open/os.read: about half the cost of open() with a text wrapper, which matters every step.
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            return int(os.read(fd, 64))
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return None


def _read_limit(path: str, version: int) -> int | None:
    value = _read_int(path)  # v2's "max" fails int() and reads as None: no limit
    if value is None or (version == 1 and value >= _UNLIMITED_V1):
        return None
    return value


def _own_cgroup_paths(proc_root: Path) -> tuple[str | None, str | None]:
    """This process's (v2 path, v1 memory-controller path) from ``/proc/self/cgroup``."""
    v2 = v1 = None
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _cgroup_dir(mount: Path, own_path: str, probe: str) -> Path | None:
    """Where this process's cgroup is under ``mount``. Inside a container the mount is often the
    container's own cgroup while /proc/self/cgroup still names the host path: fall back to the mount."""
    for candidate in (mount / own_path.lstrip("/"), mount):
        if (candidate / probe).is_file():
            return candidate
    return None


def _binding_cgroup(
    own: Path, mount: Path, usage_name: str, limit_name: str, version: int
) -> CgroupMemoryFiles:
    # A limit set on an ancestor binds too (SLURM limits the job cgroup, the task cgroup below it says
    # "max"); the tightest one is where the OOM killer will strike, so report that cgroup's usage with it.
    best: tuple[int, Path] | None = None
    directory = own
    while True:
        limit = _read_limit(str(directory / limit_name), version)
        if limit is not None and (best is None or limit < best[0]) and (directory / usage_name).is_file():
            best = (limit, directory)
        if directory == mount or mount not in directory.parents:
            break
        directory = directory.parent
    if best is None:
        return CgroupMemoryFiles(version, str(own / usage_name), None)
    return CgroupMemoryFiles(version, str(best[1] / usage_name), str(best[1] / limit_name))


def find_cgroup_memory_files(
    proc_root: str | Path = "/proc",
    cgroup_root: str | Path = "/sys/fs/cgroup",
) -> CgroupMemoryFiles | None:
    """Resolve the memory usage/limit files for this process: cgroup v2 (unified) first, then v1."""
    proc_root, cgroup_root = Path(proc_root), Path(cgroup_root)
    v2_path, v1_path = _own_cgroup_paths(proc_root)
    if v2_path is not None:
        own = _cgroup_dir(cgroup_root, v2_path, "memory.current")
        if own is not None:
            return _binding_cgroup(own, cgroup_root, "memory.current", "memory.max", 2)
    if v1_path is not None:
        mount = cgroup_root / "memory"
        own = _cgroup_dir(mount, v1_path, "memory.usage_in_bytes")
        if own is not None:
            return _binding_cgroup(own, mount, "memory.usage_in_bytes", "memory.limit_in_bytes", 1)
    return None


def _wants_cuda(device: Any) -> bool:
    if device is None or isinstance(device, int):
        return True
    device_type = getattr(device, "type", None)  # torch.device
    if device_type is None:
        device_type = str(device).split(":", 1)[0]
    return device_type == "cuda"


class MemorySampler:
    """Samples :class:`MemoryStats` for one rank.

    ``device``: the training device (``torch.device``, ``"cuda:0"``, an index, or None for the
    current CUDA device). CUDA figures are read only when it is a CUDA device and this process has
    already initialised CUDA: sampling never initialises it, and never imports torch.
    """

    def __init__(
        self, device: Any = None, proc_root: str | Path = "/proc", cgroup_root: str | Path = "/sys/fs/cgroup"
    ):
        self.device = device
        self._cuda = _wants_cuda(device)
        statm = Path(proc_root) / "self" / "statm"
        self._statm = str(statm) if statm.is_file() else None
        self._page_size = os.sysconf("SC_PAGE_SIZE")
        self.cgroup = find_cgroup_memory_files(proc_root, cgroup_root)
        self._device_total: int | None = None  # asked once CUDA is in use: asking earlier would initialise it
        self._device_total_asked = False

    def sample(self) -> MemoryStats | None:
        """Current figures in bytes; None if no source at all is available."""
        fields: dict[str, int | None] = {}
        if self._cuda:
            fields.update(self._cuda_fields())
        if self._statm is not None:
            fields["host_rss"] = self._host_rss(self._statm)
        if self.cgroup is not None:
            fields["cgroup_usage"] = _read_int(self.cgroup.usage)
            if self.cgroup.limit is not None:
                fields["cgroup_limit"] = _read_limit(self.cgroup.limit, self.cgroup.version)
        present = {name: value for name, value in fields.items() if value is not None}
        return MemoryStats(**present) if present else None

    def _host_rss(self, statm: str) -> int | None:
        try:
            fd = os.open(statm, os.O_RDONLY)
            try:
                resident_pages = int(os.read(fd, 256).split()[1])  # statm: size resident shared ...
            finally:
                os.close(fd)
        except (OSError, ValueError, IndexError):
            return None
        return resident_pages * self._page_size

    def _cuda_fields(self) -> dict[str, int | None]:
        torch = sys.modules.get("torch")
        if torch is None:  # torch not imported: CUDA cannot be in use
            return {}
        try:
            if not torch.cuda.is_initialized():
                return {}
            # The nested form is what memory_stats() flattens and sorts (hundreds of keys) on every call.
            stats = torch.cuda.memory_stats_as_nested_dict(self.device)
        except Exception:  # noqa: BLE001 - torch/CUDA errors vary: no CUDA fields, training goes on
            return {}
        allocated = stats.get("allocated_bytes", {}).get("all", {})
        reserved = stats.get("reserved_bytes", {}).get("all", {})
        return {
            "allocated": allocated.get("current"),
            "reserved": reserved.get("current"),
            "peak": allocated.get("peak"),
            "alloc_retries": stats.get("num_alloc_retries"),
            "ooms": stats.get("num_ooms"),
            "device_total": self._cuda_device_total(torch),
        }

    def _cuda_device_total(self, torch: Any) -> int | None:
        # The capacity never changes: one properties lookup per sampler, not per step.
        if not self._device_total_asked:
            self._device_total_asked = True
            try:
                self._device_total = int(torch.cuda.get_device_properties(self.device).total_memory)
            except Exception:  # noqa: BLE001 - torch/CUDA errors vary: the capacity is unknown
                self._device_total = None
        return self._device_total
