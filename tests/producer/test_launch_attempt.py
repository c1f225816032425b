"""Every rank of one launch names the same attempt from its launcher's variables, and a requeue or restart
names another (issue 35, item 9: ranks 1..N of a requeued job without rank sync re-applied the old stop)."""

from __future__ import annotations

import pytest

from runwatch.producer.publish.run_watch import launch_attempt, resolve_attempt


def test_slurm_and_torchelastic_name_the_launch_and_its_restarts():
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"}
    assert launch_attempt(slurm) == "slurm-4242.0"
    assert launch_attempt({**slurm, "SLURM_RESTART_COUNT": "1"}) == "slurm-4242.1"  # requeued
    assert launch_attempt({"SLURM_JOB_ID": "4242"}) == "slurm-4242.0"  # (a first launch sets no count)
    elastic = {"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert launch_attempt(elastic) == "torchelastic-abc.2"
    assert launch_attempt({**slurm, **elastic}) == "slurm-4242.0+torchelastic-abc.2"
    assert launch_attempt({}) is None
    assert len(launch_attempt({"SLURM_JOB_ID": "x" * 500}) or "") == 128


@pytest.mark.parametrize("rank", [0, 1, 7])
def test_every_rank_resolves_the_launch_s_attempt(monkeypatch, rank):
    monkeypatch.delenv("RUNWATCH_ATTEMPT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert resolve_attempt(None, rank) == "slurm-77.3"
    monkeypatch.setenv("RUNWATCH_ATTEMPT", "mine")  # (the explicit setting wins)
    assert resolve_attempt(None, rank) == "mine"
    assert resolve_attempt("given", rank) == "given"


def test_without_a_launcher_only_rank_0_names_one(monkeypatch):
    for name in ("RUNWATCH_ATTEMPT", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    assert resolve_attempt(None, 0)
    assert resolve_attempt(None, 1) is None
