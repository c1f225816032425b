"""Import boundaries between the parts, checked in fresh interpreters (issue 13).

The wire contract imports alone; detectors and sinks never load the training-side code
(publisher, watcher, action listener) nor torch; the producer never loads the worker's or
the sink's dependencies; detectors never touch Kafka.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TRAINING_SIDE = ("runwatch.producer.publish", "runwatch.producer.instrument", "runwatch.producer.actions.listener", "torch")
WORKER_SIDE = ("faust", "river", "clickhouse_connect", "chdb")


def loaded_after(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``statement``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def offenders(modules: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == f or m.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize("statement", [
    "import runwatch.detectors",
    "import runwatch.sinks",
    "from runwatch.sinks.remediate.consumer import RemediateConsumer",
])
def test_detectors_and_sinks_never_load_the_training_side(statement):
    assert offenders(loaded_after(statement), TRAINING_SIDE) == []


def test_the_remediator_takes_the_listeners_inbox_and_nothing_else_of_it():
    loaded = loaded_after("from runwatch.sinks.remediate.consumer import RemediateConsumer")
    actions = sorted(m for m in loaded if m.startswith("runwatch.producer.actions"))
    assert actions == ["runwatch.producer.actions", "runwatch.producer.actions.inbox"]


@pytest.mark.parametrize("statement", [
    "import runwatch.producer",
    "from runwatch.producer import RunWatch",
    "from runwatch.producer import ActionListener, JsonlRecorder, Watcher",
])
def test_producer_never_loads_the_worker_or_the_sink(statement):
    assert offenders(loaded_after(statement), WORKER_SIDE) == []


def test_detectors_never_load_kafka_or_torch():
    assert offenders(loaded_after("import runwatch.detectors"), ("kafka", "torch")) == []


@pytest.mark.parametrize("statement", [
    "import runwatch.producer.wire",
    "from runwatch.producer.wire import schema, signing, topics",
    "from runwatch.producer.schema import StepEvent",  # the old path, a re-export
])
def test_the_wire_contract_imports_alone(statement):
    assert offenders(loaded_after(statement), TRAINING_SIDE + WORKER_SIDE + ("kafka",)) == []


def test_producer_names_resolve_lazily_to_the_same_objects():
    import runwatch.producer as producer
    from runwatch.producer.publish.run_watch import RunWatch
    from runwatch.producer.wire.schema import StepEvent

    assert producer.RunWatch is RunWatch and producer.StepEvent is StepEvent
    assert all(getattr(producer, name) is not None for name in producer.__all__)
    with pytest.raises(AttributeError):
        producer.NoSuchName  # noqa: B018
