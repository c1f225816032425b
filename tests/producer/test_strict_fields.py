"""Strict event building in the producer (issue 41): a misspelt field raises at once with the nearest
known name; a field of the run's own goes through ``extra={...}``; decoding another client's event still
keeps its unknown fields."""

from __future__ import annotations

import sys
from datetime import UTC, datetime

import orjson
import pytest

from runwatch.contract.schema import (
    ActionAckEvent,
    CheckpointEvent,
    CrashEvent,
    EvalEvent,
    HeartbeatEvent,
    RunEndEvent,
    RunStartEvent,
    StackEvidenceEvent,
    StepEvent,
    decode_event,
)
from runwatch.producer.publish.delivery import MemoryDelivery
from runwatch.producer.publish.events import RunEvents, UnknownFieldError
from runwatch.producer.publish.run_watch import RunWatch


def memory_rw(rank: int = 1) -> RunWatch:
    return RunWatch(
        "strict-run",
        rank=rank,
        world_size=2,
        delivery=MemoryDelivery(),
        collect_metadata=False,
        capture_crashes=False,
    )


def events(rw: RunWatch) -> list:
    delivery = rw.delivery
    assert isinstance(delivery, MemoryDelivery)
    return delivery.events


def test_a_misspelt_step_field_raises_with_the_nearest_name_and_publishes_nothing():
    rw = memory_rw()
    with pytest.raises(TypeError, match=r"StepEvent has no field 'grad_nrom': did you mean 'grad_norm'\?"):
        rw.step(1, grad_nrom=1.0)
    with pytest.raises(UnknownFieldError, match="did you mean 'loss'"):
        rw.step(2, los=1.0)
    assert events(rw) == [] and rw.stats.dropped == 0  # raised, not dropped as invalid
    assert rw.step(3, grad_norm=1.0)  # the fixed call goes out
    rw.close()


def test_several_unknown_fields_are_all_named():
    rw = memory_rw()
    with pytest.raises(UnknownFieldError) as raised:
        rw.step(1, grad_nrom=1.0, stp_time_s=0.2, zzz=1)
    message = str(raised.value)
    assert "'grad_nrom': did you mean 'grad_norm'" in message
    assert "'stp_time_s': did you mean 'step_time_s'" in message
    assert "has no field 'zzz' (" in message or "has no field 'zzz';" in message  # nothing near: no guess
    rw.close()


def test_extra_fields_are_accepted_and_kept_on_the_wire():
    rw = memory_rw()
    assert rw.step(4, loss=1.5, extra={"my_metric": 3, "note": "warmup"})
    assert rw.eval(4, loss=1.0, extra={"my_eval_metric": 0.5})
    step, evaluation = events(rw)
    assert step.model_extra == {"my_metric": 3, "note": "warmup"} and step.loss == 1.5
    assert evaluation.model_extra == {"my_eval_metric": 0.5}
    wire = orjson.loads(step.to_json())
    assert wire["my_metric"] == 3 and wire["note"] == "warmup"
    again = decode_event(step.to_json(), key=b"strict-run")
    assert again.model_extra == {"my_metric": 3, "note": "warmup"}
    rw.close()


def test_extra_may_not_carry_a_declared_field():
    rw = memory_rw()
    with pytest.raises(TypeError, match="'loss' is a field of StepEvent"):
        rw.step(1, extra={"loss": 1.0})  # it would dodge the name check: pass loss=1.0
    with pytest.raises(TypeError, match="mapping"):
        rw.step(1, extra=[("x", 1)])  # type: ignore[arg-type]
    assert events(rw) == []
    rw.close()


def test_another_clients_unknown_fields_are_still_decoded_and_kept():
    """docs/publishing-without-python.md: a field runwatch does not know travels with the event."""
    raw = orjson.dumps(
        {
            "schema_version": 1,
            "event_id": "go-1",
            "run_id": "go-run",
            "rank": 0,
            "ts": datetime.now(UTC).isoformat(),
            "kind": "step",
            "step": 7,
            "loss": 2.0,
            "grad_nrom": 1.0,
            "jax_device_kind": "TPU v5",
        }
    )
    event = decode_event(raw, key=b"go-run")
    assert isinstance(event, StepEvent) and event.step == 7
    assert event.model_extra == {"grad_nrom": 1.0, "jax_device_kind": "TPU v5"}
    assert orjson.loads(event.to_json())["jax_device_kind"] == "TPU v5"


REQUIRED = {
    RunStartEvent: {},
    StepEvent: {"step": 1},
    EvalEvent: {"step": 1},
    HeartbeatEvent: {},
    StackEvidenceEvent: {"threads": []},
    CrashEvent: {},
    CheckpointEvent: {"step": 1, "uri": "/c"},
    ActionAckEvent: {"action_id": "a", "outcome": "applied"},
    RunEndEvent: {"status": "completed"},
}


