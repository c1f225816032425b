"""The wire contract: every message on every runwatch topic, defined once.

Messages are JSON (orjson) objects. Telemetry events are discriminated by ``kind``.
Non-finite floats travel as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``
because JSON has no literal for them and a NaN loss is exactly what we must not lose.
Unknown fields from a newer producer are kept (``extra="allow"``); a missing required
field is a validation error, which the worker routes to the dead-letter topic.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from runwatch.contract import groups, topics
from runwatch.contract.action_kinds import ActionKind

SCHEMA_VERSION = 1

Phase = Literal["train", "eval", "checkpoint", "dataload", "idle"]
Severity = Literal["info", "warning", "critical"]

SEVERITY_RANK: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}

# A run id: ASCII letters, digits and ``. _ - : / @ + =``, at most RUN_ID_MAX_CHARS. It is the Kafka key,
# part of state keys, log lines, chat messages and command lines: nothing in it may read as markup,
# whitespace or a control character.
RUN_ID_MAX_CHARS = 256
_RUN_ID = re.compile(r"[A-Za-z0-9._:/@+=-]+", re.ASCII)


def run_id_problem(run_id: str, max_chars: int = RUN_ID_MAX_CHARS) -> str | None:
    """Why ``run_id`` is not a valid run id, or None."""
    if not run_id:
        return "run_id: empty"
    if len(run_id) > max_chars:
        return f"run_id: {len(run_id)} characters (limit {max_chars})"
    if not _RUN_ID.fullmatch(run_id):
        bad = next(c for c in run_id if not _RUN_ID.fullmatch(c))
        return (
            f"run_id: {bad!r} at position {run_id.index(bad)} is outside the run id characters "
            "(ASCII letters, digits and . _ - : / @ + =)"
        )
    return None


def utc_now() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


class WireModel(BaseModel):
    """Base of every wire message: keeps unknown fields, writes NaN/Inf as strings."""

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="strings", populate_by_name=True)

    def to_json(self) -> bytes:
        # pydantic's serializer, not orjson: orjson writes NaN as null, which would erase
        # the very non-finite loss a detector must see. Decoding uses orjson.
        return self.model_dump_json(exclude_none=True).encode()


def _parse_time(value: Any) -> Any:
    """ISO 8601 text to a datetime (strict decoding takes no other form); datetimes pass."""
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"not an ISO 8601 time: {value[:40]!r}") from None
    return value


def _wire_float(value: Any) -> Any:
    """The strings that stand for non-finite floats on the wire; everything else as it is."""
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    return value


_NONFINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}
# A float on the wire: a JSON number, or "NaN"/"Infinity"/"-Infinity" (never other text).
WireFloat = Annotated[float, BeforeValidator(_wire_float)]
WireTime = Annotated[datetime, BeforeValidator(_parse_time)]


class EventBase(WireModel):
    schema_version: int = SCHEMA_VERSION
    event_id: str = Field(default_factory=new_id, min_length=1)
    run_id: str = Field(min_length=1)
    rank: int = Field(default=0, ge=0)
    ts: WireTime = Field(default_factory=utc_now)
    # A run split by rank group (groups.py, issue 36): every event of its ranks says the group size and
    # the world size, and is keyed ``<run id>#<rank // group_size>``. Absent: the run is one group, keyed by
    # its run id (every producer before the split).
    group_size: int | None = Field(default=None, ge=1, le=groups.MAX_GROUP_SIZE)
    world_size: int | None = Field(default=None, ge=1)


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


class CategoryLoss(WireModel):
    """One category's loss in a step or eval. Optional spread (``category_loss`` fills both, issue 37):
    ``sumsq``, the count times the category's weighted mean of squared per-sample losses (without
    weights, their plain sum of squares: ``sumsq / count - mean**2`` is the variance, and sums merge
    across ranks); ``tail_count``, its samples above the batch's 90th percentile of per-sample loss."""

    mean: WireFloat
    count: int = Field(ge=0)
    sumsq: WireFloat | None = None
    tail_count: int | None = Field(default=None, ge=0)


class ActivationStats(WireModel):
    """One module's output on a sampled step (``rw.watch(..., activations=True)``, instrument/activations.py):
    ``rms`` the root mean square of its entries, ``zero_frac`` the fraction exactly 0 (dead units, for a
    ReLU-like output), over the step's training-mode forward calls."""

    rms: WireFloat
    zero_frac: WireFloat = Field(ge=0, le=1)


class RankExtreme(WireModel):
    """The rank with the largest figure of a joined step (issue 38): its ``rank``, its ``value`` and the
    other ranks' ``others`` (the mean of their losses; the root mean square of their gradient norms), so a
    spike of one rank is judged as that rank's, not averaged away in the joined mean. Set by the worker's
    join on the joined step only; a rank's own step event has none."""

    rank: int = Field(ge=0)
    value: WireFloat
    others: WireFloat
    ranks: int = Field(ge=2, description="ranks whose figures the step combined")


class DigestGroup(WireModel):
    """The ranks of one joined step whose ``param_digest`` is ``digest``: how many, and the lowest few."""

    digest: str
    count: int = Field(ge=1)
    ranks: list[int] = Field(default_factory=list)


class ReplicaDigests(WireModel):
    """A joined step's parameter digests by value, largest group first (at most ``DIGEST_GROUPS``; the
    ranks of the rest are counted in ``other``)."""

    groups: list[DigestGroup] = Field(default_factory=list)
    other: int = Field(default=0, ge=0)


DIGEST_GROUPS = 8  # the digest groups a joined step keeps
DIGEST_RANKS_LISTED = 8  # and the ranks it names in each


class MemoryStats(WireModel):
    """Bytes. A source that is not available is absent, never zero."""

    allocated: int | None = None
    reserved: int | None = None
    peak: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    host_rss: int | None = None
    cgroup_usage: int | None = None
    cgroup_limit: int | None = None
    device_total: int | None = None  # CUDA device capacity: the limit allocated/reserved grow towards


# Why the trainer's step guard skipped an update (StepEvent.update_skipped)
UpdateSkipped = Literal["nonfinite", "grad_spike"]
# What is wrong with the producer's own instrumentation (StepEvent.instrumentation)
Instrumentation = Literal["optimizer_not_stepping"]


