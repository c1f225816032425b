"""What a crash was: ordered, explainable rules over the last words of a dead training process.

The worker calls :func:`classify` with everything the crash said (the exception and its traceback, a
fatal signal's dump, the tail of the log the launcher passed) and what a launcher knows for certain
(the signal that ended the process, its exit code, the exception type an ``excepthook`` saw). The
rules run in order and the first that matches decides; each has an id, and the verdict carries the
line it matched, so a person can check it (docs/crashes.md lists every rule in this order and why).

Specific before general: a scheduler that names its reason (``DUE TO PREEMPTION``, ``DUE TO NODE
FAILURE``) comes first, then hardware (a collective timeout whose log also has a hardware Xid is the
Xid's), a runwatch stop, out of memory (an OOM inside a DataLoader worker is an OOM), the DataLoader,
CUDA kernel faults, collectives, native crashes, the signal alone, a Python traceback, and last a
Slurm cancellation that names no reason (it is often srun ending the other tasks of a failed step).

The input is untrusted (trainers, and whatever their logs quote): the work is bounded (the first
16 KiB and the last 64 KiB are scanned, each line cut to 4 KiB, and every pattern is free of nested
repetition, so no input backtracks catastrophically), nothing in it is ever evaluated, and the
evidence line comes back as plain text with control and formatting characters escaped. Pure: no I/O,
no clock.
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

HEAD_CHARS = 16 * 1024  # the start of a log: a crash that logs its cause early, then hangs in teardown
TAIL_CHARS = 64 * 1024  # the end: where the last words are
LINE_CHARS = 4 * 1024  # one line, for matching (a JSON log may hold a whole traceback on one line)
EVIDENCE_CHARS = 300
EXCEPTION_TYPE_CHARS = 200

# Linux numbering: launchers report the number the kernel gave them.
SIGNAL_NAMES = {
    1: "SIGHUP",
    2: "SIGINT",
    3: "SIGQUIT",
    4: "SIGILL",
    5: "SIGTRAP",
    6: "SIGABRT",
    7: "SIGBUS",
    8: "SIGFPE",
    9: "SIGKILL",
    10: "SIGUSR1",
    11: "SIGSEGV",
    12: "SIGUSR2",
    13: "SIGPIPE",
    14: "SIGALRM",
    15: "SIGTERM",
}
NATIVE_CRASH_SIGNALS = frozenset({4, 6, 7, 8, 11})  # SIGILL, SIGABRT, SIGBUS, SIGFPE, SIGSEGV
SCHEDULER_SIGNALS = frozenset({10, 15})  # SIGUSR1 (Slurm's --signal warning), SIGTERM

# Xids NVIDIA documents as usually the application's fault (a kernel's bad address, a stopped
# context, the cleanup after one): alone they do not make a crash a hardware one.
APPLICATION_XIDS = frozenset({13, 31, 43, 45})


@dataclass(frozen=True)
class CrashVerdict:
    """The class of a crash, the id of the rule that decided it, the line (or signal) it matched,
    and one sentence saying why."""

    crash_class: str
    rule: str
    evidence_line: str
    explanation: str


@dataclass(frozen=True)
class _Facts:
    """What one crash said, bounded: the scanned text, and what the launcher knew."""

    text: str
    exception_type: str | None
    signal: int | None  # the signal that ended the process, from the launcher or its exit code
    signal_source: str  # "signal", "exit code N" or "" (none known)
    exit_code: int | None = None


@dataclass(frozen=True)
class _Rule:
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
RULES: tuple[_Rule, ...] = (
    # -- the scheduler names its reason ------------------------------------------------------------
    _Rule(
        "slurm_preemption",
        "preemption",
        "Slurm cancelled the job to preempt it: the allocation was taken back, the code did nothing wrong.",
        _p(r"CANCELLED AT [^\n]{0,80}DUE TO PREEMPTION"),
    ),
    _Rule(
        "slurm_time_limit",
        "preemption",
        "Slurm ended the job at its time limit: the allocation ran out, so it resumes from its checkpoint.",
        _p(r"CANCELLED AT [^\n]{0,80}DUE TO TIME LIMIT"),
    ),
    _Rule(
        "slurm_node_failure",
        "hardware",
        "Slurm cancelled the job because a node failed: the machine, not the code.",
        _p(r"CANCELLED AT [^\n]{0,80}DUE TO NODE FAIL"),
    ),
    _Rule(
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
    _Rule(
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
    _Rule(
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
    _Rule(
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
    _Rule(
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
    _Rule(
        "nvlink_error",
        "hardware",
        "An NVLink link failed between GPUs: the interconnect, not the code.",
        _p(r"\bNVLink\b[^\n]{0,80}\b(?:fatal|uncorrectable|error|fault|down)\b", flags=_I),
        unless=_p(r"\bNCCL INFO\b"),
    ),
    _Rule(
        "pcie_fatal",
        "hardware",
        "The kernel logged an uncorrected PCIe error: the bus, not the code.",
        _p(r"\bPCIe Bus Error: severity=Uncorrected"),
    ),
    # -- runwatch's own stop, and other deliberate stops on non-finite values -------------------------
    _Rule(
        "runwatch_stop",
        "nonfinite_stop",
        "runwatch's worker stopped the run (a non-finite loss or gradients it could not roll back past, "
        "or an escalated finding): a deliberate stop, not a crash to restart.",
        _p(
            r"\brunwatch: step \S{1,20}: stop (?:applied|failed)\b",
            r"\brunwatch: still running [^\n]{0,40}after a stop action\b",
        ),
    ),
    _Rule(
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
    _Rule(
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
    _Rule(
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
    _Rule(
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
    _Rule(
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
    _Rule(
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
    _Rule(
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
    _Rule(
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
    _Rule(
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
    _Rule(
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
    _Rule(
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
    _Rule(
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
    _Rule(
        "fatal_signal",
        "segfault",
        "The process died of a fatal signal ({code}) and nothing more specific was said.",
        signals=NATIVE_CRASH_SIGNALS,
    ),
    _Rule(
        "launcher_stopped_siblings",
        "unknown",
        "The launcher sent SIGTERM to this worker because another one failed: classify that one's crash.",
        _p(r"\bSending process \d{1,9} closing signal SIGTERM\b"),
        only_signals=frozenset({15}),  # (the launcher logs it for every sibling of a failed worker)
    ),
    _Rule(
        "sigterm",
        "preemption",
        "The process was sent {code}, as a scheduler does to preempt or end a job, and nothing more specific"
        " was said.",
        signals=SCHEDULER_SIGNALS,
    ),
    _Rule(
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
    _Rule(
        "sigkill_unexplained",
        "unknown",
        "The process was killed by SIGKILL, and nothing says who (the OOM killer would have logged it; a "
        "scheduler's grace period ending would too).",
        signals=frozenset({9}),
    ),
    # -- Python -------------------------------------------------------------------------------------
    _Rule(
        "keyboard_interrupt",
        "user_code",
        "The process was interrupted (SIGINT, Ctrl-C): someone stopped it on purpose.",
        exception=re.compile(r"KeyboardInterrupt"),
    ),
    _Rule(
        "python_exception",
        "user_code",
        "A Python exception ended the process, and it names none of the infrastructure's failures: the"
        " code's error.",
    ),
    # -- last: a cancellation that names no reason ----------------------------------------------------
    _Rule(
        "slurm_cancelled",
        "preemption",
        "Slurm cancelled the job or step without naming why (scancel, or the scheduler); nothing else was"
        " said.",
        _p(r"\*\*\* (?:JOB|STEP) [^\n]{0,80}CANCELLED AT\b"),
    ),
)

# The launcher-side wrappers of a child's failure: their traceback is the launcher's, not the code's.
_WRAPPER_EXCEPTIONS = re.compile(r"(?:\w{1,40}\.){0,6}(?:ChildFailedError|CalledProcessError)")
_TRACEBACK = re.compile(
    r"^(?P<prefix>(?:\[(?:rank|default)\d{1,6}\]: ?|\d{1,6}: )?)Traceback \(most recent call last\):", _M
)
# An exception line: a dotted name, then ':' or the end of the line, at the prefix's indentation.
_EXCEPTION_LINE = re.compile(r"(?P<name>[A-Za-z_][\w]{0,80}(?:\.[A-Za-z_][\w]{0,80}){0,8})(?::|$)")
_LINE_PREFIX = re.compile(r"(?:\[(?:rank|default)\d{1,6}\]:|\d{1,6}: )")
_TEXT_SIGNAL = (
    re.compile(r"\bexitcode\s{0,4}:\s{0,4}-(?P<n>\d{1,2})\b"),  # torchrun's ChildFailedError summary
    re.compile(r"\bSignal (?P<n>\d{1,2}) \(SIG[A-Z0-9]{1,8}\) received by PID\b"),
)


def classify(
    *,
    text: str,
    exception_type: str | None = None,
    signal: int | None = None,
    exit_code: int | None = None,
) -> CrashVerdict:
    """The class of a crash from what it said (``text``: the exception message, traceback and log tail,
    joined by newlines) and what its launcher knew. Never raises on any string; bounded work."""
    facts = _facts(text, exception_type, signal, exit_code)
    for rule in RULES:
        verdict = _apply(rule, facts)
        if verdict is not None:
            return verdict
    return CrashVerdict(
        "unknown",
        "no_rule",
        _signal_evidence(facts)
        or _last_line(facts.text)
        or (f"exit code {facts.exit_code}" if facts.exit_code is not None else "nothing was said"),
        "Nothing the crash said matches a rule: restart it as it was once, and look at its log.",
    )


def _facts(text: str, exception_type: str | None, signal: int | None, exit_code: int | None) -> _Facts:
    scanned = _bounded(text if isinstance(text, str) else "")
    etype = exception_type.strip()[:EXCEPTION_TYPE_CHARS] if isinstance(exception_type, str) else None
    source = ""
    sig: int | None = None
    if isinstance(signal, int) and 0 < signal < 65:
        sig, source = signal, "signal"
    elif isinstance(exit_code, int) and 128 < exit_code <= 128 + 64:
        sig, source = exit_code - 128, f"exit code {exit_code}"  # a shell's 128 + N
    elif isinstance(exit_code, int) and -65 < exit_code < 0:
        sig, source = -exit_code, f"exit code {exit_code}"  # Python's subprocess: -N
    code = exit_code if isinstance(exit_code, int) and -(2**31) <= exit_code < 2**32 else None
    return _Facts(scanned, etype or None, sig, source, code)


def _bounded(text: str) -> str:
    """The head and the tail of ``text``, each line cut to :data:`LINE_CHARS`."""
    if len(text) > HEAD_CHARS + TAIL_CHARS:
        text = text[:HEAD_CHARS] + "\n" + text[-TAIL_CHARS:]
    if len(text) > LINE_CHARS and any(len(line) > LINE_CHARS for line in text.split("\n")):
        text = "\n".join(line[:LINE_CHARS] for line in text.split("\n"))
    return text


def _apply(rule: _Rule, facts: _Facts) -> CrashVerdict | None:
    if rule.id == "python_exception":
        return _python_exception(rule, facts)
    if rule.pattern is not None and (not rule.only_signals or facts.signal in rule.only_signals):
        found = _last_match(rule, facts.text)
        if found is not None:
            match, line = found
            return CrashVerdict(rule.crash_class, rule.id, line, _explain(rule, match))
    if rule.exception is not None and facts.exception_type and rule.exception.fullmatch(facts.exception_type):
        return CrashVerdict(
            rule.crash_class, rule.id, sanitize(f"exception {facts.exception_type}"), _explain(rule, None)
        )
    if rule.signals and facts.signal in rule.signals:
        return CrashVerdict(rule.crash_class, rule.id, _signal_evidence(facts), _explain(rule, None, facts))
    if rule.signals and facts.signal is None:
        text_signal = _text_signal(facts.text)
        if text_signal is not None and text_signal[0] in rule.signals:
            sig, line = text_signal
            return CrashVerdict(
                rule.crash_class, rule.id, line, _explain(rule, None, _Facts("", None, sig, "log"))
            )
    return None


def _last_match(rule: _Rule, text: str) -> tuple[re.Match[str], str] | None:
    """The last accepted match of the rule's pattern (the nearest to the process's end), and its line."""
    assert rule.pattern is not None
    last: tuple[re.Match[str], str] | None = None
    for match in rule.pattern.finditer(text):
        if rule.accept is not None and not rule.accept(match):
            continue
        line = _line_at(text, match.start())
        if rule.unless is not None and rule.unless.search(line):
            continue
        last = (match, line)
    if last is None:
        return None
    return last[0], sanitize(last[1])


def _explain(rule: _Rule, match: re.Match[str] | None, facts: _Facts | None = None) -> str:
    if "{code}" not in rule.explanation:
        return rule.explanation
    code = ""
    if match is not None:
        code = next((g for g in match.groups() if g and g.isdigit()), "")
    elif facts is not None and facts.signal is not None:
        code = SIGNAL_NAMES.get(facts.signal, f"signal {facts.signal}")
        if facts.signal_source.startswith("exit code"):
            code += f", read from its {facts.signal_source}"
        elif facts.signal_source == "log":
            code += ", named in its launcher's log"
    return rule.explanation.replace("{code}", code)


def _python_exception(rule: _Rule, facts: _Facts) -> CrashVerdict | None:
    """The last traceback's exception (a launcher's wrapper of a child's failure does not count), or the
    exception type the excepthook saw."""
    line = _last_exception_line(facts.text)
    if line is not None:
        return CrashVerdict(rule.crash_class, rule.id, line, rule.explanation)
    if facts.exception_type and not _WRAPPER_EXCEPTIONS.fullmatch(facts.exception_type):
        return CrashVerdict(
            rule.crash_class, rule.id, sanitize(f"exception {facts.exception_type}"), rule.explanation
        )
    return None


def _last_exception_line(text: str) -> str | None:
    """The exception line that ends the last traceback that is not a launcher's wrapper."""
    found: str | None = None
    for header in _TRACEBACK.finditer(text):
        prefix = header.group("prefix")
        end = text.find("\n", header.end())
        # The exception line: the first line after the header, in the same prefix, not indented.
        for candidate in text[end + 1 : end + 1 + 32 * 1024].split("\n")[:400] if end >= 0 else []:
            body = candidate[len(prefix) :] if prefix and candidate.startswith(prefix) else candidate
            if prefix and not candidate.startswith(prefix):
                continue  # another rank's interleaved line
            if not body or body[0] in " \t":
                continue
            match = _EXCEPTION_LINE.match(body)
            if match is None:
                break
            if not _WRAPPER_EXCEPTIONS.fullmatch(match.group("name")):
                found = sanitize(candidate)
            break
    return found


