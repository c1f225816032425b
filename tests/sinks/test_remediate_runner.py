"""Running remediation programs: a verify command's stdout must be the run id on every line, and
commands run without a shell and without runwatch's keys in their environment, with a timeout; a
missing program is a failure, not a crash."""

from __future__ import annotations

import sys
import time

from runwatch.contract.topics import LEGACY_SECRET_ENV, SIGNING_KEY_ENV
from runwatch.sinks.remediate.runner import run_command, run_verify, verify_problem

# -- verifying targets ------------------------------------------------------------------------------


def test_verify_output_must_be_the_run_id_on_every_line():
    assert verify_problem("run-1", "ok", 0, "run-1\n", "") is None
    assert verify_problem("run-1", "ok", 0, "  run-1  \n\nrun-1\n", "") is None  # array tasks: one line each
    assert "not the run id" in verify_problem("run-1", "ok", 0, "run-12\n", "")
    assert "not the run id" in verify_problem("run", "ok", 0, "run:other-team\n", "")  # no substring match
    assert "not the run id" in verify_problem("run-1", "ok", 0, "run-1\nrun-2\n", "")
    assert "printed nothing" in verify_problem("run-1", "ok", 0, "\n", "")
    assert verify_problem("run-1", "failed", 1, "run-1\n", "Invalid job id") == "exited 1: Invalid job id"
    assert verify_problem("run-1", "timeout", -9, "run-1\n", "") == "timed out"


def test_run_verify_takes_only_stdout_as_the_answer():
    script = "import sys; print('run-1', file=sys.stderr); print('other-run')"
    status, code, out, err = run_verify([sys.executable, "-c", script], 10)
    assert (status, code, out.strip(), err.strip()) == ("ok", 0, "other-run", "run-1")
    started = time.monotonic()
    status, _, _, _ = run_verify([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert status == "timeout" and time.monotonic() - started < 10
    status, code, _, err = run_verify(["/nonexistent/runwatch-verify"], 5)
    assert (status, code) == ("failed", None) and "could not start" in err


# -- running commands -------------------------------------------------------------------------------


def test_run_command_captures_exit_code_and_output_without_a_shell(monkeypatch):
    for name in (SIGNING_KEY_ENV, LEGACY_SECRET_ENV, "RUNWATCH_STATE_SECRET"):
        monkeypatch.setenv(name, "must-not-leak")
    status, code, out = run_command(
        [
            sys.executable,
            "-c",
            "import os, sys; print(sys.argv[1], [os.environ.get(n) for n in sys.argv[2:]]); sys.exit(3)",
            "$(echo hi);",
            SIGNING_KEY_ENV,
            LEGACY_SECRET_ENV,
            "RUNWATCH_STATE_SECRET",
        ],
        10,
    )
    assert (status, code) == ("failed", 3)
    assert out.strip() == "$(echo hi); [None, None, None]"  # no shell expansion, no key in the environment


def test_run_command_timeout_and_missing_program():
    status, _, out = run_command([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert status == "timeout" and "killed" in out
    status, code, out = run_command(["/nonexistent/runwatch-program"], 5)
    assert (status, code) == ("failed", None) and "could not start" in out
