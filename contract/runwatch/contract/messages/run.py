"""The events that frame a run: its start, evals, checkpoints, action acknowledgements, its end, and a
worker's report of one rank group of a split run."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from runwatch.contract.action_kinds import ActionKind
from runwatch.contract.limits import Within
from runwatch.contract.messages.base import EventBase, WireFloat


class RunStartEvent(EventBase):
    kind: Literal["run_start"] = "run_start"
    # One attempt of the run: a requeued or restarted job keeps its run id and sends a new attempt, which
    # the worker watches as a fresh run; actions carry the attempt they were issued for.
    attempt: str | None = Field(default=None, min_length=1, max_length=128)
    job_id: str | None = None
    baseline_key: str | None = None
    git_sha: str | None = None
    git_dirty: bool | None = None
    host: str | None = None
    world_size: int = Field(default=1, ge=1)
    torch_version: str | None = None
    cuda_version: str | None = None
    driver_version: str | None = None
    gpu_names: list[str] = Field(default_factory=list)
    config: dict[str, Any] = Field(default_factory=dict)
    config_hash: str | None = None
    seed: int | None = None
    dataset_version: str | None = None
    tags: dict[str, str] = Field(default_factory=dict)


class EvalEvent(EventBase):
    kind: Literal["eval"] = "eval"
    step: int = Field(ge=0)
    split: str = "val"
    loss: WireFloat | None = None
    metrics: dict[str, WireFloat] = Field(default_factory=dict)
    per_category: dict[str, dict[str, WireFloat]] = Field(default_factory=dict)


class CheckpointEvent(EventBase):
    kind: Literal["checkpoint"] = "checkpoint"
    step: int = Field(ge=0)
    uri: str = Field(min_length=1)
    ok: bool = True
    # Each param group's LR when it was saved, without runwatch's rollback scale: a rollback to this
    # checkpoint sets the LR to this times the action's lr_scale. Absent: not known.
    lr: Annotated[list[WireFloat] | None, Within("max_rate")] = None


class ActionAckEvent(EventBase):
    kind: Literal["action_ack"] = "action_ack"
    action_id: str = Field(min_length=1)
    action_kind: ActionKind | None = None
    outcome: Literal["applied", "ignored", "failed"]
    detail: str | None = None
    step: int | None = None
    to_step: int | None = None


class RunEndEvent(EventBase):
    kind: Literal["run_end"] = "run_end"
    status: Literal["completed", "failed", "stopped", "interrupted"] = "completed"
    summary: dict[str, float | int | str | None] = Field(default_factory=dict)


class GroupReport(EventBase):
    """A worker's report of one rank group of a split run to the worker that merges the run (issue 36),
    keyed by the run id. ``body``: JSON text of the report's items in the group's order (a step's partial,
    a finding for the run's policy, a run-level event of one of the group's ranks); ``signature``: the
    workers' Ed25519 signature over it (``ActionSigningKey.sign_report``). Nothing a trainer holds can sign
    one: a report that does not verify is dead-lettered, never merged."""

    kind: Literal["group_report"] = "group_report"
    group: int = Field(ge=0)
    body: str
    signature: str
