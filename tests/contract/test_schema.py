"""The wire contract: every event kind survives to_json/decode_event, non-finite floats are not
lost on the way, newer producers' fields are kept, and every malformed message is rejected with a
one-line ``SchemaError.reason`` that says what is wrong (the worker puts it on the dead letter)."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest

from runwatch.contract.schema import (
    EVENT_KINDS,
    ActionAckEvent,
    CategoryLoss,
    CheckpointEvent,
    CrashEvent,
    EvalEvent,
    HeartbeatEvent,
    MemoryStats,
    RunEndEvent,
    RunStartEvent,
    SchemaError,
    StackEvidenceEvent,
    StackFrame,
    StepEvent,
    ThreadStack,
    decode_action,
    decode_anomaly,
    decode_event,
)

TS = datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC)

# The fields every telemetry event must carry, minus run_id and kind (which tests vary).
HEAD = b'{"schema_version":1,"event_id":"e","rank":0,"ts":"2024-05-01T12:00:00Z",'


def _examples():
    common = dict(run_id="run-1", rank=1, ts=TS)
    return [
        RunStartEvent(
            **common,
            job_id="job",
            git_sha="abc",
            git_dirty=True,
            world_size=4,
            gpu_names=["H100", "H100"],
            config={"lr": 0.001, "layers": [1, 2]},
            seed=7,
            tags={"team": "x"},
        ),
        StepEvent(
            **common,
            step=12,
            loss=2.5,
            lr=[1e-3, 5e-4],
            grad_norm=1.25,
            module_grad_norms={"encoder": 0.5},
            category_loss={"code": CategoryLoss(mean=1.5, count=3)},
            memory=MemoryStats(allocated=1 << 30, peak=2 << 30),
            step_time_s=0.2,
            nonfinite_grads=0,
        ),
        EvalEvent(
            **common,
            step=100,
            split="test",
            loss=1.75,
            metrics={"acc": 0.9},
            per_category={"a": {"acc": 0.8}},
        ),
        HeartbeatEvent(**common, step=5, phase="checkpoint", time_in_phase_s=12.5),
        CheckpointEvent(**common, step=50, uri="/ckpt/50.pt", ok=False),
        ActionAckEvent(
            **common, action_id="act-1", action_kind="rollback", outcome="applied", step=60, to_step=50
        ),
        RunEndEvent(
            **common, status="failed", summary={"final_loss": 1.5, "steps": 100, "note": "x", "none": None}
        ),
        StackEvidenceEvent(
            **common,
            step=41,
            seconds_since_step=5.5,
            threads=[
                ThreadStack(
                    name="MainThread",
                    thread_id=7,
                    training=True,
                    frames=[StackFrame(file="/app/train.py", line=12, function="main", code="time.sleep(9)")],
                )
            ],
            flight_recorder='{"entries": []}',
            flight_recorder_status="attached (_dump_fr_trace_json: gloo and NCCL)",
        ),
        CrashEvent(
            **common,
            step=12,
            source="exception",
            exception_type="ValueError",
            message="bad batch",
            traceback='Traceback (most recent call last):\n  File "t.py", line 1\nValueError: bad batch\n',
            host="node-1",
        ),
    ]


def test_examples_cover_every_event_kind():
    assert sorted(e.kind for e in _examples()) == sorted(EVENT_KINDS)


@pytest.mark.parametrize("event", _examples(), ids=lambda e: e.kind)
def test_every_event_kind_round_trips(event):
    decoded = decode_event(event.to_json())
    assert type(decoded) is type(event)
    assert decoded == event
    assert decoded.ts == TS


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_floats_survive_the_round_trip(value):
    event = StepEvent(
        run_id="r",
        step=3,
        loss=value,
        grad_norm=value,
        module_grad_norms={"head": value, "body": 1.0},
        category_loss={"c": CategoryLoss(mean=value, count=1)},
    )
    raw = event.to_json()
    assert b"null" not in raw  # a NaN written as null would erase the very fault we watch for
    decoded = decode_event(raw)

    def same(a, b):
        return (math.isnan(a) and math.isnan(b)) or a == b

    assert same(decoded.loss, value)
    assert same(decoded.grad_norm, value)
    assert same(decoded.module_grad_norms["head"], value)
    assert decoded.module_grad_norms["body"] == 1.0
    assert same(decoded.category_loss["c"].mean, value)


def test_non_finite_floats_are_written_as_strings():
    raw = StepEvent(
        run_id="r", step=0, loss=math.nan, module_grad_norms={"a": math.inf, "b": -math.inf}
    ).to_json()
    assert b'"loss":"NaN"' in raw
    assert b'"Infinity"' in raw and b'"-Infinity"' in raw


def test_unknown_fields_from_a_newer_producer_are_kept():
    raw = (
        HEAD + b'"kind":"step","run_id":"r","step":4,"loss":1.0,'
        b'"future_metric":3.5,"future_block":{"a":[1,2]}}'
    )
    event = decode_event(raw)
    assert event.future_metric == 3.5
    assert event.future_block == {"a": [1, 2]}
    again = decode_event(event.to_json())
    assert again.future_metric == 3.5
    assert again.future_block == {"a": [1, 2]}


def test_unset_optional_fields_are_not_written():
    raw = StepEvent(run_id="r", step=1).to_json()
    assert b'"grad_norm"' not in raw and b"null" not in raw


def _reason(raw) -> str:
    with pytest.raises(SchemaError) as info:
        decode_event(raw)
    assert isinstance(info.value.reason, str) and info.value.reason
    assert "\n" not in info.value.reason
    assert str(info.value) == info.value.reason
    return info.value.reason


def test_step_without_step_names_the_field():
    reason = _reason(HEAD + b'"kind":"step","run_id":"r","loss":1.0}')
    assert reason.startswith("schema:")
    assert "step.step" in reason and "required" in reason.lower()


def test_event_without_run_id_names_the_field():
    assert "run_id" in _reason(HEAD + b'"kind":"heartbeat"}')
    assert "run_id" in _reason(HEAD + b'"kind":"step","step":1}')


def test_empty_run_id_is_rejected():
    assert "run_id" in _reason(HEAD + b'"kind":"step","run_id":"","step":1}')


@pytest.mark.parametrize("raw", [b"not json at all", HEAD + b'"kind":"step",', b"", b"\xff\xfe\x00"])
def test_bytes_that_are_not_json(raw):
    assert _reason(raw).startswith("not JSON")


def test_wrong_type_names_the_field():
    reason = _reason(HEAD + b'"kind":"step","run_id":"r","step":"abc"}')
    assert "step.step" in reason and "integer" in reason


def test_negative_step_is_rejected():
    assert "step" in _reason(HEAD + b'"kind":"step","run_id":"r","step":-1}')


@pytest.mark.parametrize("raw", [b'[{"kind":"step","run_id":"r","step":1}]', b'"step"', b"42", b"null"])
def test_json_that_is_not_an_object(raw):
    reason = _reason(raw)
    assert reason.startswith("schema:") and "object" in reason


def test_unknown_kind():
    reason = _reason(HEAD + b'"kind":"telemetry_v9","run_id":"r"}')
    assert "telemetry_v9" in reason


def test_missing_kind():
    assert "kind" in _reason(b'{"run_id":"r","step":1}')


def test_decode_action_and_anomaly_raise_schema_error():
    with pytest.raises(SchemaError, match="^not JSON"):
        decode_action(b"{oops")
    with pytest.raises(SchemaError, match="run_id"):
        decode_action(
            b'{"action_id":"a","kind":"stop","reason":"x","issued_at":"2024-01-01T00:00:00Z",'
            b'"expires_at":"2024-01-01T00:01:00Z"}'
        )
    with pytest.raises(SchemaError, match="severity"):
        decode_anomaly(
            b'{"anomaly_id":"a","run_id":"r","detector":"d","metric":"m","message":"x",'
            b'"ts":"2024-01-01T00:00:00Z"}'
        )
    with pytest.raises(SchemaError):
        decode_anomaly(b"[1, 2]")


# -- strict decoding and the limits (docs/wire-format.md) ------------------------------------------

RECEIVED = datetime(2026, 11, 21, 9, 30, 5, tzinfo=UTC)


def _strict(**fields) -> bytes:
    import orjson

    event = {
        "schema_version": 1,
        "event_id": "e1",
        "run_id": "r",
        "rank": 0,
        "ts": "2026-11-21T09:30:00Z",
        "kind": "step",
        "step": 1,
        "loss": 2.0,
    }
    event.update(fields)
    return orjson.dumps({k: v for k, v in event.items() if v is not ...})


def _refusal(raw: bytes, **kwargs) -> str:
    with pytest.raises(SchemaError) as info:
        decode_event(raw, received_at=RECEIVED, **kwargs)
    return info.value.reason


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"event_id": ...}, "event_id"),
        ({"rank": ...}, "rank"),
        ({"ts": ...}, "ts"),
        ({"schema_version": ...}, "schema_version"),
        ({"step": "5"}, "step"),
        ({"step": 2.0}, "step"),
        ({"step": True}, "step"),
        ({"rank": True}, "rank"),
        ({"loss": "2.0"}, "loss"),
        ({"ts": 12345}, "ts"),
        ({"ts": "2026-11-21T09:30:00"}, "timezone"),
        ({"ts": "2026-11-21"}, "timezone"),
        ({"ts": "2099-01-01T00:00:00Z"}, "after the receive time"),
        ({"ts": "9999-12-31T00:00:00Z"}, "after the receive time"),
        ({"ts": "1970-01-01T00:00:00Z"}, "before"),
        ({"schema_version": 0}, "schema_version"),
        ({"schema_version": 2}, "schema_version"),
        ({"schema_version": True}, "schema_version"),
        ({"schema_version": 1.0}, "schema_version"),
        ({"memory": {"allocated": -1}}, "memory.allocated"),
        ({"step_time_s": -0.1}, "step_time_s"),
        ({"step_time_s": "NaN"}, "step_time_s"),
        ({"data_wait_s": "Infinity"}, "data_wait_s"),
        ({"rank": 10**6}, "rank"),
        ({"step": 2**63}, "step"),
        ({"memory": {"reserved": 2**60}}, "memory.reserved"),
        ({"x": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}, "nested deeper"),
        ({"module_grad_norms": {f"m{i}": 1.0 for i in range(10_001)}}, "module_grad_norms"),
        ({"run_id": "r" * 300}, "run_id"),
        ({"note": "n" * 5000}, "note"),
    ],
)
def test_strict_decoding_refuses_and_names_the_field(fields, says):
    assert says in _refusal(_strict(**fields))


@pytest.mark.parametrize(
    "kind, fields, says",
    [
        ("heartbeat", {"interval_s": "Infinity"}, "interval_s"),
        ("heartbeat", {"interval_s": 1e12}, "interval_s"),
        ("heartbeat", {"interval_s": 0}, "interval_s"),
        ("run_start", {"world_size": 10**7}, "world_size"),
    ],
)
def test_bounds_of_other_kinds(kind, fields, says):
    assert says in _refusal(_strict(kind=kind, step=..., loss=..., **fields))


def test_the_non_finite_strings_and_unknown_fields_are_still_accepted():
    event = decode_event(
        _strict(loss="NaN", grad_norm="-Infinity", future_field={"a": [1, 2]}), received_at=RECEIVED
    )
    assert math.isnan(event.loss) and event.grad_norm == -math.inf and event.future_field == {"a": [1, 2]}


def test_null_values_oversized_messages_and_a_wrong_key_are_refused():
    assert "null value" in _refusal(None)
    assert "limit" in _refusal(b"x" * 2_000_000)
    assert "does not match run_id" in _refusal(_strict(), key=b"other")


def test_limits_are_configurable():
    from runwatch.contract.schema import WireLimits

    raw = _strict(rank=20_000)
    assert "rank" in _refusal(raw)
    assert decode_event(raw, received_at=RECEIVED, limits=WireLimits(max_world_size=100_000)).rank == 20_000


# -- ranges declared on the fields (``Within``), kinds read from the union -----------------------------


@pytest.mark.parametrize(
    "kind, fields, says",
    [
        ("step", {"mfu": 101.0}, "mfu: 101.0 is above the limit 100"),
        ("step", {"compute_s": 1e9}, "compute_s"),
        ("step", {"tokens_per_s": 1e13}, "tokens_per_s"),
        ("step", {"off_step_s": {"eval": "NaN"}}, "off_step_s.eval: must be finite"),
        ("heartbeat", {"time_in_phase_s": 1e9}, "time_in_phase_s"),
        ("evidence", {"seconds_since_step": "Infinity"}, "seconds_since_step"),
        ("checkpoint", {"uri": "s3://c", "lr": [0.1, "NaN"]}, "lr: must be finite"),
    ],
)
def test_every_declared_range_is_enforced(kind, fields, says):
    extra = {} if kind == "step" else {"step": 3 if kind in ("checkpoint", "evidence") else ..., "loss": ...}
    assert says in _refusal(_strict(kind=kind, **{**extra, **fields}))


def test_a_field_that_declares_a_range_is_checked_without_a_list_to_update():
    from typing import Annotated

    from runwatch.contract.limit_checks import bounded_fields
    from runwatch.contract.limits import Within
    from runwatch.contract.schema import WireFloat

    class NewerStep(StepEvent):
        warmup_s: Annotated[WireFloat | None, Within("max_duration_s")] = None

    names = [name for name, _ in bounded_fields(NewerStep)]
    assert names[-1] == "warmup_s"
    assert {"step_time_s", "data_wait_s", "compute_s", "samples_per_s", "mfu", "off_step_s"} <= set(names)

    class Misspelt(StepEvent):
        warmup_s: Annotated[WireFloat | None, Within("max_duraton_s")] = None

    with pytest.raises(TypeError, match="max_duraton_s"):
        bounded_fields(Misspelt)


def test_the_event_kinds_are_the_union_s_and_the_group_report_is_the_workers_own():
    from typing import get_args

    from runwatch.contract.schema import EVENT_MODELS, TelemetryEvent

    union = get_args(get_args(TelemetryEvent)[0])
    assert EVENT_KINDS == tuple(model.model_fields["kind"].default for model in EVENT_MODELS)
    assert {m.model_fields["kind"].default for m in union} - set(EVENT_KINDS) == {"group_report"}


def test_the_contract_s_classes_keep_the_one_module_name_snapshots_use():
    import pickle

    from runwatch.contract.schema import WireLimits

    assert (
        StackFrame.__module__ == StepEvent.__module__ == WireLimits.__module__ == "runwatch.contract.schema"
    )
    frame = StackFrame(file="t.py", line=1, function="main")
    assert b"runwatch.contract.schema" in pickle.dumps(frame) and pickle.loads(pickle.dumps(frame)) == frame
