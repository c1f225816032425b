"""Import boundaries between the parts, checked in fresh interpreters (issue 13).

The wire contract imports alone; detectors and sinks never load the training-side code
(publisher, watcher, action listener) nor torch; the producer never loads the worker's or
the sink's dependencies; detectors never touch Kafka. The worker, the sink, the remediator and
every command that trains nothing run where torch cannot be imported, and the commands that
train real models say in one line which extra to install (issue 16).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # starts processes (issue 25: not in `make test-fast`)

TRAINING_SIDE = (
    "runwatch.producer.publish",
    "runwatch.producer.instrument",
    "runwatch.producer.actions.listener",
    "torch",
)
WORKER_SIDE = ("faust", "river", "clickhouse_connect", "chdb", "prometheus_client", "opentelemetry")


def loaded_after(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``statement``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def offenders(modules: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == f or m.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize(
    "statement",
    [
        "import runwatch.detectors",
        "import runwatch.sinks",
        "from runwatch.sinks.remediate.consumer import RemediateConsumer",
    ],
)
def test_detectors_and_sinks_never_load_the_training_side(statement):
    assert offenders(loaded_after(statement), TRAINING_SIDE) == []


def test_the_remediator_and_the_sink_load_nothing_of_the_producer():
    # (the inbox that verifies actions is the contract's: issue 41)
    loaded = loaded_after(
        "from runwatch.sinks.remediate.consumer import RemediateConsumer; import runwatch.sinks.consumer"
    )
    assert "runwatch.contract.inbox" in loaded
    assert sorted(m for m in loaded if m.startswith("runwatch.producer")) == []


@pytest.mark.parametrize(
    "statement",
    [
        "import runwatch.producer",
        "from runwatch.producer import RunWatch",
        "from runwatch.producer import ActionListener, JsonlRecorder, Watcher",
    ],
)
def test_producer_never_loads_the_worker_or_the_sink(statement):
    assert offenders(loaded_after(statement), WORKER_SIDE) == []


def test_the_worker_loads_opentelemetry_only_for_its_otlp_option():
    # (the `otlp` extra is optional: a worker without --otlp-endpoint never imports it)
    loaded = loaded_after("import runwatch.cli.worker, runwatch.worker.app, runwatch.worker.metrics_server")
    assert offenders(loaded, ("opentelemetry",)) == []


def test_detectors_never_load_kafka_or_torch():
    assert offenders(loaded_after("import runwatch.detectors"), ("kafka", "torch")) == []


@pytest.mark.parametrize(
    "statement",
    [
        "import runwatch.contract",
        "from runwatch.contract import schema, signing, topics",
        "from runwatch.contract.schema import StepEvent",
        "from runwatch.contract.inbox import ActionInbox",
    ],
)
def test_the_wire_contract_imports_alone(statement):
    loaded = loaded_after(statement)
    assert offenders(loaded, TRAINING_SIDE + WORKER_SIDE + ("kafka",)) == []
    assert offenders(loaded, ("runwatch.producer",)) == []  # its own room: nothing of the producer


def test_producer_names_resolve_lazily_to_the_same_objects():
    import runwatch.producer as producer
    from runwatch.contract.schema import StepEvent
    from runwatch.producer.publish.run_watch import RunWatch

    assert producer.RunWatch is RunWatch and producer.StepEvent is StepEvent
    assert all(getattr(producer, name) is not None for name in producer.__all__)
    with pytest.raises(AttributeError):
        producer.NoSuchName  # noqa: B018


# Run first in a fresh interpreter: torch cannot be imported there, as in a worker's install without it.
# A finder, not ``sys.modules['torch'] = None``: libraries probe sys.modules for torch (scipy's array API
# helpers, under river) and would take that None for the module.
NO_TORCH = """import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
"""
# Only these train real models, or are the framework callbacks that the lightning / hf extras bring torch for.
NEEDS_TORCH = ("runwatch.demo", "runwatch.scenarios", "runwatch.producer.integrations")


def run_without_torch(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH + code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    "statement",
    [
        "import runwatch.worker.app",
        "import runwatch.cli.main",
        "from runwatch.sinks.consumer import SinkConsumer",
        "import runwatch.sinks.remediate",
    ],
)
def test_the_worker_sink_remediator_and_cli_never_load_torch(statement):
    assert offenders(loaded_after(statement), ("torch",)) == []


def test_every_module_but_the_training_ones_imports_without_torch():
    code = f"""
import importlib, json, pkgutil
failed = {{}}
for name in ("runwatch", "runwatch.producer", "runwatch.detectors", "runwatch.worker", "runwatch.sinks"):
    for info in pkgutil.walk_packages(importlib.import_module(name).__path__, name + "."):
        if info.name.endswith(".__main__") or info.name.startswith({NEEDS_TORCH!r}):
            continue
        try:
            importlib.import_module(info.name)
        except Exception as exc:
            failed[info.name] = repr(exc)
