"""A rank's heartbeat (``kind`` ``heartbeat``): its phase, and its host's load and GPU's health."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from runwatch.contract.limits import Within
from runwatch.contract.messages.base import EventBase, Phase, WireFloat, WireModel


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
    time_in_phase_s: Annotated[WireFloat, Within("max_duration_s")] = Field(default=0.0, ge=0)
    # True: this rank has done its part of the current step and waits for its peers (its gradient
    # synchronisation is launched); False: it is still working on it; absent: not measured.
    in_sync: bool | None = None
    # The producer's heartbeat period: the worker calls a rank silent (dead) after a number of
    # missed periods rather than one fixed time; absent: only the configured floor applies.
    interval_s: Annotated[WireFloat | None, Within("max_interval_s", positive=True)] = Field(
        default=None, gt=0
    )
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