class StepEvent(EventBase):
    kind: Literal["step"] = "step"
    step: int = Field(ge=0)
    loss: WireFloat | None = None
    lr: list[WireFloat] = Field(default_factory=list)
    grad_norm: WireFloat | None = None
    grad_norm_clipped: WireFloat | None = None
    clip_ratio: WireFloat | None = None
    param_norm: WireFloat | None = None
    update_norm: WireFloat | None = None
    relative_update_norm: WireFloat | None = None
    effective_lr_ratio: WireFloat | None = None
    module_grad_norms: dict[str, WireFloat] = Field(default_factory=dict)
    category_loss: dict[str, CategoryLoss] = Field(default_factory=dict)
    # Per leaf module, on the steps the activation probe samples (every ``activations_every`` steps;
    # absent on the others and when ``activations`` is off): its output's RMS and fraction of exact
    # zeros. At most ``WireLimits.max_modules`` entries, like module_grad_norms.
    module_activations: dict[str, ActivationStats] = Field(default_factory=dict)
    step_time_s: WireFloat | None = None
    data_wait_s: WireFloat | None = None
    samples_per_s: WireFloat | None = None
    tokens_per_s: WireFloat | None = None
    mfu: WireFloat | None = None
    memory: MemoryStats | None = None
    nonfinite_grads: int | None = Field(default=None, ge=0)
    # True: grad_norm, grad_norm_clipped, module_grad_norms, param_norm and update_norm cover only
    # this rank's shard of the parameters (FSDP/ZeRO style); the worker's cross-rank join takes the
    # root of the sum of squares. Absent/False: every rank holds the full (replicated) figures.
    grad_sharded: bool | None = None
    # Seconds of this rank's own work in the step (from the step's start until it was ready to
    # synchronise gradients with its peers), without the time spent waiting for slower peers.
    # What straggler detection compares; absent where it is not measured.
    compute_s: WireFloat | None = Field(default=None, ge=0)
    # The trainer's step guard skipped this step's update before it landed (instrument/guard.py): its
    # gradient was not finite, or its norm an outlier of the recent band. Absent: the update was applied.
    update_skipped: UpdateSkipped | None = None
    # A rollback's LR scale in force in this step's update (held in every step, then returned to 1:
    # publish/lr_hold.py); absent at 1.
    lr_scale: WireFloat | None = Field(default=None, gt=0, le=1)
    # The watcher's instrumentation has lost its hold on the run. ``optimizer_not_stepping``: the
    # optimizer given to rw.watch has not stepped for 3+ steps in a row while the model had gradients
    # (the loop most likely replaced it without calling rw.watch again): the step carries no gradient,
    # weight or update figures, and its LR is the old optimizer's. Absent: instrumented as watched.
    instrumentation: Instrumentation | None = None
    # The joined step's rank with the largest loss and gradient norm, against the other ranks (the
    # worker's join sets it; a rank's own event has none): keyed by the metric, ``loss`` or ``grad_norm``.
    rank_extremes: dict[str, RankExtreme] | None = None
    # An exact digest of this rank's parameters' bits (producer/runwatch/producer/instrument/fingerprint.py),
    # every ``fingerprint_every`` steps on a data-parallel replica: replicas must agree (issue 38).
    param_digest: str | None = Field(default=None, pattern=r"^[0-9a-f]{8,64}$")
    # The joined step's replica digests, grouped (the worker's join sets it; a rank's own event has none)
    replicas: ReplicaDigests | None = None
    # Seconds of each off-step phase (eval, checkpoint, idle) since the previous step, which step_time_s
    # leaves out (issue 39: what goodput counts as checkpoint saves and evals). Absent: none, or not measured.
    off_step_s: dict[Phase, WireFloat] | None = None


class EvalEvent(EventBase):
    kind: Literal["eval"] = "eval"
    step: int = Field(ge=0)
    split: str = "val"
    loss: WireFloat | None = None
    metrics: dict[str, WireFloat] = Field(default_factory=dict)
    per_category: dict[str, dict[str, WireFloat]] = Field(default_factory=dict)


class HostLoad(WireModel):
    """How busy the rank's host was over the last heartbeat period. A figure that cannot be read
    on this host is absent, never zero. Fixed bounds (not configurable): finite, >= 0, fractions
    of the period <= 1 (``steal_frac``), counts >= 1."""

    load1: float | None = Field(
        default=None, ge=0, le=1e6, allow_inf_nan=False, description="1-minute load average (os.getloadavg)"
    )
    cpus: int | None = Field(default=None, ge=1, le=1 << 20, description="CPUs of the host (os.cpu_count)")
    steal_frac: float | None = Field(
        default=None,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="share of CPU time the hypervisor took (/proc/stat 'steal')",
    )
    process_cpu_frac: float | None = Field(
        default=None,
        ge=0,
        le=1 << 20,
        allow_inf_nan=False,
        description="this process's CPU seconds per wall second (all threads)",
    )
    cpu_wait_frac: float | None = Field(
        default=None,
        ge=0,
        le=1 << 20,
        allow_inf_nan=False,
        description="seconds this process's threads waited for a CPU per wall "
        "second (/proc/self/task/*/schedstat run delay)",
    )


GPU_REASONS_MAX = 16  # throttle reason names in one GpuHealth
GPU_REASON_CHARS = 32


class GpuHealth(WireModel):
    """What NVML says of the rank's GPU at the heartbeat (producer/runwatch/producer/instrument/gpu_health.py;
    the ``gpu`` extra, nvidia-ml-py): sampled at most once a second per device, on the heartbeat thread. A
    figure the device does not report is absent, never zero. Fixed bounds: finite, within physical ranges;
    at most ``GPU_REASONS_MAX`` throttle reason names of at most ``GPU_REASON_CHARS`` characters."""

    device: int | None = Field(default=None, ge=0, le=1 << 16, description="the rank's CUDA device ordinal")
    util_pct: float | None = Field(
        default=None, ge=0, le=100, allow_inf_nan=False, description="GPU utilisation over NVML's last period"
    )
    mem_util_pct: float | None = Field(
        default=None, ge=0, le=100, allow_inf_nan=False, description="memory controller utilisation"
    )
    sm_clock_mhz: float | None = Field(
        default=None, ge=0, le=100_000, allow_inf_nan=False, description="current SM clock"
    )
    sm_clock_max_mhz: float | None = Field(
        default=None, ge=0, le=100_000, allow_inf_nan=False, description="the SM clock's maximum"
    )
    throttle_reasons: list[
        Annotated[str, StringConstraints(min_length=1, max_length=GPU_REASON_CHARS, pattern=r"^[a-z0-9_]+$")]
    ] = Field(
        default_factory=list,
        max_length=GPU_REASONS_MAX,
        description="why the clocks are held down now (NVML clock event reasons, decoded: sw_power_cap, "
        "hw_slowdown, sw_thermal_slowdown, hw_thermal_slowdown, hw_power_brake, sync_boost, gpu_idle, ...)",
    )
    throttle_mask: int | None = Field(
        default=None, ge=0, lt=1 << 64, description="NVML's clock event reason bitmask as read"
    )
    temperature_c: float | None = Field(
        default=None, ge=-100, le=300, allow_inf_nan=False, description="GPU core temperature"
    )
    ecc_corrected: int | None = Field(
        default=None, ge=0, lt=1 << 63, description="corrected memory errors since the driver loaded"
    )
    ecc_uncorrected: int | None = Field(
        default=None, ge=0, lt=1 << 63, description="uncorrected memory errors since the driver loaded"
    )
    power_w: float | None = Field(
        default=None, ge=0, le=100_000, allow_inf_nan=False, description="board power draw"
    )
    power_limit_w: float | None = Field(
        default=None, ge=0, le=100_000, allow_inf_nan=False, description="the enforced power limit"
    )