print(json.dumps(failed))
"""
    done = run_without_torch(code)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}


CLI = "import runpy\nsys.argv[0] = 'runwatch'\nrunpy.run_module('runwatch.cli', run_name='__main__')\n"


def test_runwatch_worker_help_runs_without_torch():
    done = run_without_torch(CLI, "worker", "--help")
    assert done.returncode == 0, done.stderr
    assert "--bootstrap" in done.stdout


def test_commands_that_train_nothing_run_without_torch(tmp_path: Path):
    from runwatch.contract.schema import StepEvent

    recording = tmp_path / "nan.jsonl"
    events = [
        StepEvent(run_id="r", step=s, loss=float("nan") if s >= 40 else 1.0, grad_norm=1.0) for s in range(50)
    ]
    recording.write_text("".join(e.to_json().decode() + "\n" for e in events))
    commands = [
        ["sink", "--help"],
        ["remediate", "--help"],
        ["config", "--defaults"],
        ["baseline", "--help"],
        ["report", "--help"],
        ["grafana", "generate", "--out", str(tmp_path / "dashboards")],
        ["replay", str(recording), "--json"],
    ]
    code = f"""
import json
from click.testing import CliRunner
from runwatch.cli.main import main
results = {{}}
for args in {commands!r}:
    out = CliRunner().invoke(main, args)
    results[args[0]] = [out.exit_code, out.output, repr(out.exception)]
print(json.dumps(results))
"""
    done = run_without_torch(code)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert {name: r for name, r in results.items() if r[0] != 0} == {}
    assert {a["detector"] for a in json.loads(results["replay"][1])["anomalies"]} == {"non_finite"}


@pytest.mark.parametrize(
    "command", [["demo"], ["scenarios", "generate", "corpus"], ["scenarios", "history", "h"]]
)
def test_commands_that_train_say_which_extra_to_install(command, tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH + CLI, *command],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: runwatch {' '.join(command[: 2 if len(command) > 1 else 1])} trains real models and needs "
        "PyTorch: pip install 'runwatch[torch]'"
    ]
    assert not (tmp_path / command[-1]).exists()


# One import path per module (issue 25): the wire contract is ``runwatch.contract`` and the worker
# ``runwatch.worker`` (issue 41), the framework callbacks ``runwatch.producer.integrations``; the shims
# that gave them second paths are gone.
# The command line, the local stack, the demo and the scenario corpus have rooms of their own (runwatch.cli,
# .local, .demo, .scenarios), and the loose top-level modules went where they are used.
REMOVED_PATHS = (
    "runwatch.producer.wire",
    "runwatch.producer.actions.inbox",
    "runwatch.producer.schema",
    "runwatch.producer.topics",
    "runwatch.producer.signing",
    "runwatch.producer.hf",
    "runwatch.producer.lightning",
    "runwatch.streams",
    "runwatch.streams.worker",
    "runwatch.streams.cli",
    "runwatch.streams.local",
    "runwatch.streams.demo",
    "runwatch.streams.scenarios",
    "runwatch.configfile",
    "runwatch.logsafe",
    "runwatch.extras",
    "runwatch.gitlog",
    "runwatch.reach",
)
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", REMOVED_PATHS)
def test_a_removed_second_path_does_not_import(module):
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr


def _tree_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    )
    return [
        ROOT / f
        for f in listed.stdout.split()
        if Path(f).suffix in (".py", ".md", ".yaml", ".yml", ".toml") and not f.startswith("build/")
    ]


def test_nothing_in_the_tree_names_a_removed_path():
    import re

    removed = re.compile(
        r"runwatch\.producer\.(wire|schema|topics|signing|hf|lightning|actions\.inbox)\b"
        r"|runwatch\.streams\b|runwatch\.(configfile|logsafe|extras|gitlog|reach)\b"
        r"|^\s*from runwatch\.producer import [^\n]*\b(wire|schema|topics|signing)\b"
        r"|^\s*from runwatch import",
        re.M,
    )
    # (the state unpickler names the old modules on purpose: a snapshot taken before a move still reads)
    exempt = {
        Path(__file__).resolve(),
        ROOT / "worker/runwatch/worker/state/moved_modules.py",
        ROOT / "tests/worker/test_state_classes.py",
    }
    found = [
        f"{path.relative_to(ROOT)}: {m.group(0).strip()}"
        for path in _tree_files()
        if path not in exempt and path.is_file()
        for m in removed.finditer(path.read_text(errors="replace"))
    ]
    assert found == []
