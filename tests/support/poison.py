"""Malformed telemetry of every class the hostile review found (issue 11), generated from a seed.

Each generator returns ``(key, value)``: what a careless or hostile client could put on the
telemetry topic. Every one of them must be dead-lettered by the worker and never reach a
detector or a table. ``valid_run_ids`` lets poison share keys (so partitions and runs) with
valid runs, which must go on unharmed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import UTC, datetime

import orjson

# (key, value), or (key, value, the record's metadata as KafkaProducer.send's keyword arguments)
Poison = tuple[bytes | None, bytes | None] | tuple[bytes | None, bytes | None, dict]
Y9999_MS = 253402300799000  # 9999-12-31T23:59:59Z as a record timestamp
Y2200_MS = 7258118400000  # 2200-01-01
PARTITIONS = 4  # the telemetry topic's (ensure_topics)


def _now_iso() -> str:
    return datetime.now(UTC).isoformat()


def _event(rng: random.Random, run_id: str, kind: str = "step") -> dict:
    """A valid event to be broken."""
    event = {
        "schema_version": 1,
        "event_id": f"poison-{rng.getrandbits(64):016x}",
        "run_id": run_id,
        "rank": 0,
        "ts": _now_iso(),
        "kind": kind,
    }
    if kind == "step":
        event.update(
            step=rng.randrange(0, 10_000),
            loss=2.5,
            grad_norm=1.0,
            step_time_s=0.1,
            module_grad_norms={"encoder": 0.5, "head": 0.2},
            memory={"allocated": 1 << 30},
        )
    elif kind == "heartbeat":
        event.update(step=5, phase="train", time_in_phase_s=0.0, interval_s=5.0)
    elif kind == "run_start":
        event.update(world_size=1, config={"lr": 0.001})
    return event


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


class PoisonFactory:
    """``make(rng)`` gives one malformed message of a random class; ``classes`` names them all."""

    def __init__(self, rng: random.Random, valid_run_ids: list[str]):
        self.rng = rng
        self.valid_run_ids = valid_run_ids
        self.counter = 0
        # name -> generator; a name starting with "case<N>" reproduces issue 11's numbered case N
        self.classes: dict[str, Callable[[], Poison]] = {
            "case1_null_value": self.null_value,
            "case2_ts_without_timezone": lambda: self.with_fields(ts="2026-11-21T09:30:00"),
            "case2_ts_date_only": lambda: self.with_fields(ts="2026-11-21"),
            "case4_rank_1e6": lambda: self.with_fields(rank=10**6),
            "case4_rank_1e7": lambda: self.with_fields(rank=10**7),
            "case4_world_size_1e7": lambda: self.with_fields(kind="run_start", world_size=10**7),
            "case5_ts_9999": lambda: self.with_fields(ts="9999-12-31T00:00:00Z"),
            "case6_step_2_63": lambda: self.with_fields(step=2**63),
            "case6_step_2_64": self.step_2_64,
            "case6_nesting_256_1023": lambda: self.with_raw_field(
                "x", _nested(self.rng.randrange(256, 1024))
            ),
            "case7_ts_2099": lambda: self.with_fields(ts="2099-01-01T00:00:00Z"),
            "case7_interval_infinity": lambda: self.with_fields(kind="heartbeat", interval_s="Infinity"),
            "case7_interval_1e12": lambda: self.with_fields(kind="heartbeat", interval_s=1e12),
            "case8_missing_event_id": lambda: self.without("event_id"),
            "case8_missing_rank": lambda: self.without("rank"),
            "case8_missing_ts": lambda: self.without("ts"),
            "case8_missing_schema_version": lambda: self.without("schema_version"),
            "case8_step_string": lambda: self.with_fields(step="5"),
            "case8_step_float": lambda: self.with_fields(step=2.0),
            "case8_step_bool": lambda: self.with_fields(step=True),
            "case8_ts_number": lambda: self.with_fields(ts=12345),
            "case8_schema_version_0": lambda: self.with_fields(schema_version=0),
            "case8_schema_version_2": lambda: self.with_fields(schema_version=2),
            "case8_negative_memory": lambda: self.with_fields(memory={"allocated": -1}),
            "case8_negative_step_time": lambda: self.with_fields(step_time_s=-0.5),
            "not_json": lambda: (
                self.key(),
                bytes(self.rng.getrandbits(8) for _ in range(self.rng.randrange(1, 200))),
            ),
            "truncated_json": self.truncated,
            "empty_value": lambda: (self.key(), b""),
            "json_not_an_object": lambda: (
                self.key(),
                self.rng.choice([b"[1,2]", b"42", b"null", b'"step"', b"true"]),
            ),
            "invalid_utf8": lambda: (self.key(), b'{"kind":"step","run_id":"\xff\xfe"}'),
            "missing_run_id": lambda: self.without("run_id"),
            "missing_kind": lambda: self.without("kind"),
            "missing_step": lambda: self.without("step"),
            "empty_run_id": lambda: self.with_fields(run_id=""),
            "unknown_kind": lambda: self.with_fields(kind="telemetry_v9"),
            "key_mismatch": self.key_mismatch,
            "rank_negative": lambda: self.with_fields(rank=-1),
            "rank_bool": lambda: self.with_fields(rank=True),
            "loss_text": lambda: self.with_fields(loss="big"),
            "module_norm_text": lambda: self.with_fields(module_grad_norms={"encoder": "huge"}),
            "step_time_nan": lambda: self.with_fields(step_time_s="NaN"),
            "data_wait_infinite": lambda: self.with_fields(data_wait_s="Infinity"),
            "memory_1e20": lambda: self.with_fields(memory={"reserved": 10**19}),
            "ts_1970": lambda: self.with_fields(ts="1970-01-01T00:00:00Z"),
            "ts_garbage": lambda: self.with_fields(ts="yesterday"),
            "too_many_modules": lambda: self.with_fields(
                module_grad_norms={f"m{i}": 1.0 for i in range(10_001)}
            ),
            "too_many_categories": lambda: self.with_fields(
                category_loss={f"c{i}": {"mean": 1.0, "count": 1} for i in range(1_001)}
            ),
            "long_string": lambda: self.with_fields(note="x" * 5_000),
            "long_run_id": lambda: self.with_fields(run_id="r" * 1_000),
            "heartbeat_bad_phase": lambda: self.with_fields(kind="heartbeat", phase="sleeping"),
            "step_above_limit": lambda: self.with_fields(step=10**13),
            # issue 23: what the record's metadata says (its timestamp, key, partition) and the run id
            "i23_case1_ts_9999_record_time_0": lambda: self.with_record(
                {"timestamp_ms": 0}, ts="9999-12-31T23:59:59Z"
            ),
            "i23_ts_9999_record_time_negative": lambda: self.with_record(
                {"timestamp_ms": -1}, ts="9999-12-31T23:59:59Z"
            ),
            "i23_ts_9999_record_time_9999": lambda: self.with_record(
                {"timestamp_ms": Y9999_MS}, ts="9999-12-31T23:59:59Z"
            ),
            "i23_ts_2200_record_time_2200": lambda: self.with_record(
                {"timestamp_ms": Y2200_MS}, ts="2200-01-01T00:00:10Z"
            ),
            "i23_no_key": self.no_key,
            "i23_wrong_partition": self.wrong_partition,
            "i23_run_id_newline": self.run_id_newline,
        }
        # Big messages (about 1 MB): few, for the time they take; not picked at random.
        self.big: dict[str, Callable[[], Poison]] = {
            "case3_1mb_not_json": lambda: (self.key(), b"\x00garbage" * 125_000),
            "case3_1mb_json_string": lambda: self.with_fields(note="y" * 1_050_000),
        }

    def key(self) -> bytes:
        self.counter += 1
        if self.valid_run_ids and self.rng.random() < 0.5:
            return self.rng.choice(self.valid_run_ids).encode()  # shares a valid run's partition
        return f"fuzz-poison-{self.rng.randrange(64)}".encode()

    def _base(self, kind: str = "step") -> tuple[bytes, dict]:
        key = self.key()
        return key, _event(self.rng, key.decode(), kind)

    def with_fields(self, kind: str = "step", **fields) -> Poison:
        key, event = self._base(kind)
        event.update(fields)
        return key, orjson.dumps(event)

    def with_raw_field(self, name: str, raw: bytes) -> Poison:
        key, event = self._base()
        body = orjson.dumps(event)
        return key, body[:-1] + b',"' + name.encode() + b'":' + raw + b"}"

    def without(self, name: str) -> Poison:
        key, event = self._base()
        event.pop(name)
        return key, orjson.dumps(event)

    def null_value(self) -> Poison:
        return self.key(), None

    def step_2_64(self) -> Poison:
        key, event = self._base()
        body = orjson.dumps({**event, "step": 0}).replace(b'"step":0', b'"step":18446744073709551616')
        return key, body

    def truncated(self) -> Poison:
        key, event = self._base()
        body = orjson.dumps(event)
        return key, body[: self.rng.randrange(1, len(body) - 1)]

    def key_mismatch(self) -> Poison:
        key, event = self._base()
        event["run_id"] = key.decode() + "-other"
        return key, orjson.dumps(event)

    def with_record(self, metadata: dict, **fields) -> Poison:
        key, value = self.with_fields(**fields)
        return key, value, metadata

    def no_key(self) -> Poison:
        key, value = self.with_fields()
        return None, value, {"partition": self.rng.randrange(PARTITIONS)}

    def wrong_partition(self) -> Poison:
        from kafka.partitioner.default import murmur2

        key, value = self.with_fields()
        home = (murmur2(key) & 0x7FFFFFFF) % PARTITIONS
        return key, value, {"partition": (home + 1 + self.rng.randrange(PARTITIONS - 1)) % PARTITIONS}

    def run_id_newline(self) -> Poison:
        run_id = f"fuzz-nl-{self.rng.randrange(64)}\nERROR forged"
        event = _event(self.rng, run_id)
        return run_id.encode(), orjson.dumps(event)

    def make(self) -> tuple[str, Poison]:
        name = self.rng.choice(list(self.classes))
        return name, self.classes[name]()