class HeartbeatEvent(EventBase):
    kind: Literal["heartbeat"] = "heartbeat"
    step: int | None = None
    phase: Phase = "train"
    time_in_phase_s: WireFloat = Field(default=0.0, ge=0)
    # True: this rank has done its part of the current step and waits for its peers (its gradient
    # synchronisation is launched); False: it is still working on it; absent: not measured.
    in_sync: bool | None = None
    # The producer's heartbeat period: the worker calls a rank silent (dead) after a number of
    # missed periods rather than one fixed time; absent: only the configured floor applies.
    interval_s: WireFloat | None = Field(default=None, gt=0)
    # The host's load over the last heartbeat period (producer/runwatch/producer/instrument/heartbeat.py):
    # what a throughput or data-wait finding is compared against, to tell a noisy neighbour from a code
    # regression.
    host_load: HostLoad | None = None
    # The rank's GPU as NVML reports it (the ``gpu`` extra): what a straggler, throughput or hung-rank finding
    # says of the rank's clocks and throttling; absent without NVML, on a CPU model, or from older producers.
    gpu: GpuHealth | None = None
    # The rank's host name, on its first heartbeat (issue 39): what maps a finding naming a rank to the
    # machine it ran on (only rank 0's run_start says its host otherwise). Absent on the others.
    host: str | None = Field(default=None, min_length=1, max_length=255)


class StackFrame(WireModel):
    """One frame of a thread's Python stack: the file, the line being run, the function; ``code``, that
    line's source text (the innermost frame's only, where the file is readable)."""

    file: str
    line: int = Field(ge=0)
    function: str
    code: str | None = None


class ThreadStack(WireModel):
    """One thread's Python stack at the capture, ``frames`` outermost first and innermost (where the thread
    is now) last. ``training``: the thread that drives the training loop (the one that built the heartbeat:
    the main thread of a plain loop); ``runwatch``: one of runwatch's own threads (the publisher, the
    action reader...). ``truncated``: the bounds cut something of it (``frames_dropped`` outermost frames,
    or a string clipped with an ellipsis)."""

    name: str = ""
    thread_id: int | None = None
    training: bool = False
    runwatch: bool = False
    frames: list[StackFrame] = Field(default_factory=list)
    frames_dropped: int = Field(default=0, ge=0)
    truncated: bool = False


EvidenceReason = Literal["no_progress", "requested"]
StackSource = Literal["current_frames", "faulthandler"]


class StackEvidenceEvent(EventBase):
    """What a rank whose steps stopped was doing (``kind`` ``evidence``): the Python stack of every thread
    of its process, captured by its heartbeat thread (instrument/stacks.py), and PyTorch's flight recorder
    dump where it is on. Bounded (``bound_evidence``): at most ``WireLimits.max_evidence_threads`` threads
    (the training thread always kept), ``max_evidence_frames`` innermost frames each, strings clipped
    (``EVIDENCE_STRING_CHARS``), and ``max_evidence_bytes`` as JSON, the flight recorder's text cut first;
    what was cut is marked (``truncated``, ``threads_dropped``, each thread's ``frames_dropped``). A worker
    given one over its bounds truncates it the same way: it is never refused for its size alone (only a
    message over ``max_message_bytes`` is, as any kind)."""

    kind: Literal["evidence"] = "evidence"
    step: int | None = Field(default=None, ge=0)  # the last completed step
    reason: EvidenceReason = "no_progress"
    phase: Phase = "train"
    seconds_since_step: WireFloat | None = Field(default=None, ge=0)
    source: StackSource = "current_frames"
    threads: list[ThreadStack] = Field(default_factory=list)
    threads_dropped: int = Field(default=0, ge=0)
    truncated: bool = False
    # PyTorch's flight recorder (the ring of recent collectives: torch._C._distributed_c10d's dump, as JSON
    # text): present where it is on (TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE) and this torch
    # can dump it; ``flight_recorder_status`` says why not otherwise ("off: ...", "not available: ...").
    # Text, never executed or parsed as anything but JSON.
    flight_recorder: str | None = None
    flight_recorder_status: str | None = None


# -- crash (issue 39) ----------------------------------------------------------------------------------
CrashSource = Literal["exception", "thread_exception", "signal", "fatal_signal", "launcher"]
# A crash report's strings, in characters: the traceback and the log tail keep their end (the last lines
# say what killed it), the rest their head; what is cut is marked and ``truncated`` set, never refused.
CRASH_TEXT_CHARS = 16_384  # traceback, log_tail
CRASH_MESSAGE_CHARS = 4096
CRASH_NAME_CHARS = 256  # exception_type, host, thread


class CrashEvent(EventBase):
    """A rank's last words (``kind`` ``crash``): facts, never a class (a trainer is untrusted; the worker
    classifies them, detectors/runwatch/detectors/crash_classes.py). ``source``: who said it: the process's
    ``sys.excepthook`` (``exception``) or ``threading.excepthook`` (``thread_exception``), its SIGTERM
    handler (``signal``), or ``runwatch launch``, the supervisor that saw it die (``launcher``: the exit
    code or the signal, the faulthandler file of a fatal signal, the tail of its output). ``step``: the last
    completed step. Bounded by ``bound_crash``."""

    kind: Literal["crash"] = "crash"
    step: int | None = Field(default=None, ge=0)
    source: CrashSource = "exception"
    exception_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    signal: int | None = Field(default=None, ge=1, le=128)
    exit_code: int | None = Field(default=None, ge=-(2**31), le=2**31)
    host: str | None = None
    log_tail: str | None = None
    # The thread whose exception it was (``thread_exception``: ``threading.excepthook``'s thread name)
    thread: str | None = None
    truncated: bool = False


def clip_keep_end(text: str, limit: int, what: str) -> str:
    """``text`` within ``limit`` characters, its end kept and the cut marked at its start."""
    if len(text) <= limit:
        return text
    mark = f"[{what} truncated: the first {{}} of {len(text)} characters cut]\n"
    cut = len(text) - (limit - len(mark) - 12)
    return mark.format(cut) + text[cut:]


def clip_keep_head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + _ELLIPSIS


def bound_crash(event: CrashEvent) -> CrashEvent:
    """``event`` within the crash bounds (``CRASH_*_CHARS``), what was cut marked (``truncated``) and only
    its known fields kept when it was cut; ``event`` itself when nothing needs cutting."""
    update: dict[str, Any] = {}
    for name in ("traceback", "log_tail"):
        value = getattr(event, name)
        if value is not None and len(value) > CRASH_TEXT_CHARS:
            update[name] = clip_keep_end(value, CRASH_TEXT_CHARS, name)
    for name, limit in (("message", CRASH_MESSAGE_CHARS), ("exception_type", CRASH_NAME_CHARS)):
        value = getattr(event, name)
        if value is not None and len(value) > limit:
            update[name] = clip_keep_head(value, limit)
    for name in ("host", "thread"):
        value = getattr(event, name)
        if value is not None and len(value) > CRASH_NAME_CHARS:
            update[name] = clip_keep_head(value, CRASH_NAME_CHARS)
    if not update:
        return event
    known = {name: getattr(event, name) for name in CrashEvent.model_fields}
    return CrashEvent.model_construct(**{**known, **update, "truncated": True})


class CheckpointEvent(EventBase):
    kind: Literal["checkpoint"] = "checkpoint"
    step: int = Field(ge=0)
    uri: str = Field(min_length=1)
    ok: bool = True
    # Each param group's LR when it was saved, without runwatch's rollback scale: a rollback to this
    # checkpoint sets the LR to this times the action's lr_scale. Absent: not known.
    lr: list[WireFloat] | None = None


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


