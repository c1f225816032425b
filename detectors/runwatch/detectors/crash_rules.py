"""The crash classes and the ordered rules that name them (``classify`` in crash_classes.py applies them).

Specific before general: a scheduler that names its reason (``DUE TO PREEMPTION``, ``DUE TO NODE
FAILURE``) comes first, then hardware (a collective timeout whose log also has a hardware Xid is the
Xid's), a runwatch stop, out of memory (an OOM inside a DataLoader worker is an OOM), the DataLoader,
CUDA kernel faults, collectives, native crashes, the signal alone, a Python traceback, and last a
Slurm cancellation that names no reason (it is often srun ending the other tasks of a failed step).
docs/crashes.md lists every rule in this order and why. Data only: patterns, never code to run.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

CRASH_CLASSES: tuple[str, ...] = (
    "oom_host",
    "oom_device",
    "collective_timeout",
    "hardware",
    "segfault",
    "preemption",
    "dataloader",
    "nonfinite_stop",
    "user_code",
    "unknown",
)

NATIVE_CRASH_SIGNALS = frozenset({4, 6, 7, 8, 11})  # SIGILL, SIGABRT, SIGBUS, SIGFPE, SIGSEGV
SCHEDULER_SIGNALS = frozenset({10, 15})  # SIGUSR1 (Slurm's --signal warning), SIGTERM

# Xids NVIDIA documents as usually the application's fault (a kernel's bad address, a stopped
# context, the cleanup after one): alone they do not make a crash a hardware one.
APPLICATION_XIDS = frozenset({13, 31, 43, 45})


@dataclass(frozen=True)
class CrashRule:
    """One ordered rule: ``pattern`` over the text (the last match's line is the evidence; ``accept``
    may refuse a match, ``unless`` a matched line), or ``exception`` over the exception type, or one of
    ``signals``. ``explanation`` may name ``{code}`` (digits a pattern's ``code`` group matched)."""

    id: str
    crash_class: str
    explanation: str
    pattern: re.Pattern[str] | None = None
    accept: Callable[[re.Match[str]], bool] | None = None
    unless: re.Pattern[str] | None = None
    exception: re.Pattern[str] | None = None
    signals: frozenset[int] = frozenset()
    only_signals: frozenset[int] = frozenset()  # a pattern that counts only for a process ended so


def _p(*alternatives: str, flags: int = 0) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{a})" for a in alternatives), flags)


_I = re.IGNORECASE
_M = re.MULTILINE


def _hardware_xid(match: re.Match[str]) -> bool:
    return int(match.group("code") or match.group("code2")) not in APPLICATION_XIDS


