"""A built wheel, installed into a fresh virtualenv, provides every runwatch subpackage."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_installs_and_imports_in_a_fresh_venv(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("runwatch-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=300,
    )
    # Dependencies come from this environment's site-packages via PYTHONPATH, which does not run
    # its .pth files, so the editable install of the source tree cannot shadow the wheel.
    env = dict(os.environ, PYTHONPATH=sysconfig.get_paths()["purelib"])
    code = (
        "import runwatch, runwatch.producer, runwatch.detectors, runwatch.worker, runwatch.sinks;"
        "import runwatch.cli, runwatch.sinks.clickhouse, runwatch.detectors.spike;"
        "import runwatch.detectors.baselines.check, runwatch.sinks.grafana.panels, runwatch.sinks.report;"
        "print(runwatch.producer.__file__)"
    )
    out = subprocess.run(
        [str(py), "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(venv)), out.stdout
    cli = subprocess.run(
        [str(venv / "bin" / "runwatch"), "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert cli.returncode == 0 and "demo" in cli.stdout