TelemetryEvent = Annotated[
    RunStartEvent
    | StepEvent
    | EvalEvent
    | HeartbeatEvent
    | CheckpointEvent
    | ActionAckEvent
    | RunEndEvent
    | StackEvidenceEvent
    | CrashEvent
    | GroupReport,
    Field(discriminator="kind"),
]
EVENT_KINDS: tuple[str, ...] = (
    "run_start",
    "step",
    "eval",
    "heartbeat",
    "checkpoint",
    "action_ack",
    "run_end",
    "evidence",
    "crash",
)
_telemetry_adapter: TypeAdapter[TelemetryEvent] = TypeAdapter(TelemetryEvent)


class Anomaly(WireModel):
    """A detector finding, as published on ``runwatch.anomalies``."""

    schema_version: int = SCHEMA_VERSION
    anomaly_id: str = Field(min_length=1)
    run_id: str = Field(min_length=1)
    step: int | None = None
    # Where the detector estimates the fault began (``step`` is where it was found); None: no estimate.
    onset_step: int | None = None
    rank: int | None = None
    detector: str
    metric: str
    value: float | None = None
    threshold: float | None = None
    score: float | None = None
    severity: Severity
    message: str
    evidence: dict[str, Any] = Field(default_factory=dict)
    ts: datetime  # the event time of what the finding is about (the step's, or the tick's)
    # When the worker produced it, by the worker's own wall clock (UTC); ``detected_at - ts`` is the
    # detection latency. None where no worker made it (offline replay): the detectors have no clock.
    detected_at: datetime | None = None


class JoinedStep(WireModel):
    """One step of a run across its ranks, as the worker's join combined it (``runwatch.joined``).

    ``reported_count`` and ``missing_count`` say how many ranks reported the step and how many did not;
    ``ranks_reported`` lists them only in a world of at most ``RANKS_LISTED`` ranks, ``ranks_missing``
    the lowest ``RANKS_LISTED`` of the missing. Gradient norms: the root of the sum of squares of the
    ranks' figures when they report shards (``grad_sharded``), else the largest (replicas agree). Loss:
    the mean over the ranks. Step time and memory: the extremes and the rank that has them.
    Throughput: the sum. ``complete`` is False when the join timed out without every rank.
    """

    schema_version: int = SCHEMA_VERSION
    run_id: str = Field(min_length=1)
    step: int = Field(ge=0)
    generation: int = Field(
        default=0, ge=0, description="rollbacks seen before this step (steps repeat after one)"
    )
    ts: datetime
    world_size: int = Field(ge=1)
    complete: bool
    # The ranks by id only while they are few (issue 36: at 16,384 ranks the full lists were 87 KB a
    # step): every reporting rank when the world is at most RANKS_LISTED, else none; the missing ranks'
    # lowest RANKS_LISTED ids. The counts are always whole (absent in a record of an older worker: the
    # lists' lengths, which were whole then).
    ranks_reported: list[int] = Field(default_factory=list)
    ranks_missing: list[int] = Field(default_factory=list)
    reported_count: int = Field(default=-1, ge=-1)
    missing_count: int = Field(default=-1, ge=-1)
    loss_mean: float | None = None
    grad_norm: float | None = None
    grad_sharded: bool = False
    step_time_max_s: float | None = None
    step_time_max_rank: int | None = None
    step_time_min_s: float | None = None
    compute_max_s: float | None = None
    compute_max_rank: int | None = None
    compute_min_s: float | None = None
    memory_max_bytes: int | None = None
    memory_max_rank: int | None = None
    memory_min_bytes: int | None = None
    memory_min_rank: int | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    late_events: int = Field(
        default=0, ge=0, description="events of this run that came after their step was joined"
    )
    duplicate_events: int = Field(default=0, ge=0, description="events of this run delivered more than once")

    @model_validator(mode="after")
    def _whole_counts(self) -> JoinedStep:
        if self.reported_count < 0:
            self.reported_count = len(self.ranks_reported)
        if self.missing_count < 0:
            self.missing_count = len(self.ranks_missing)
        return self


class CheckpointRef(WireModel):
    step: int = Field(ge=0)
    uri: str
    lr: list[WireFloat] | None = None  # as in its CheckpointEvent


def newest_checkpoint_before(
    checkpoints: list[CheckpointRef], onset_step: int | None
) -> CheckpointRef | None:
    """The rollback target both sides agree on: the newest checkpoint strictly before the onset
    (a checkpoint taken at the faulty step may already hold its damage)."""
    earlier = [c for c in checkpoints if onset_step is None or c.step < onset_step]
    return max(earlier, key=lambda c: c.step) if earlier else None


class Action(WireModel):
    """A signed instruction to the trainer and remediators, on ``runwatch.actions``."""

    schema_version: int = SCHEMA_VERSION
    action_id: str = Field(min_length=1)
    run_id: str = Field(min_length=1)
    kind: ActionKind
    reason: str
    anomaly_ids: list[str] = Field(default_factory=list)
    step: int | None = None
    onset_step: int | None = None
    target_checkpoint: CheckpointRef | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    attempt: str | None = None  # the run's attempt it was issued for (its run_start's), when it sent one
    issued_at: datetime
    expires_at: datetime
    signature: str = ""

    def body_bytes(self) -> bytes:
        """Canonical bytes the signature covers: the message as sent (no null fields, NaN/Inf
        as strings) without ``signature``, keys sorted at every level, no whitespace."""
        sent = orjson.loads(self.model_dump_json(exclude={"signature"}, exclude_none=True))
        return orjson.dumps(sent, option=orjson.OPT_SORT_KEYS)

    def is_expired(self, now: datetime) -> bool:
        return now >= self.expires_at

    def issuer_now(self, now: datetime, rank: int) -> datetime:
        """``now``, a trainer rank's clock, on the clock of the worker that issued this action: less what the
        worker measured that rank's clock to be ahead of its own and signed with the action
        (``params.clock_ahead_s``: rank -> seconds; issue 35). A trainer whose clock is minutes fast would
        otherwise find every action expired, or issued before its listener started. Only a verified
        action's word counts: call it after the signature check."""
        ahead = self.params.get(CLOCK_AHEAD_PARAM)
        seconds = ahead.get(str(rank)) if isinstance(ahead, dict) else None
        if (
            isinstance(seconds, int | float)
            and not isinstance(seconds, bool)
            and 0 < seconds <= MAX_CLOCK_AHEAD_S
        ):
            return now - timedelta(seconds=seconds)
        return now


# An action's params entry: rank (as a string) -> seconds that rank's clock is ahead of the issuing worker's
CLOCK_AHEAD_PARAM = "clock_ahead_s"
MAX_CLOCK_AHEAD_S = 86_400.0  # a record time further ahead is no clock: its events are judged as before


RANKS_LISTED = 64  # rank ids a joined step lists at most (reported: only in a world this small)
DEADLETTER_RAW_MAX_BYTES = 4096  # a dead letter carries at most this much of the message it stands for
_DEADLETTER_TEXT_MAX = 2000  # reason and traceback: enough to act on, never the message again


