"""The deploy check's training runs: a NaN run started from the host's venv, waited for to a step, and
checked for the rollback it must get."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from check_shell import CHECK, TIMEOUT, Failed, say
from check_stack import Services, Stack

NAN_STEP = 60  # fault_train's defaults otherwise: 300 steps, a checkpoint every 20, 10 ms of sleep a step
# The run the takeover happens in: slower and longer, so that the kill (at step KILL_AT_STEP) and the takeover
# (about 10 s) come well before its NaN (about 20 s after the kill), and its end later still.
IN_FLIGHT_NAN_STEP, IN_FLIGHT_STEPS, IN_FLIGHT_STEP_SLEEP = 550, 800, 0.05
KILL_AT_STEP = 200  # about 11 s into the run: its state has been snapshotted (every 5 s) by then


def train(
    stack: Stack,
    services: Services,
    run_id: str,
    nan_step: int = NAN_STEP,
    steps: int = 300,
    step_sleep: float = 0.01,
) -> subprocess.Popen[bytes]:
    out = stack.work / run_id
    out.mkdir()
    cmd = [sys.executable, str(CHECK / "timed_train.py"), "--bootstrap", services.bootstrap,
           "--run-id", run_id, "--out", str(out), "--fault", f"nan:{nan_step}",
           "--steps", str(steps), "--step-sleep", str(step_sleep)]  # fmt: skip
    with (out / "train.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    stack.trainers.append(proc)
    return proc


def wait_for_step(stack: Stack, proc: subprocess.Popen[bytes], run_id: str, step: int) -> None:
    """Until the run has saved its checkpoint of ``step`` (fault_train saves one every 20 steps)."""
    checkpoint = stack.work / run_id / f"ckpt-{step}.pt"
    deadline = time.monotonic() + TIMEOUT["train"]
    while not checkpoint.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            log = (stack.work / run_id / "train.log").read_text(errors="replace")
            print(log[-3000:], file=sys.stderr)
            raise Failed(f"training run {run_id} did not reach step {step} (exit {proc.poll()})")
        time.sleep(0.1)


def rolled_back(
    stack: Stack, proc: subprocess.Popen[bytes], run_id: str, nan_step: int = NAN_STEP, after: float = 0.0
) -> float:
    """Waits for the run; it must have completed with a rollback applied, and its NaN must have come after
    ``after`` (epoch s). Returns the seconds from the NaN to the rollback."""
    out = stack.work / run_id
    try:
        code = proc.wait(TIMEOUT["train"])
    except subprocess.TimeoutExpired:
        raise Failed(f"training run {run_id} did not end within {TIMEOUT['train']} s") from None
    log = (out / "train.log").read_text(errors="replace")
    if code != 0:
        print(log[-3000:], file=sys.stderr)
        last = log.strip().splitlines()[-1] if log.strip() else "(no output)"
        raise Failed(f"training run {run_id} exited {code}: {last}")
    result = json.loads((out / "result.json").read_text())
    timings = json.loads((out / "timings.json").read_text())
    applied = [(a["kind"], a["outcome"], a["at"], a["to_step"]) for a in result["applied"]]
    if result["status"] != "completed" or not timings["rollbacks"] or timings["nan_at"] is None:
        raise Failed(f"training run {run_id}: NaN at step {nan_step} but no rollback applied ({applied})")
    if timings["nan_at"] < after:
        raise Failed(f"training run {run_id}: its NaN came before the worker was killed (step {nan_step})")
    rollback = timings["rollbacks"][0]
    seconds = float(rollback["at"] - timings["nan_at"])
    stack.steps_to_rollback[run_id] = rollback["step"] - nan_step
    say(
        f"run {run_id}: NaN at step {nan_step}, rollback to step {rollback['to_step']} applied at step "
        f"{rollback['step']}, {seconds:.2f} s after the NaN (actions applied: {applied})"
    )
    return seconds
