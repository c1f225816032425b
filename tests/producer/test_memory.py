"""MemorySampler: host RSS from the real /proc, cgroup v1/v2 parsing on fake trees (limits, "max", the
v1 "unlimited" sentinel, a limit set on an ancestor, missing files), and CUDA allocator figures on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from runwatch.contract.schema import MemoryStats, StepEvent
from runwatch.producer.instrument.memory import MemorySampler, find_cgroup_memory_files

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 1 << 20
V1_UNLIMITED = "9223372036854771712\n"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_proc(tmp_path: Path, cgroup: str, resident_pages: int | None = 2500) -> Path:
    proc = tmp_path / "proc"
    write(proc / "self" / "cgroup", cgroup)
    if resident_pages is not None:
        write(proc / "self" / "statm", f"90000 {resident_pages} 700 300 0 5000 0\n")
    return proc


# -- the real machine -------------------------------------------------------------------------------


_RSS_PROBE = """
import json, resource
from runwatch.producer.instrument.memory import MemorySampler
MiB = 1 << 20
sampler = MemorySampler("cpu")
before = sampler.sample().host_rss
ballast = bytearray(b"\\x01") * (64 * MiB)  # written, so resident
after = sampler.sample().host_rss
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
print(json.dumps([before, after, peak]))
"""


def test_host_rss_from_real_proc_tracks_resident_memory():
    # In a fresh interpreter: in the suite's own process, threads left by earlier tests allocate and
    # free at the same time, and the difference of two samples is theirs as much as the ballast's.
    out = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    before, after, peak_rss = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0 < before
    assert after - before >= 60 * MiB
    # Never above the kernel's high-water mark, up to the per-thread RSS counters it syncs lazily.
    assert after <= peak_rss + 4 * MiB
    assert after >= 64 * MiB


def test_cpu_device_has_no_cuda_fields_and_real_sample_is_a_valid_step_field():
    stats = MemorySampler(torch.device("cpu")).sample()
    assert (stats.allocated, stats.reserved, stats.peak, stats.alloc_retries, stats.ooms) == (None,) * 5
    event = StepEvent(run_id="r", step=0, memory=stats)
    assert b'"allocated"' not in event.to_json()  # absent, not zero, on the wire


def test_real_cgroup_is_found_where_this_machine_has_one():
    files = find_cgroup_memory_files()
    if files is None:
        pytest.skip("no cgroup memory controller visible here")
    stats = MemorySampler("cpu").sample()
    assert stats.cgroup_usage is not None and stats.cgroup_usage > 0
    if stats.cgroup_limit is not None:
        assert stats.cgroup_limit < 1 << 60


# -- cgroup v2 --------------------------------------------------------------------------------------


def test_v2_limit_and_usage(tmp_path):
    proc = fake_proc(tmp_path, "0::/user.slice/run.scope\n")
    cg = tmp_path / "cgroup"
    write(cg / "user.slice" / "run.scope" / "memory.current", "123456789\n")
    write(cg / "user.slice" / "run.scope" / "memory.max", "2147483648\n")
    stats = MemorySampler("cpu", proc_root=proc, cgroup_root=cg).sample()
    assert (stats.cgroup_usage, stats.cgroup_limit, stats.host_rss) == (123456789, 2 << 30, 2500 * PAGE)


def test_v2_max_means_no_limit(tmp_path):
    proc = fake_proc(tmp_path, "0::/a\n")
    cg = tmp_path / "cgroup"
    write(cg / "a" / "memory.current", "4096\n")
    write(cg / "a" / "memory.max", "max\n")
    stats = MemorySampler("cpu", proc_root=proc, cgroup_root=cg).sample()
    assert stats.cgroup_usage == 4096
    assert stats.cgroup_limit is None


def test_v2_limit_on_an_ancestor_binds_and_its_usage_is_reported(tmp_path):
    # SLURM style: the job cgroup carries the limit, the task cgroup below it says "max".
    proc = fake_proc(tmp_path, "0::/system.slice/job_7/step_0/task_0\n")
    cg = tmp_path / "cgroup"
    job = cg / "system.slice" / "job_7"
    write(job / "memory.max", "8589934592\n")
    write(job / "memory.current", "5000000000\n")
    write(job / "step_0" / "memory.max", "max\n")
    write(job / "step_0" / "memory.current", "3000000000\n")
    write(job / "step_0" / "task_0" / "memory.max", "max\n")
    write(job / "step_0" / "task_0" / "memory.current", "2000000000\n")
    stats = MemorySampler("cpu", proc_root=proc, cgroup_root=cg).sample()
    assert (stats.cgroup_usage, stats.cgroup_limit) == (5000000000, 8 << 30)


def test_the_tightest_limit_up_the_hierarchy_wins(tmp_path):
    proc = fake_proc(tmp_path, "0::/pod/container\n")
    cg = tmp_path / "cgroup"
    write(cg / "pod" / "memory.max", "4294967296\n")
    write(cg / "pod" / "memory.current", "300\n")
    write(cg / "pod" / "container" / "memory.max", "1073741824\n")
    write(cg / "pod" / "container" / "memory.current", "200\n")
    stats = MemorySampler("cpu", proc_root=proc, cgroup_root=cg).sample()
    assert (stats.cgroup_usage, stats.cgroup_limit) == (200, 1 << 30)


def test_v2_inside_a_container_falls_back_to_the_mount_itself(tmp_path):
    # Without a cgroup namespace /proc/self/cgroup names the host path, but the container sees its
    # own cgroup mounted at the root.
    proc = fake_proc(tmp_path, "0::/kubepods/burstable/pod42/abc\n")
    cg = tmp_path / "cgroup"
    write(cg / "memory.current", "777\n")
    write(cg / "memory.max", "1000000\n")
    stats = MemorySampler("cpu", proc_root=proc, cgroup_root=cg).sample()
    assert (stats.cgroup_usage, stats.cgroup_limit) == (777, 1000000)


def test_limit_changes_are_seen_by_the_next_sample(tmp_path):
    proc = fake_proc(tmp_path, "0::/a\n")
    cg = tmp_path / "cgroup"
    write(cg / "a" / "memory.current", "10\n")
    write(cg / "a" / "memory.max", "1000\n")
    sampler = MemorySampler("cpu", proc_root=proc, cgroup_root=cg)
    assert sampler.sample().cgroup_limit == 1000
    write(cg / "a" / "memory.max", "2000\n")
    write(cg / "a" / "memory.current", "20\n")
    assert (sampler.sample().cgroup_usage, sampler.sample().cgroup_limit) == (20, 2000)


# -- cgroup v1 --------------------------------------------------------------------------------------

V1_CGROUP = "12:pids:/slurm/uid_1/job_5\n4:memory:/slurm/uid_1/job_5/step_0\n1:name=systemd:/x\n0::/\n"


def test_v1_limit_and_usage_in_a_hybrid_layout(tmp_path):
    proc = fake_proc(tmp_path, V1_CGROUP)
    cg = tmp_path / "cgroup"
    (cg / "unified").mkdir(parents=True)  # hybrid: the v2 tree exists but has no memory controller
    step = cg / "memory" / "slurm" / "uid_1" / "job_5" / "step_0"
    write(step / "memory.usage_in_bytes", "52428800\n")
    write(step / "memory.limit_in_bytes", "1073741824\n")
    write(step.parent / "memory.usage_in_bytes", "60000000\n")
    write(step.parent / "memory.limit_in_bytes", V1_UNLIMITED)
    stats = MemorySampler("cpu", proc_root=proc, cgroup_root=cg).sample()
    assert (stats.cgroup_usage, stats.cgroup_limit) == (52428800, 1 << 30)
    assert find_cgroup_memory_files(proc, cg).version == 1


def test_v1_unlimited_sentinel_is_no_limit(tmp_path):
    proc = fake_proc(tmp_path, "4:memory:/docker/abc\n")
    cg = tmp_path / "cgroup"
    own = cg / "memory" / "docker" / "abc"
    write(own / "memory.usage_in_bytes", "1234\n")
    write(own / "memory.limit_in_bytes", V1_UNLIMITED)
    write(own.parent / "memory.limit_in_bytes", "9223372036854710272\n")  # the 64 KiB-page sentinel
    write(own.parent / "memory.usage_in_bytes", "99999\n")
    stats = MemorySampler("cpu", proc_root=proc, cgroup_root=cg).sample()
    assert (stats.cgroup_usage, stats.cgroup_limit) == (1234, None)


def test_v1_controller_listed_with_others_is_recognised(tmp_path):
    proc = fake_proc(tmp_path, "3:cpu,memory:/job\n")
    cg = tmp_path / "cgroup"
    write(cg / "memory" / "job" / "memory.usage_in_bytes", "5\n")
    write(cg / "memory" / "job" / "memory.limit_in_bytes", "4096\n")
    stats = MemorySampler("cpu", proc_root=proc, cgroup_root=cg).sample()
    assert (stats.cgroup_usage, stats.cgroup_limit) == (5, 4096)


# -- missing sources -----------------------------------------------------------------------------------


def test_missing_cgroup_files_leave_those_fields_absent(tmp_path):
    proc = fake_proc(tmp_path, "0::/a\n4:memory:/a\n")
    stats = MemorySampler("cpu", proc_root=proc, cgroup_root=tmp_path / "nowhere").sample()
    assert stats == MemoryStats(host_rss=2500 * PAGE)


def test_unreadable_usage_is_absent_not_zero(tmp_path):
    proc = fake_proc(tmp_path, "0::/a\n")
    cg = tmp_path / "cgroup"
    write(cg / "a" / "memory.current", "garbage\n")
    write(cg / "a" / "memory.max", "4096\n")
    stats = MemorySampler("cpu", proc_root=proc, cgroup_root=cg).sample()
    assert (stats.cgroup_usage, stats.cgroup_limit) == (None, 4096)


def test_no_source_at_all_gives_none(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert MemorySampler("cpu", proc_root=empty, cgroup_root=empty).sample() is None


def test_missing_proc_cgroup_file_means_no_cgroup_fields(tmp_path):
    proc = tmp_path / "proc"
    write(proc / "self" / "statm", "1 2 3 4 5 6 7\n")
    stats = MemorySampler("cpu", proc_root=proc, cgroup_root=tmp_path).sample()
    assert stats == MemoryStats(host_rss=2 * PAGE)


# -- CUDA --------------------------------------------------------------------------------------------


class FakeCuda:
    """The two calls the sampler makes, with the nested layout torch.cuda.memory_stats() flattens."""

    def __init__(self, initialised: bool):
        self.initialised = initialised
        self.asked_for: list = []

    def is_initialized(self) -> bool:
        return self.initialised

    def memory_stats_as_nested_dict(self, device=None):
        self.asked_for.append(device)
        return {
            "allocated_bytes": {"all": {"current": 300, "peak": 500, "allocated": 900, "freed": 600}},
            "reserved_bytes": {"all": {"current": 1024, "peak": 1024, "allocated": 1024, "freed": 0}},
            "num_alloc_retries": 2,
            "num_ooms": 0,
        }


def test_cuda_fields_map_from_the_allocator_and_only_once_cuda_is_in_use(monkeypatch, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cuda = FakeCuda(initialised=False)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    sampler = MemorySampler("cuda:1", proc_root=empty, cgroup_root=empty)
    assert sampler.sample() is None  # CUDA not initialised: nothing to say, and nothing initialised
    cuda.initialised = True
    assert sampler.sample() == MemoryStats(allocated=300, reserved=1024, peak=500, alloc_retries=2, ooms=0)
    assert cuda.asked_for == ["cuda:1"]
    assert MemorySampler("cpu", proc_root=empty, cgroup_root=empty).sample() is None
    assert cuda.asked_for == ["cuda:1"]  # a CPU sampler never asks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocator_figures_grow_with_a_tensor_and_are_consistent():
    device = torch.device("cuda", 0)
    torch.cuda.init()
    sampler = MemorySampler(device)
    before = sampler.sample()
    tensor = torch.empty(256 * MiB, dtype=torch.uint8, device=device)
    after = sampler.sample()
    assert after.allocated - (before.allocated or 0) >= 256 * MiB
    assert after.reserved - (before.reserved or 0) >= 256 * MiB
    assert after.peak >= after.allocated
    assert after.allocated <= after.reserved
    assert after.alloc_retries is not None and after.ooms is not None
    # Same figures as torch's own accessors.
    assert after.allocated == torch.cuda.memory_allocated(device)
    assert after.reserved == torch.cuda.memory_reserved(device)
    assert after.peak == torch.cuda.max_memory_allocated(device)
    del tensor
    freed = sampler.sample()
    assert freed.allocated <= after.allocated - 256 * MiB
    assert freed.peak >= after.allocated  # the high-water mark stays
    assert MemorySampler("cuda:0").sample().allocated == freed.allocated
    assert MemorySampler(None).sample().allocated is not None  # the current device
    assert MemorySampler("cpu").sample().allocated is None