class DeadLetter(WireModel):
    """Why a message could not be processed: the reason, where it came from, its size and hash,
    and at most the first ``DEADLETTER_RAW_MAX_BYTES`` of it, so that a dead letter always fits
    on its topic whatever was sent. ``stage`` says who refused it: ``decode`` (the worker's
    validation), ``detector`` (an error while a detector handled a valid event: ``detector_error``)
    ``sink`` (a row ClickHouse refused) or ``budget`` (a summary of a run's events shed over its
    budget by the worker, worker/runwatch/worker/run_budget.py: no value, ``size`` 0)."""

    reason: str
    source_topic: str
    partition: int | None = None
    offset: int | None = None
    key: str | None = None
    stage: Literal["decode", "detector", "sink", "budget"] = "decode"
    size: int = Field(default=0, ge=0, description="bytes of the original message value (0 for a null value)")
    sha256: str | None = Field(
        default=None, description="hex SHA-256 of the original value; absent for a null value"
    )
    raw: str = Field(description="the first bytes of the value, as UTF-8 with replacement characters")
    raw_truncated: bool = False
    traceback: str | None = None
    ts: datetime = Field(default_factory=utc_now)

    @classmethod
    def for_message(
        cls,
        reason: str,
        raw: bytes | None,
        *,
        source_topic: str,
        partition: int | None = None,
        offset: int | None = None,
        key: bytes | None = None,
        stage: Literal["decode", "detector", "sink", "budget"] = "decode",
        traceback: str | None = None,
    ) -> DeadLetter:
        """A dead letter for ``raw`` (a message value, possibly None) that is bounded in size."""
        value = raw if raw is not None else b""
        head = value[:DEADLETTER_RAW_MAX_BYTES]
        return cls(
            reason=_clip(reason, _DEADLETTER_TEXT_MAX),
            source_topic=source_topic,
            partition=partition,
            offset=offset,
            key=_clip(key.decode(errors="replace"), 256) if key is not None else None,
            stage=stage,
            size=len(value),
            sha256=hashlib.sha256(value).hexdigest() if raw is not None else None,
            raw=head.decode(errors="replace"),
            raw_truncated=len(value) > len(head),
            traceback=_clip(traceback, 4 * _DEADLETTER_TEXT_MAX) if traceback else None,
        )


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class SchemaError(ValueError):
    """A message that is not valid runwatch JSON; ``reason`` says why in one line."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


SUPPORTED_SCHEMA_VERSIONS = frozenset({SCHEMA_VERSION})
# Present in every telemetry event, whatever its kind: a missing one is refused, never defaulted
# (a defaulted event_id would defeat deduplication, a defaulted ts or rank would lie).
REQUIRED_FIELDS = ("schema_version", "event_id", "run_id", "rank", "ts", "kind")


class WireLimits(BaseModel):
    """What the worker and the sink accept from the telemetry topic; anything outside is dead-lettered.

    One list, documented in docs/wire-format.md. Configurable under ``limits:`` in the worker's YAML.
    Times are checked against the *receive time*: the Kafka record's timestamp (the producing
    client's send time, or the broker's append time on a LogAppendTime topic), so that re-reading a
    backlog later gives the same verdicts.
    """

    model_config = ConfigDict(extra="forbid")

    max_message_bytes: int = Field(default=1_048_576, ge=1024, description="size of one message value")
    max_depth: int = Field(default=32, ge=4, le=512, description="nesting of JSON objects and arrays")
    max_string_chars: int = Field(default=4096, ge=64, description="any one string (names, uris, ids)")
    max_id_chars: int = Field(default=256, ge=16, description="run_id and event_id")
    max_modules: int = Field(
        default=10_000, ge=1, description="entries of module_grad_norms, of module_activations"
    )
    max_categories: int = Field(default=1_000, ge=1, description="entries of category_loss / per_category")
    max_metrics: int = Field(
        default=1_000, ge=1, description="entries of lr, metrics, summary, tags, gpu_names"
    )
    max_step: int = Field(default=10**12, ge=1, le=2**62, description="largest step number")
    max_world_size: int = Field(default=16_384, ge=1, le=10**6, description="largest world size; rank < this")
    max_duration_s: float = Field(
        default=7 * 86400.0, gt=0, description="step, data-wait, compute, phase times"
    )
    max_interval_s: float = Field(default=3600.0, gt=0, description="a heartbeat's declared period")
    max_memory_bytes: int = Field(default=2**50, ge=2**30, description="any memory figure (1 PiB)")
    max_rate: float = Field(default=1e12, gt=0, description="samples/s, tokens/s, a checkpoint's lr")
    max_evidence_bytes: int = Field(
        default=65_536, ge=4096, description="an evidence event as JSON (over it: truncated, never refused)"
    )
    max_evidence_threads: int = Field(default=64, ge=1, description="threads of an evidence event (...)")
    max_evidence_frames: int = Field(
        default=64, ge=1, description="frames per thread of an evidence event, the innermost kept (...)"
    )
    max_future_s: float = Field(default=300.0, ge=0, description="ts may be this far after the receive time")
    max_past_s: float = Field(
        default=7 * 86400.0, gt=0, description="ts may be this far before the receive time"
    )


DEFAULT_LIMITS = WireLimits()


def _loads(raw: bytes | str | None) -> Any:
    if raw is None:
        raise SchemaError("null value (a Kafka tombstone): a telemetry message must be a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"not JSON: {exc}") from None


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "<message>"
        parts.append(f"{loc}: {err['msg']}")
    return "schema: " + "; ".join(parts)


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests objects/arrays deeper than ``limit`` (iterative: no recursion limit)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def _longest_string(value: Any) -> int:
    """Length of the longest string (key or value) in a decoded JSON value."""
    longest, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            longest = max(longest, len(item))
        elif isinstance(item, dict):
            for k, v in item.items():
                longest = max(longest, len(k))
                stack.append(v)
        elif isinstance(item, list):
            stack.extend(item)
    return longest


# Known fields whose decoded shape is already fixed by the schema (flat maps of numbers): the
# generic depth/string walk skips them, which keeps it off the hot path of a step event.
_TYPED_FLAT = frozenset(
    {"module_grad_norms", "module_activations", "category_loss", "memory", "lr", "metrics", "per_category"}
)
_STEP_FIELDS = frozenset(StepEvent.model_fields) - {"event_id", "run_id"}
# An evidence event's own fields are bounded by truncation (bound_evidence), not refused by the walk
_EVIDENCE_FIELDS = frozenset(StackEvidenceEvent.model_fields) - {"event_id", "run_id"}
# A crash event's own strings are bounded by truncation (bound_crash), not refused by the walk
_CRASH_FIELDS = _TYPED_FLAT | (frozenset(CrashEvent.model_fields) - {"event_id", "run_id"})
# A group report's body is signed JSON text, whose events are checked again when it is opened (the message
# size bounds it)
_REPORT_FIELDS = _TYPED_FLAT | {"body"}


def _check_free_form(key: str, value: Any, lim: WireLimits) -> str | None:
    if isinstance(value, str):
        if len(value) > lim.max_string_chars:
            return f"{key}: a string of {len(value)} characters (limit {lim.max_string_chars})"
    elif isinstance(value, dict | list):
        if _depth_exceeds(value, lim.max_depth - 1):
            return f"{key}: nested deeper than {lim.max_depth} levels"
        if _longest_string(value) > lim.max_string_chars:
            return f"{key}: holds a string longer than {lim.max_string_chars} characters"
        if len(value) > lim.max_metrics and key != "config":
            return f"{key}: {len(value)} entries (limit {lim.max_metrics})"
    return None


def _check_time(ts: datetime, received_at: datetime | None, limits: WireLimits) -> str | None:
    if ts.tzinfo is None or ts.utcoffset() is None:
        return "ts: needs a timezone (ISO 8601 with Z or +00:00)"
    if received_at is None:
        return None
    ahead = (ts - received_at).total_seconds()
    if ahead > limits.max_future_s:
        return (
            f"ts: {ts.isoformat()} is {ahead:.0f} s after the receive time {received_at.isoformat()} "
            f"(allowed: {limits.max_future_s:.0f} s)"
        )
    if -ahead > limits.max_past_s:
        return (
            f"ts: {ts.isoformat()} is {-ahead:.0f} s before the receive time {received_at.isoformat()} "
            f"(allowed: {limits.max_past_s:.0f} s)"
        )
    return None


def _out_of_range(
    name: str, value: float | int | None, upper: float, *, positive: bool = False
) -> str | None:
    # One chained comparison is False for NaN, infinities and anything outside [0, upper].
    if value is None or (0 <= value <= upper and (value > 0 or not positive)):
        return None
    if value != value or value in (float("inf"), float("-inf")):
        return f"{name}: must be finite, got {value}"
    if value < 0 or (positive and value == 0):
        return f"{name}: must be {'positive' if positive else 'non-negative'}, got {value}"
    return f"{name}: {value} is above the limit {upper:g}"


def _check_limits(
    event: Any, data: dict[str, Any], received_at: datetime | None, lim: WireLimits
) -> str | None:
    """The bounds pydantic's types do not say: sizes, ranges, finiteness, the time window."""
    problem = _check_envelope(event, received_at, lim)
    if problem:
        return problem
    problem = _check_extras(event, data, lim)
    if problem:
        return problem
    step = getattr(event, "step", None)
    if step is not None and step > lim.max_step:
        return f"step: {step} is above the limit {lim.max_step}"
    check = _KIND_CHECKS.get(event.kind)
    return None if check is None else check(event, lim)