def _text_signal(text: str) -> tuple[int, str] | None:
    """A signal a launcher's own log names (torchrun's ``exitcode: -11``), and its line."""
    for pattern in _TEXT_SIGNAL:
        last = None
        for match in pattern.finditer(text):
            last = match
        if last is not None:
            return int(last.group("n")), sanitize(_line_at(text, last.start()))
    return None


def _signal_evidence(facts: _Facts) -> str:
    if facts.signal is None:
        return ""
    name = SIGNAL_NAMES.get(facts.signal)
    evidence = f"signal {facts.signal}" + (f" ({name})" if name else "")
    return evidence + (f", from {facts.signal_source}" if facts.signal_source.startswith("exit code") else "")


def _line_at(text: str, index: int) -> str:
    start = text.rfind("\n", 0, index) + 1
    end = text.find("\n", index)
    return text[start : end if end >= 0 else len(text)]


def _last_line(text: str) -> str:
    for line in reversed(text[-8192:].split("\n")):
        if line.strip():
            return sanitize(line)
    return ""


_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\t\n]")


def sanitize(line: str) -> str:
    """``line`` as plain text for a finding: control and bidi/format characters escaped (``\\x1b``,
    ``\\u202e``: a terminal or a page shows them, never acts on them), stripped, cut to
    :data:`EVIDENCE_CHARS` characters with a mark."""
    line = line.strip()[: EVIDENCE_CHARS * 2]
    escaped = _UNSAFE.sub(lambda m: _escape(m.group()), line)
    if len(escaped) > EVIDENCE_CHARS:
        escaped = escaped[: EVIDENCE_CHARS - 3].rstrip("\\") + "..."
    return escaped


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