@pytest.mark.parametrize("model", list(REQUIRED), ids=lambda m: m.__name__)
def test_every_event_kinds_builder_refuses_an_unknown_field(model):
    build = RunEvents("strict-run", 0).build
    assert build(model, **REQUIRED[model]).model_extra == {}
    with pytest.raises(UnknownFieldError, match=f"{model.__name__} has no field 'bogus_field'"):
        build(model, bogus_field=1, **REQUIRED[model])
    kept = build(model, extra={"bogus_field": 1}, **REQUIRED[model])
    assert kept.model_extra == {"bogus_field": 1}


def test_every_run_watch_method_refuses_an_unknown_field():
    rw = memory_rw()
    with pytest.raises(UnknownFieldError, match="did you mean 'metrics'"):
        rw.eval(1, metricz={"acc": 1.0})
    with pytest.raises(UnknownFieldError, match="did you mean 'detail'"):
        rw.ack(action_id="a", outcome="applied", detial="x")
    with pytest.raises(UnknownFieldError, match="did you mean 'message'"):
        rw.publish_crash(mesage="boom")
    with pytest.raises(TypeError):  # declared keywords only: Python's own refusal
        rw.heartbeat(1, phse="train")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        rw.evidence(1, threads=[], reasn="no_progress")  # type: ignore[call-arg]
    assert events(rw) == []
    rw.close()


def test_a_misspelt_run_start_field_is_refused_before_anything_is_installed():
    hook = sys.excepthook
    with pytest.raises(UnknownFieldError, match="did you mean 'dataset_version'"):
        RunWatch(
            "strict-run",
            rank=0,
            world_size=1,
            delivery=MemoryDelivery(),
            collect_metadata=False,
            run_start={"datset_version": "v3"},
        )
    assert sys.excepthook is hook  # the crash capture was not installed by the refused RunWatch
    delivery = MemoryDelivery()
    rw = RunWatch(
        "strict-run",
        rank=0,
        world_size=1,
        delivery=delivery,
        collect_metadata=False,
        capture_crashes=False,
        run_start={"dataset_version": "v3", "extra": {"cluster": "east"}},
    )
    start = delivery.events[0]
    assert start.kind == "run_start" and start.dataset_version == "v3"
    assert start.model_extra == {"cluster": "east"}
    rw.close()


def test_the_watchers_own_step_fields_are_all_declared():
    """The automatic instrumentation must never trip the strict check: every option that adds a field."""
    torch = pytest.importorskip("torch")
    from runwatch.producer.instrument.categories import category_loss

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rw = memory_rw(rank=0)
    watch = rw.watch(
        model,
        optimizer,
        clip=1.0,
        update_every=1,
        heartbeat_s=None,
        activations=True,
        activations_every=1,
        replicas=True,
        fingerprint_every=1,
        flops_per_step=1e6,
        peak_flops_per_s=1e12,
    )
    for step in range(4):
        x, y = torch.randn(6, 4), torch.randn(6, 1)
        if step == 2:
            with watch.phase("eval"):  # (off_step_s in the next step)
                pass
        per_sample = (model(x) - y).pow(2).mean(dim=1)
        loss = per_sample.mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        batch = category_loss(per_sample, ["a", "b", "a", "b", "a", "c"])
        watch.end_step(loss, samples=6, tokens=60, category_loss=batch)
    watch.eval(3, "val", 0.5, {"acc": 1.0}, per_category=batch)
    watch.close()
    assert watch.errors == 0
    steps = [e for e in events(rw) if e.kind == "step"]
    assert len(steps) == 4 and all(e.model_extra == {} for e in steps)
    assert steps[-1].grad_norm is not None and steps[-1].module_activations and steps[-1].category_loss
    rw.close()


def test_a_thread_exceptions_crash_event_names_its_thread():
    """The crash capture's own fields are declared (``thread`` was an undeclared extra before issue 41)."""
    delivery = MemoryDelivery()
    rw = RunWatch("strict-run", rank=1, world_size=2, delivery=delivery, collect_metadata=False)
    assert rw.crash_capture is not None
    try:
        raise RuntimeError("boom in a loader thread")
    except RuntimeError as exc:
        sent = rw.crash_capture.report_exception(
            type(exc), exc, exc.__traceback__, source="thread_exception", final=False, thread="loader-3"
        )
    assert sent
    (crash,) = [e for e in delivery.events if e.kind == "crash"]
    assert crash.thread == "loader-3" and crash.source == "thread_exception" and crash.model_extra == {}
    rw.close()