def _check_envelope(event: Any, received_at: datetime | None, lim: WireLimits) -> str | None:
    """The fields every event has: its id, run id, rank and timestamp."""
    if len(event.event_id) > lim.max_id_chars:
        return f"event_id: longer than {lim.max_id_chars} characters"
    problem = run_id_problem(event.run_id, lim.max_id_chars)
    if problem:
        return problem
    if event.rank >= lim.max_world_size:
        return f"rank: {event.rank} is not below the maximum world size {lim.max_world_size}"
    problem = _check_time(event.ts, received_at, lim)
    if problem:
        return problem
    return None


def _check_extras(event: Any, data: dict[str, Any], lim: WireLimits) -> str | None:
    """Unknown fields (kept from a newer producer) and free-form maps: nesting and string length. A step
    event's own fields are numbers and flat maps whose shape the schema fixed: only its extras are walked."""
    skip = (
        _STEP_FIELDS
        if event.kind == "step"
        else _REPORT_FIELDS
        if event.kind == "group_report"
        else _EVIDENCE_FIELDS
        if event.kind == "evidence"
        else _CRASH_FIELDS
        if event.kind == "crash"
        else _TYPED_FLAT
    )
    for key in data.keys() - skip:
        problem = _check_free_form(key, data[key], lim)
        if problem:
            return problem
    return None


def _check_heartbeat(event: HeartbeatEvent, lim: WireLimits) -> str | None:
    return _out_of_range("time_in_phase_s", event.time_in_phase_s, lim.max_duration_s) or _out_of_range(
        "interval_s", event.interval_s, lim.max_interval_s, positive=True
    )


def _check_run_start(event: RunStartEvent, lim: WireLimits) -> str | None:
    if event.world_size > lim.max_world_size:
        return f"world_size: {event.world_size} is above the limit {lim.max_world_size}"
    if len(event.gpu_names) > lim.max_metrics or len(event.tags) > lim.max_metrics:
        return f"gpu_names/tags: more than {lim.max_metrics} entries"
    return None


def _check_eval(event: EvalEvent, lim: WireLimits) -> str | None:
    if len(event.metrics) > lim.max_metrics:
        return f"metrics: {len(event.metrics)} entries (limit {lim.max_metrics})"
    if len(event.per_category) > lim.max_categories or any(
        len(m) > lim.max_metrics for m in event.per_category.values()
    ):
        return f"per_category: more than {lim.max_categories} categories or {lim.max_metrics} metrics each"
    return None


def _check_run_end(event: RunEndEvent, lim: WireLimits) -> str | None:
    if len(event.summary) > lim.max_metrics:
        return f"summary: {len(event.summary)} entries (limit {lim.max_metrics})"
    return None


def _check_checkpoint(event: CheckpointEvent, lim: WireLimits) -> str | None:
    if len(event.uri) > lim.max_string_chars:
        return f"uri: longer than {lim.max_string_chars} characters"
    if event.lr is not None:
        if len(event.lr) > lim.max_metrics:
            return f"lr: {len(event.lr)} param groups (limit {lim.max_metrics})"
        for value in event.lr:
            problem = _out_of_range("lr", value, lim.max_rate)
            if problem:
                return problem
    return None


def _check_step(event: StepEvent, lim: WireLimits) -> str | None:
    modules, categories = event.module_grad_norms, event.category_loss
    if len(modules) > lim.max_modules:
        return f"module_grad_norms: {len(modules)} modules (limit {lim.max_modules})"
    if len(event.module_activations) > lim.max_modules:
        return f"module_activations: {len(event.module_activations)} modules (limit {lim.max_modules})"
    if len(categories) > lim.max_categories:
        return f"category_loss: {len(categories)} categories (limit {lim.max_categories})"
    if len(event.lr) > lim.max_metrics:
        return f"lr: {len(event.lr)} param groups (limit {lim.max_metrics})"
    problem = (
        _out_of_range("step_time_s", event.step_time_s, lim.max_duration_s)
        or _out_of_range("data_wait_s", event.data_wait_s, lim.max_duration_s)
        or _out_of_range("compute_s", event.compute_s, lim.max_duration_s)
        or _out_of_range("samples_per_s", event.samples_per_s, lim.max_rate)
        or _out_of_range("tokens_per_s", event.tokens_per_s, lim.max_rate)
        or _out_of_range("mfu", event.mfu, 100.0)
    )
    if problem:
        return problem
    for phase, seconds in (event.off_step_s or {}).items():
        problem = _out_of_range(f"off_step_s.{phase}", seconds, lim.max_duration_s)
        if problem:
            return problem
    if event.memory is not None:
        for name, value in event.memory.__dict__.items():
            if type(value) is int and not 0 <= value <= lim.max_memory_bytes:
                return _out_of_range(f"memory.{name}", value, lim.max_memory_bytes)
    for name, cat in categories.items():
        if cat.count > 2**53:
            return f"category_loss.{name}.count: {cat.count} is above 2^53"
    if (modules and max(map(len, modules)) > lim.max_string_chars) or (
        categories and max(map(len, categories)) > lim.max_string_chars
    ):
        return f"module/category name longer than {lim.max_string_chars} characters"
    return None