# The rules, in order. Patterns never span lines ([^\n], and `.` does not match a newline) and bound
# every gap ({0,N}), so the work is linear in the text however it is crafted.
RULES: tuple[CrashRule, ...] = (
    # -- the scheduler names its reason ------------------------------------------------------------
    CrashRule(
        "slurm_preemption",
        "preemption",
        "Slurm cancelled the job to preempt it: the allocation was taken back, the code did nothing wrong.",
        _p(r"CANCELLED AT [^\n]{0,80}DUE TO PREEMPTION"),
    ),
    CrashRule(
        "slurm_time_limit",
        "preemption",
        "Slurm ended the job at its time limit: the allocation ran out, so it resumes from its checkpoint.",
        _p(r"CANCELLED AT [^\n]{0,80}DUE TO TIME LIMIT"),
    ),
    CrashRule(
        "slurm_node_failure",
        "hardware",
        "Slurm cancelled the job because a node failed: the machine, not the code.",
        _p(r"CANCELLED AT [^\n]{0,80}DUE TO NODE FAIL"),
    ),
    CrashRule(
        "k8s_eviction",
        "preemption",
        "Kubernetes evicted or preempted the pod (node pressure, a higher-priority pod, a node drain or"
        " shutdown).",
        _p(
            r"\bReason:?\s{0,8}(?:Evicted|Preempted|PreemptionByScheduler|PreemptionByKubeScheduler|"
            r"TerminationByKubelet)\b",
            r"\bThe node was low on resource\b",
            r"\bPreempted in order to admit critical pod\b",
            r"\bPod was terminated in response to imminent node shutdown\b",
            r"\bDisruptionTarget\b",
        ),
    ),
    CrashRule(
        "cloud_preemption",
        "preemption",
        "The cloud reclaimed the spot or preemptible machine.",
        _p(
            r"\bspot instance interruption\b",
            r"\binstance was preempted\b",
            r"\bcompute\.instances\.preempted\b",
            r"\bspot[- ]interruption[- ]notice\b",
            flags=_I,
        ),
    ),
    # -- hardware ----------------------------------------------------------------------------------
    CrashRule(
        "gpu_xid",
        "hardware",
        "The GPU driver reported Xid {code}, a hardware or driver fault (not one of the application-error"
        " Xids).",
        re.compile(
            r"\bXid \(PCI:[0-9A-Fa-f:.]{1,20}\): (?P<code>\d{1,3})\b"
            r"|(?i:\bXID[ =:]{1,3}(?P<code2>\d{1,3})\b)"  # (DCGM, device plugins: "XID 79", "Xid=48")
        ),
        accept=_hardware_xid,
    ),
    CrashRule(
        "ecc_uncorrectable",
        "hardware",
        "The GPU memory had an uncorrectable (double-bit) ECC error: the device, not the code.",
        _p(
            r"\buncorrectable\b[^\n]{0,40}\bECC\b",
            r"\bECC\b[^\n]{0,40}\buncorrectable\b",
            r"\bdouble[- ]bit\b[^\n]{0,40}\b(?:ECC|error)",
            r"\bDBE\b[^\n]{0,40}\bdetected\b",
            flags=_I,
        ),
    ),
    CrashRule(
        "gpu_lost",
        "hardware",
        "The GPU dropped off the bus or was lost to the driver: it needs a reset, on another host if not.",
        _p(
            r"\bfallen off the bus\b",
            r"\bGPU is lost\b",
            r"\bdevice lost\b",
            r"\bUnable to determine the device handle for GPU\b",
            r"\bGPU requires reset\b",
            flags=_I,
        ),
    ),
    CrashRule(
        "nvlink_error",
        "hardware",
        "An NVLink link failed between GPUs: the interconnect, not the code.",
        _p(r"\bNVLink\b[^\n]{0,80}\b(?:fatal|uncorrectable|error|fault|down)\b", flags=_I),
        unless=_p(r"\bNCCL INFO\b"),
    ),
    CrashRule(
        "pcie_fatal",
        "hardware",
        "The kernel logged an uncorrected PCIe error: the bus, not the code.",
        _p(r"\bPCIe Bus Error: severity=Uncorrected"),
    ),
    # -- runwatch's own stop, and other deliberate stops on non-finite values -------------------------
    CrashRule(
        "runwatch_stop",
        "nonfinite_stop",
        "runwatch's worker stopped the run (a non-finite loss or gradients it could not roll back past, "
        "or an escalated finding): a deliberate stop, not a crash to restart.",
        _p(
            r"\brunwatch: step \S{1,20}: stop (?:applied|failed)\b",
            r"\brunwatch: still running [^\n]{0,40}after a stop action\b",
        ),
    ),
    CrashRule(
        "nonfinite_halt",
        "nonfinite_stop",
        "The training code stopped itself on a NaN or Inf (a loss, gradient norm or backward output): "
        "a restart from the same state repeats it.",
        _p(
            r"\bLoss is (?:nan|inf|-inf), stopping training\b",
            r"\breturned nan values in its \d{1,3}\w{0,2} output\b",
            r"\bis non-finite, so it cannot be clipped\b",
            r"\bfound NaN in local (?:grad norm|forward loss)\b",
            r"\bloss (?:is|became) (?:nan|inf|non-finite)\b[^\n]{0,40}\b(?:stop|abort|exit)",
            flags=_I,
        ),
    ),
    # -- out of memory -----------------------------------------------------------------------------
    CrashRule(
        "cuda_oom",
        "oom_device",
        "The GPU ran out of memory (the allocator, cuBLAS or NCCL could not allocate device memory).",
        _p(
            r"\bCUDA out of memory\b",
            r"\bCUDA error: out of memory\b",
            r"(?<![\w])(?:torch\.)?(?:cuda\.)?OutOfMemoryError\b",
            r"\bCUBLAS_STATUS_ALLOC_FAILED\b",
            r"\bCUDNN_STATUS_ALLOC_FAILED\b",
            r"\bCUDA_ERROR_OUT_OF_MEMORY\b",
            r"\bcudaErrorMemoryAllocation\b",
            r"\bCuda failure 'out of memory'",
            r"\bHIP out of memory\b",
            r"\bMPS backend out of memory\b",
        ),
        exception=re.compile(r"(?:\w{1,40}\.){0,4}OutOfMemoryError"),
    ),
    CrashRule(
        "oom_killer",
        "oom_host",
        "The host ran out of memory: the kernel's or the cgroup's OOM killer killed the process.",
        _p(
            r"\bOut of memory: Kill(?:ed)? process\b",
            r"\bMemory cgroup out of memory\b",
            r"\boom-kill(?:er)?\b",
            r"\bmemory\.events\b[^\n]{0,80}\boom_kill\s{1,8}[1-9]",
            r"^\s{0,8}oom_kill\s{1,8}[1-9]",
            flags=_M,
        ),
    ),
    CrashRule(
        "scheduler_memory_limit",
        "oom_host",
        "The job went over its host memory limit and the scheduler killed it (Slurm's cgroup, Kubernetes'"
        " OOMKilled).",
        _p(
            r"\bExceeded (?:job|step) memory limit\b",
            r"\bexceeded memory limit\b",
            r"\btask \d{1,7}: Out Of Memory\b",
            r"\bOOMKilled\b",
            r"\bState:?\s{0,8}OUT_OF_MEMORY\b",  # (sacct; case-sensitive: a variable may be out_of_memory)
        ),
    ),
    CrashRule(
        "host_alloc_failed",
        "oom_host",
        "A host-memory allocation failed (Python's MemoryError, PyTorch's CPU allocator, std::bad_alloc,"
        " ENOMEM).",
        _p(
            r"\bDefaultCPUAllocator: (?:can't allocate memory|not enough memory)",
            r"(?<![\w.])(?:builtins\.)?MemoryError\b",
            r"\bstd::bad_alloc\b",
            r"\[Errno 12\] Cannot allocate memory\b",
            r"\b_ArrayMemoryError\b",  # (numpy's MemoryError subclass)
        ),
        exception=re.compile(r"(?:builtins\.)?MemoryError|(?:\w{1,40}\.){0,4}_ArrayMemoryError"),
    ),
    # -- the DataLoader ----------------------------------------------------------------------------
    CrashRule(
        "dataloader_worker",
        "dataloader",
        "A DataLoader worker process died or raised (killed by a signal, exited, out of shared memory, timed"
        " out).",
        _p(
            r"\bDataLoader worker \(pids?(?:\(s\))? [^\n]{0,120}\) "
            r"(?:is killed by signal|exited unexpectedly)",
            r"\bCaught \w{1,80} in DataLoader worker process\b",
            r"\bUnexpected (?:bus error|segmentation fault) encountered in worker\b",
            r"\binsufficient shared memory \(shm\)",
            r"\bDataLoader timed out after\b",
            r"\bPin memory thread exited unexpectedly\b",
        ),
    ),
    # -- a CUDA kernel's fault: usually the code (docs/crashes.md says why) -------------------------
    CrashRule(
        "cuda_kernel_fault",
        "user_code",
        "A CUDA kernel faulted (a device-side assert, an illegal or misaligned address): almost always an "
        "index or a kernel bug; a hardware Xid beside it would have made it hardware.",
        _p(
            r"\bdevice-side assert(?:ion)? triggered\b",
            r"\.cu:\d{1,6}: [^\n]{0,200}Assertion `",
            r"\ban illegal memory access was encountered\b",
            r"\bmisaligned address\b",
            r"\bcudaErrorIllegalAddress\b",
            r"\bunspecified launch failure\b",
        ),
    ),
    # -- collectives -------------------------------------------------------------------------------
    CrashRule(
        "nccl_watchdog_timeout",
        "collective_timeout",
        "NCCL's watchdog timed out a collective: a rank stopped joining (a hang, a dead peer, a network"
        " fault).",
        _p(
            r"\bWatchdog caught collective operation timeout\b",
            r"\bTimeout at NCCL work\b",
            r"\bSome NCCL operations have failed or timed out\b",
            r"\bwatchdog got stuck for \d{1,9} seconds\b",
            r"\bProcessGroupNCCL[^\n]{0,300}\b(?:timed out|timeout:|ran for \d{1,12} milliseconds)",
        ),
    ),
    CrashRule(
        "nccl_error",
        "collective_timeout",
        "NCCL failed in a collective (a system or network error, a remote rank gone, an aborted"
        " communicator).",
        _p(
            r"\bNCCL error\b",
            r"\bnccl(?:System|Remote|Internal|UnhandledCuda|InvalidUsage)Error\b",
            r"\bunhandled system error\b",
            r"\bremote process exiting prematurely\b",
            r"\bNCCL communicator was aborted\b",
            r"\bNCCL watchdog thread terminated\b",
            r"\bProcess group watchdog thread terminated with exception\b",
            r"\bNCCL WARN\b[^\n]{0,200}\b(?:timeout|timed out|Connection closed|Connection reset|"
            r"Got completion from peer|error|failed)\b",
            r"\[E[\d ][^\]\n]{0,60}ProcessGroupNCCL\.cpp",
        ),
    ),
    CrashRule(
        "gloo_or_socket",
        "collective_timeout",
        "A gloo or c10d socket collective timed out or lost its peer.",
        _p(
            r"\bgloo\b[^\n]{0,300}\b(?:Timed out|timed out|"
            r"Connection closed by peer|Connection reset by peer)",
            r"(?:NCCL|c10d|pair\.cc|TCPStore|ProcessGroup|Dist\w{0,20}Error)[^\n]{0,300}"
            r"Connection (?:closed|reset) by (?:remote )?peer",
            r"\bConnection (?:closed|reset) by (?:remote )?peer\b[^\n]{0,300}(?:NCCL|gloo|c10d|pair\.cc)",
        ),
    ),
    CrashRule(
        "c10d_store_timeout",
        "collective_timeout",
        "The c10d store or rendezvous timed out waiting for the other ranks.",
        _p(
            r"\bDistStoreError\b",
            r"\bDistNetworkError\b",
            r"\bRendezvousTimeoutError\b",
            r"\bSocket Timeout\b",
            r"\bwait timeout after \d{1,12}ms\b",
            r"\bTimed out after \d{1,9} seconds waiting for clients\b",
            r"\bclient socket has timed out after\b",
        ),
        exception=re.compile(
            r"(?:\w{1,40}\.){0,5}(?:DistBackendError|DistStoreError|DistNetworkError|"
            r"RendezvousTimeoutError)"
        ),
    ),
    # -- native crashes ----------------------------------------------------------------------------
    CrashRule(
        "native_crash",
        "segfault",
        "The process crashed in native code (a segfault, a bus error, an abort from C++ or glibc).",
        _p(
            r"\bSegmentation fault\b",
            r"\bFatal Python error: (?:Segmentation fault|Bus error|Illegal instruction|"
            r"Floating point exception|Aborted)",
            r"\*\*\* SIG(?:SEGV|BUS|ILL|FPE|ABRT) [^\n]{0,40}received by PID\b",
            r"\bSignal (?:11|7|4|8|6) \(SIG(?:SEGV|BUS|ILL|FPE|ABRT)\) received by PID\b",
            r"\bterminate called after throwing an instance of\b",
            r"\b(?:Bus error|Illegal instruction|Floating point exception|Aborted) \(core dumped\)",
            r"\bdouble free or corruption\b",
            r"\b(?:free|malloc|realloc|munmap_chunk)\(\): (?:invalid|corrupted)",
            r"\*\*\* stack smashing detected \*\*\*",
        ),
    ),
    # -- the signal alone (from the launcher, its exit code, or the launcher's own log) ----------------
    CrashRule(
        "fatal_signal",
        "segfault",
        "The process died of a fatal signal ({code}) and nothing more specific was said.",
        signals=NATIVE_CRASH_SIGNALS,
    ),
    CrashRule(
        "launcher_stopped_siblings",
        "unknown",
        "The launcher sent SIGTERM to this worker because another one failed: classify that one's crash.",
        _p(r"\bSending process \d{1,9} closing signal SIGTERM\b"),
        only_signals=frozenset({15}),  # (the launcher logs it for every sibling of a failed worker)
    ),
    CrashRule(
        "sigterm",
        "preemption",
        "The process was sent {code}, as a scheduler does to preempt or end a job, and nothing more specific"
        " was said.",
        signals=SCHEDULER_SIGNALS,
    ),
    CrashRule(
        "sigterm_logged",
        "preemption",
        "The log says the process (or its launcher) received SIGTERM, as a scheduler sends to preempt a job.",
        _p(
            r"\bReceived Signals\.SIGTERM death signal\b",
            r"\bSignalException: Process \d{1,9} got signal: 15\b",
            r"\bReceived SIGTERM\b",
            r"\bgot SIGTERM\b",
            r"\bHandling auto-requeue signal\b",
        ),
    ),
    CrashRule(
        "sigkill_unexplained",
        "unknown",
        "The process was killed by SIGKILL, and nothing says who (the OOM killer would have logged it; a "
        "scheduler's grace period ending would too).",
        signals=frozenset({9}),
    ),
    # -- Python -------------------------------------------------------------------------------------
    CrashRule(
        "keyboard_interrupt",
        "user_code",
        "The process was interrupted (SIGINT, Ctrl-C): someone stopped it on purpose.",
        exception=re.compile(r"KeyboardInterrupt"),
    ),
    CrashRule(
        "python_exception",
        "user_code",
        "A Python exception ended the process, and it names none of the infrastructure's failures: the"
        " code's error.",
    ),
    # -- last: a cancellation that names no reason ----------------------------------------------------
    CrashRule(
        "slurm_cancelled",
        "preemption",
        "Slurm cancelled the job or step without naming why (scancel, or the scheduler); nothing else was"
        " said.",
        _p(r"\*\*\* (?:JOB|STEP) [^\n]{0,80}CANCELLED AT\b"),
    ),
)
