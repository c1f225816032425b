"""Run metadata: git sha and dirty flag from a real repository, rank/world from launcher environments,
a config hash that is stable under key order, and a result that is always a valid run_start."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runwatch.contract.schema import RunStartEvent
from runwatch.producer.publish import metadata
from runwatch.producer.publish.metadata import (
    collect_run_start,
    config_hash,
    detect_rank_world,
    parse_nvidia_driver_version,
    to_jsonable,
)

LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "RUNWATCH_JOB_ID",
    "SLURM_JOB_ID",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    # git must not find a repository above tmp_path (or the developer's global config) by accident.
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "no-gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "train.py").write_text("print('hi')\n")
    git(repo, "add", "train.py")
    git(repo, "commit", "-q", "-m", "first")
    return repo


# -- git -----------------------------------------------------------------------------------------------


def test_clean_repository_gives_its_head_and_not_dirty(repo):
    fields = collect_run_start(cwd=repo)
    assert fields["git_sha"] == git(repo, "rev-parse", "HEAD")
    assert fields["git_dirty"] is False


def test_modified_tracked_file_makes_it_dirty_but_an_untracked_file_does_not(repo):
    (repo / "notes.txt").write_text("scratch\n")
    assert collect_run_start(cwd=repo)["git_dirty"] is False
    (repo / "train.py").write_text("print('changed')\n")
    fields = collect_run_start(cwd=repo)
    assert fields["git_dirty"] is True
    assert fields["git_sha"] == git(repo, "rev-parse", "HEAD")


def test_subdirectory_of_a_repository_reports_the_repository(repo):
    (repo / "sub").mkdir()
    assert collect_run_start(cwd=repo / "sub")["git_sha"] == git(repo, "rev-parse", "HEAD")


def test_outside_a_repository_git_fields_are_absent(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    fields = collect_run_start(cwd=plain)
    assert "git_sha" not in fields and "git_dirty" not in fields


def test_repository_without_commits_has_no_sha(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    git(empty, "init", "-q")
    assert "git_sha" not in collect_run_start(cwd=empty)


def test_missing_directory_and_missing_git_give_absent_fields(tmp_path, monkeypatch):
    assert "git_sha" not in collect_run_start(cwd=tmp_path / "does-not-exist")
    monkeypatch.setenv("PATH", str(tmp_path))  # no git, no nvidia-smi
    fields = collect_run_start(cwd=tmp_path)
    assert "git_sha" not in fields and "git_dirty" not in fields
    RunStartEvent(run_id="r", **fields)


def test_status_does_not_leave_an_index_lock_or_rewrite_the_index(repo):
    index = repo / ".git" / "index"
    (repo / "train.py").touch()  # stat info changed: a plain `git status` would refresh the index
    before = index.stat().st_mtime_ns
    collect_run_start(cwd=repo)
    assert index.stat().st_mtime_ns == before
    assert not (repo / ".git" / "index.lock").exists()


# -- rank and world size -----------------------------------------------------------------------------


def test_no_launcher_means_a_single_process():
    assert detect_rank_world() == (0, 1)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"RANK": "3", "WORLD_SIZE": "8"}, (3, 8)),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16"}, (5, 16)),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, (1, 2)),
        ({"RANK": "2", "WORLD_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (2, 4)),  # torchrun wins
        ({"RANK": "2", "SLURM_PROCID": "7", "SLURM_NTASKS": "8"}, (7, 8)),  # half a pair is skipped
        ({"RANK": "x", "WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3"}, (0, 3)),
        ({"RANK": "4", "WORLD_SIZE": "4"}, (0, 1)),  # rank out of range: not trusted
    ],
)
def test_rank_and_world_come_from_the_launcher_environment(monkeypatch, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert detect_rank_world() == expected


def test_world_size_defaults_to_the_detected_one_and_can_be_given(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "32")
    assert collect_run_start()["world_size"] == 32
    assert collect_run_start(world_size=4)["world_size"] == 4
    assert collect_run_start(world_size=0)["world_size"] == 32  # invalid: fall back, never raise


# -- config --------------------------------------------------------------------------------------------


def test_config_hash_is_stable_under_key_order_and_changes_with_values():
    a = {"lr": 3e-4, "model": {"layers": 12, "heads": 8}, "tags": ["x", "y"]}
    b = {"tags": ["x", "y"], "model": {"heads": 8, "layers": 12}, "lr": 3e-4}
    assert config_hash(a) == config_hash(b)
    assert len(config_hash(a)) == 16 and int(config_hash(a), 16) >= 0
    assert config_hash(a) != config_hash({**a, "lr": 1e-4})
    assert config_hash(a) != config_hash({**a, "model": {"layers": 24, "heads": 8}})
    assert config_hash(a) != config_hash({**a, "tags": ["y", "x"]})  # list order is meaningful


def test_config_hash_is_the_documented_canonical_sha256():
    import hashlib

    config = {"b": 1, "a": [1, 2.5, None, True]}
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    assert config_hash(config) == hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclasses.dataclass
class OptimConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)


def test_config_values_become_json_types():
    config = {
        "path": Path("/data/shard"),
        "optim": OptimConfig(),
        "args": argparse.Namespace(batch=32),
        "ids": {3, 1, 2},
        "dtype": torch.bfloat16,
        "scale": torch.tensor(0.5),
        "device_ids": (0, 1),
        7: "int key",
        "nan": math.nan,
        "fn": print,
    }
    fields = collect_run_start(config=config)
    out = fields["config"]
    assert out["path"] == "/data/shard"
    assert out["optim"] == {"lr": 1e-3, "betas": [0.9, 0.95]}
    assert out["args"] == {"batch": 32}
    assert out["ids"] == [1, 2, 3]
    assert out["dtype"] == "torch.bfloat16"
    assert out["scale"] == 0.5
    assert out["device_ids"] == [0, 1]
    assert out["7"] == "int key"
    assert isinstance(out["fn"], str)
    json.dumps(out)  # serialisable without a default=
    event = RunStartEvent(run_id="r", **fields)
    assert b'"nan":"NaN"' in event.to_json()
    assert fields["config_hash"] == config_hash(config)


def test_a_dataclass_or_namespace_config_is_taken_as_its_fields():
    assert collect_run_start(config=OptimConfig())["config"] == {"lr": 1e-3, "betas": [0.9, 0.95]}
    assert collect_run_start(config=argparse.Namespace(lr=0.1))["config"] == {"lr": 0.1}


def test_a_cyclic_config_is_cut_off_not_a_crash():
    config: dict = {"a": 1}
    config["self"] = config
    fields = collect_run_start(config=config)
    assert fields["config"]["a"] == 1
    RunStartEvent(run_id="r", **fields)


def test_a_config_that_is_not_a_mapping_is_absent():
    fields = collect_run_start(config=[1, 2, 3])
    assert "config" not in fields and "config_hash" not in fields


def test_to_jsonable_leaves_json_values_alone():
    value = {"a": [1, 2.5, "x", None, False, {"b": []}]}
    assert to_jsonable(value) == value


# -- the whole event -----------------------------------------------------------------------------------


def test_result_validates_as_run_start_with_every_argument(repo, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "991")
    fields = collect_run_start(
        world_size=8,
        config={"lr": 1e-3},
        seed=1234,
        dataset_version="v2024-05",
        tags={"team": "nlp", "attempt": 2},
        baseline_key="gpt-small",
        cwd=repo,
    )
    event = RunStartEvent(run_id="r", **fields)
    assert (event.job_id, event.baseline_key, event.world_size, event.seed) == ("991", "gpt-small", 8, 1234)
    assert event.dataset_version == "v2024-05"
    assert event.tags == {"team": "nlp", "attempt": "2"}
    assert event.config == {"lr": 1e-3} and event.config_hash == config_hash({"lr": 1e-3})
    assert event.host and event.torch_version == str(torch.__version__)
    assert event.cuda_version == torch.version.cuda
    if torch.cuda.is_available():
        assert event.gpu_names == [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    else:
        assert "gpu_names" not in fields  # absent, not an empty list


def test_minimal_result_validates_and_leaves_out_what_was_not_given(tmp_path):
    fields = collect_run_start(cwd=tmp_path)
    RunStartEvent(run_id="r", **fields)
    for name in ("job_id", "baseline_key", "config", "config_hash", "seed", "dataset_version", "tags"):
        assert name not in fields
    assert None not in fields.values()


def test_job_id_prefers_explicit_then_runwatch_then_slurm(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "slurm-1")
    assert collect_run_start()["job_id"] == "slurm-1"
    monkeypatch.setenv("RUNWATCH_JOB_ID", "rw-2")
    assert collect_run_start()["job_id"] == "rw-2"
    assert collect_run_start(job_id="given-3")["job_id"] == "given-3"


def test_bad_seed_and_tags_are_absent_not_raised():
    fields = collect_run_start(seed="not a number", tags=["not", "a", "mapping"])
    assert "seed" not in fields and "tags" not in fields
    assert collect_run_start(seed=torch.tensor(7))["seed"] == 7


# -- driver and torch versions without importing or initialising anything ------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
            "GCC version:  gcc version 12.2.0\n",
            "535.104.05",
        ),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for "
            "x86_64  550.54.15  Release Build  (dvs-builder)\n",
            "550.54.15",
        ),
        ("NVRM version: NVIDIA UNIX aarch64 Kernel Module  570.86.10  Thu Jan 30 2025\n", "570.86.10"),
        ("garbage\n", None),
    ],
)
def test_driver_version_file_parsing(text, expected):
    assert parse_nvidia_driver_version(text) == expected


def test_driver_version_from_nvidia_smi_when_the_proc_file_is_missing(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\necho '550.54.15, NVIDIA H100 80GB HBM3'\necho '550.54.15, NVIDIA H100 80GB HBM3'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    monkeypatch.setattr(metadata, "NVIDIA_DRIVER_VERSION_FILE", str(tmp_path / "missing"))
    assert collect_run_start()["driver_version"] == "550.54.15"


def test_a_hanging_nvidia_smi_is_cut_off(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    monkeypatch.setattr(metadata, "NVIDIA_DRIVER_VERSION_FILE", str(tmp_path / "missing"))
    monkeypatch.setattr(metadata, "NVIDIA_SMI_TIMEOUT_S", 0.2)
    fields = collect_run_start()
    assert "driver_version" not in fields


def test_gpu_names_from_nvidia_smi_follow_cuda_visible_devices():
    names = ["GPU0", "GPU1", "GPU2"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "2,0")
        assert metadata._visible_gpus(names) == ["GPU2", "GPU0"]
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        assert metadata._visible_gpus(names) == []
        mp.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f3c")
        assert metadata._visible_gpus(names) == names
        mp.delenv("CUDA_VISIBLE_DEVICES")
        assert metadata._visible_gpus(names) == names


def test_torch_versions_read_without_importing_torch_match_the_imported_ones():
    assert metadata._torch_versions_without_import() == (str(torch.__version__), torch.version.cuda)


def test_collect_does_not_import_torch_when_the_job_has_not():
    code = (
        "import sys; from runwatch.producer.publish.metadata import collect_run_start;"
        "before = 'torch' in sys.modules; f = collect_run_start();"
        "print(before, 'torch' in sys.modules, f['torch_version'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    before, after, version = out.stdout.split()
    if before == "True":
        pytest.skip("importing runwatch.producer already imports torch")
    assert after == "False"
    assert version == str(torch.__version__)