def _check_evidence(event: StackEvidenceEvent, lim: WireLimits) -> str | None:
    return _out_of_range("seconds_since_step", event.seconds_since_step, lim.max_duration_s)


# The checks of one event kind's own fields, by ``kind``; kinds not here have none beyond the envelope's.
_KIND_CHECKS: dict[str, Callable[[Any, WireLimits], str | None]] = {
    "step": _check_step,
    "heartbeat": _check_heartbeat,
    "run_start": _check_run_start,
    "eval": _check_eval,
    "run_end": _check_run_end,
    "checkpoint": _check_checkpoint,
    "evidence": _check_evidence,
}


# Evidence bounds that are not configurable: one string of a frame or thread (the end of a file path says
# the most, so a path keeps its end), and the flight recorder's share of the whole.
EVIDENCE_STRING_CHARS = {"file": 512, "function": 256, "name": 128, "code": 160}
EVIDENCE_STATUS_CHARS = 256
_ELLIPSIS = "\u2026"


def _clip_start(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters, its end kept (a path's end names the file)."""
    return text if len(text) <= limit else _ELLIPSIS + text[len(text) - limit + 1 :]


def clip_flight_recorder(text: str, limit: int) -> str:
    """The flight recorder's text within ``limit`` characters, its head kept and the cut marked."""
    if len(text) <= limit:
        return text
    mark = f"{_ELLIPSIS} [flight recorder truncated: {{}} of {len(text)} characters kept]"
    keep = max(0, limit - len(mark) - 8)
    return text[:keep] + mark.format(keep)


def _bound_thread(thread: ThreadStack, max_frames: int) -> ThreadStack:
    """``thread`` with at most ``max_frames`` frames (the innermost), strings clipped, only the known fields
    of its frames; itself when it is within them."""
    frames, dropped = thread.frames, thread.frames_dropped
    if len(frames) > max_frames:
        dropped += len(frames) - max_frames
        frames = frames[len(frames) - max_frames :]
    limits = EVIDENCE_STRING_CHARS
    clipped = False
    kept: list[StackFrame] = []
    for f in frames:
        file, function = _clip_start(f.file, limits["file"]), _clip_start(f.function, limits["function"])
        code = (
            f.code
            if f.code is None or len(f.code) <= limits["code"]
            else f.code[: limits["code"] - 1] + _ELLIPSIS
        )
        same = file is f.file and function is f.function and code is f.code
        clipped = clipped or not same
        kept.append(
            f
            if same and not f.model_extra
            else StackFrame(file=file, line=f.line, function=function, code=code)
        )
    name = _clip_start(thread.name, limits["name"])
    if (
        dropped == thread.frames_dropped
        and not clipped
        and name is thread.name
        and all(a is b for a, b in zip(kept, thread.frames, strict=True))
    ):
        return thread
    return thread.model_copy(
        update={"frames": kept, "frames_dropped": dropped, "name": name, "truncated": True}
    )


def bound_evidence(event: StackEvidenceEvent, limits: WireLimits | None = None) -> StackEvidenceEvent:
    """``event`` within the evidence bounds of ``limits`` (see ``StackEvidenceEvent``), what was cut marked;
    ``event`` itself when nothing needs cutting. The producer sends what this returns, and the worker and the
    sink apply it again to what they receive (a producer of another language, a newer one with other
    bounds): an over-sized evidence event is truncated, never refused whole."""
    lim = limits if limits is not None else DEFAULT_LIMITS
    threads, dropped = list(event.threads), event.threads_dropped
    if len(threads) > lim.max_evidence_threads:
        # the training thread first, runwatch's own last, then in their order
        order = sorted(range(len(threads)), key=lambda i: (not threads[i].training, threads[i].runwatch, i))
        keep = sorted(order[: lim.max_evidence_threads])
        dropped += len(threads) - len(keep)
        threads = [threads[i] for i in keep]
    threads = [_bound_thread(t, lim.max_evidence_frames) for t in threads]
    update: dict[str, Any] = {}
    if dropped != event.threads_dropped or any(
        a is not b for a, b in zip(threads, event.threads, strict=True)
    ):
        update.update(threads=threads, threads_dropped=dropped)
    status = event.flight_recorder_status
    if status is not None and len(status) > EVIDENCE_STATUS_CHARS:
        update["flight_recorder_status"] = _clip_start(status[::-1], EVIDENCE_STATUS_CHARS)[::-1]
    recorder = event.flight_recorder
    if recorder is not None and len(recorder) > lim.max_evidence_bytes // 2:
        update["flight_recorder"] = recorder = clip_flight_recorder(recorder, lim.max_evidence_bytes // 2)
    bounded = event.model_copy(update={**update, "truncated": True}) if update else event
    size = len(bounded.to_json())
    if size <= lim.max_evidence_bytes:
        return bounded
    # Still too large: threads from the end (never the training one), then frames (the innermost kept), within
    # what the flight recorder leaves (at most half); then the flight recorder itself (multi-byte or escaped
    # text), then extra fields.
    threads = list(bounded.threads)
    sizes = [len(t.model_dump_json(exclude_none=True)) + 1 for t in threads]
    excess = size - lim.max_evidence_bytes
    for i in reversed(range(len(threads))):  # (by each thread's size: one serialisation of the whole)
        if excess <= 0:
            break
        if not threads[i].training:
            excess -= sizes[i]
            threads.pop(i)
            dropped += 1
    if len(threads) != len(bounded.threads):
        update.update(threads=threads, threads_dropped=dropped)
        bounded = event.model_copy(update={**update, "truncated": True})
        size = len(bounded.to_json())
    while size > lim.max_evidence_bytes:
        droppable = [i for i, t in enumerate(threads) if not t.training]
        if droppable:
            threads.pop(droppable[-1])
            dropped += 1
        elif max((len(t.frames) for t in threads), default=0) > 1:
            threads = [_bound_thread(t, max(1, len(t.frames) // 2)) for t in threads]
        else:
            break
        update.update(threads=threads, threads_dropped=dropped)
        bounded = event.model_copy(update={**update, "truncated": True})
        size = len(bounded.to_json())
    if size > lim.max_evidence_bytes and recorder:
        chars = max(0, len(recorder) - (size - lim.max_evidence_bytes) - 128)
        update["flight_recorder"] = clip_flight_recorder(recorder, chars) if chars > 96 else None
        bounded = event.model_copy(update={**update, "truncated": True})
        size = len(bounded.to_json())
    if size > lim.max_evidence_bytes:  # what is left is the extra fields of a newer (or hostile) producer
        known = {name: getattr(bounded, name) for name in StackEvidenceEvent.model_fields}
        bounded = StackEvidenceEvent.model_construct(**known)
    return bounded


def record_time(timestamp_s: float | None) -> datetime | None:
    """A Kafka record's timestamp (seconds since the epoch) as the UTC ``received_at`` that
    ``decode_event`` bounds ``ts`` by; None when absent or unusable (then ``ts`` is not bounded)."""
    if timestamp_s is None or not timestamp_s > 0:
        return None
    try:
        return datetime.fromtimestamp(timestamp_s, UTC)
    except (OverflowError, OSError, ValueError):
        return None


def check_record_key(key: bytes | None, partition: int | None, partitions: int | None) -> None:
    """Raise ``SchemaError`` unless a telemetry record has a key and, where the topic's partition count
    is known, sits on its key's partition (murmur2, ``topics.key_partition``). The key is the run id and
    decides the partition, hence which worker owns the run: a record without one, or elsewhere, would
    split a run's state between workers. (That the key equals the event's run id ``decode_event`` checks.)"""
    if key is None:
        raise SchemaError("key: missing (the record's key must be the run id)")
    if partitions and partition is not None:
        expected = topics.key_partition(key, partitions)
        if partition != expected:
            raise SchemaError(
                f"partition: the record is on partition {partition}, its key's partition is "
                f"{expected} of {partitions} (murmur2 of the key, the Java and kafka-python "
                "default partitioner)"
            )


def clock_ahead(
    timestamp_s: float | None, now: datetime, limits: WireLimits = DEFAULT_LIMITS
) -> float | None:
    """Seconds a sender's clock is ahead of ``now`` (the reader's), by a record time more than
    ``limits.max_future_s`` and at most ``MAX_CLOCK_AHEAD_S`` ahead of it; None otherwise. Such a record and
    its event's ``ts`` agree on a fast clock (issue 35): the worker judges the event against the record time
    and moves its time back by this much, rather than refusing every event of a trainer whose clock is
    minutes fast."""
    received = record_time(timestamp_s)
    if received is None:
        return None
    ahead = (received - now).total_seconds()
    return ahead if limits.max_future_s < ahead <= MAX_CLOCK_AHEAD_S else None


def receive_time(timestamp_s: float | None, now: datetime, limits: WireLimits = DEFAULT_LIMITS) -> datetime:
    """The ``received_at`` a consumer (the worker, the sink) checks an event's ``ts`` against: the
    Kafka record's timestamp, unless it is missing, unusable or more than ``limits.max_future_s``
    ahead of ``now`` (the reader's clock), in which case ``now``. A client sets the record time (0,
    -1, year 9999): one in the future is no send time. A past one is trusted, so that a backlog or a
    recording replayed with its timestamps keeps its verdicts."""
    received = record_time(timestamp_s)
    if received is None or (received - now).total_seconds() > limits.max_future_s:
        return now
    return received


def decode_event(
    raw: bytes | str | None,
    *,
    received_at: datetime | None = None,
    limits: WireLimits = DEFAULT_LIMITS,
    key: bytes | None = None,
) -> TelemetryEvent:
    """Parse and check one telemetry message; raises ``SchemaError`` with a one-line reason.

    Strict: every field of ``REQUIRED_FIELDS`` present, no coercion between types (a step must be
    a JSON integer, a loss a number or one of "NaN"/"Infinity"/"-Infinity", ``ts`` an ISO 8601
    string with a timezone), a supported ``schema_version``, and the bounds of ``limits``.
    ``received_at`` (the record's timestamp) bounds ``ts``; None skips that check (offline replay).
    ``key``: the Kafka key, which must be the run id (it decides the partition, hence which worker
    owns the run); None skips that check.
    """
    if raw is not None and len(raw) > limits.max_message_bytes:
        raise SchemaError(f"message of {len(raw)} bytes (limit {limits.max_message_bytes})")
    data = _loads(raw)
    if not isinstance(data, dict):
        raise SchemaError(f"schema: expected a JSON object, got {type(data).__name__}")
    missing = [name for name in REQUIRED_FIELDS if name not in data]
    if missing:
        raise SchemaError(f"schema: missing required field(s) {', '.join(missing)}")
    version = data["schema_version"]
    if type(version) is not int or version not in SUPPORTED_SCHEMA_VERSIONS:
        raise SchemaError(
            f"schema_version: {version!r} is not supported (supported: {sorted(SUPPORTED_SCHEMA_VERSIONS)})"
        )
    try:
        event = _telemetry_adapter.validate_python(data, strict=True)
    except ValidationError as exc:
        raise SchemaError(_describe(exc)) from None
    if isinstance(event, StackEvidenceEvent):
        event = bound_evidence(event, limits)  # (over its bounds: truncated with a mark, never refused)
    elif isinstance(event, CrashEvent):
        event = bound_crash(event)  # (the same: a crash report is cut, never refused for its size alone)
    problem = _check_limits(event, data, received_at, limits)
    if problem:
        raise SchemaError(f"limits: {problem}")
    if key is not None:
        problem = key_problem(key, event)
        if problem:
            raise SchemaError(problem)
    return event


def key_problem(key: bytes, event: EventBase) -> str | None:
    """Why ``key`` is not the Kafka key of ``event`` (``groups.record_key``), or None. In a split run (the
    event says ``group_size``) a rank's key names its group: a rank that claims another group, or an event
    that says a group size without the world size or a rank outside the world, is refused."""
    group_size = event.group_size
    if group_size is None or isinstance(event, GroupReport):
        if key != event.run_id.encode():
            return f"key {key[:100]!r} does not match run_id {event.run_id[:100]!r}"
        return None
    rank, world_size = event.rank, event.world_size
    if world_size is None:
        return "group_size: given without world_size (a split run's events carry both)"
    if rank >= world_size:
        return f"rank: {rank} is outside the run's world of {world_size} ranks"
    expected = groups.record_key(event.run_id, rank, group_size)
    if key == expected:
        return None
    run_id, group = groups.parse_key(key.decode(errors="replace"))
    if run_id == event.run_id and group is not None:
        return (
            f"group: rank {rank} claims group {group}; with group_size {group_size} it is in group "
            f"{groups.group_of(rank, group_size)}"
        )
    return (
        f"key {key[:100]!r} does not match run_id {event.run_id[:100]!r} and its rank's group "
        f"({expected.decode()!r})"
    )


def decode_received(
    raw: bytes | str | None,
    timestamp_s: float | None,
    now: datetime,
    limits: WireLimits = DEFAULT_LIMITS,
    key: bytes | None = None,
) -> tuple[TelemetryEvent, datetime, float | None]:
    """A telemetry record as the worker and the sink judge it: ``decode_event`` against the record's
    receive time (``receive_time``). Returns the event, that receive time on the reader's clock, and the
    seconds the sender's clock is ahead when its record time is beyond the allowance (``clock_ahead``; else
    None): such an event is judged against its record time, and its ``ts`` moved back onto the reader's
    clock by that much."""
    received = receive_time(timestamp_s, now, limits)
    ahead = clock_ahead(timestamp_s, now, limits)
    judged_at = record_time(timestamp_s) if ahead is not None else received
    event = decode_event(raw, received_at=judged_at, limits=limits, key=key)
    if ahead is not None:
        event = event.model_copy(update={"ts": event.ts - timedelta(seconds=ahead)})
    return event, received, ahead


def decode_anomaly(raw: bytes | str) -> Anomaly:
    try:
        return Anomaly.model_validate(_loads(raw))
    except ValidationError as exc:
        raise SchemaError(_describe(exc)) from None


def decode_action(raw: bytes | str) -> Action:
    try:
        return Action.model_validate(_loads(raw))
    except ValidationError as exc:
        raise SchemaError(_describe(exc)) from None


def action_expiry(issued_at: datetime, ttl_s: float) -> datetime:
    return issued_at + timedelta(seconds=ttl_s)
