"""A run's state as one record of the compacted ``runwatch.state`` topic: the codec.

A snapshot is everything the worker holds for a run (its ``RunMonitor``: every detector, the join,
the policy with its rollback count and episodes; and when its last event arrived), pickled and
compressed, behind a small JSON header that says which run it is and the offset of the last
telemetry event it includes. The record's key is the run id, so compaction keeps each run's newest
snapshot; a tombstone (no value) deletes a run that ended a retention period ago.

Why a topic of our own and not a Faust table: Faust's changelog recovery has open bugs on exactly
what a long-lived compacted changelog looks like (faust-streaming #176: recovery waits for offsets
that compaction removed; #597: an empty changelog partition stalls recovery; #651: retention moving
the log start during a long recovery). Restoring here is a plain read of a partition from its first
to its end offset as they are when the read starts (``state_reader.py``): gaps, an empty partition
and a moving log start are all just ends of that loop.

Layout: ``MAGIC`` (4 bytes), an HMAC-SHA256 of the rest under the workers' state key (32 bytes),
header length (4 bytes, big-endian), the header (JSON), then the body (zlib-compressed pickle).

Two walls keep a record from running code in the worker:

- the **state key** (``$RUNWATCH_STATE_SECRET``) is the workers' alone: never a key a trainer holds
  (trainers hold only the actions' public keys, and once held the old shared action secret). A record
  not signed with it is refused before its body is looked at;
- the body is read by ``state_classes.StateUnpickler``, which resolves only the classes a run's state
  is made of (runwatch's detectors and engine, the river and numpy pieces they hold, datetimes and a
  few containers): a record that names anything else (``os.system``, ``builtins.eval``...) is refused
  before that name is imported or called, signed or not.

A record that does not decode raises ``SnapshotError``: the worker counts it, logs it with its offset,
and the run starts fresh.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
import struct
import zlib
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from runwatch.contract.signing import MissingKeyError
from runwatch.contract.topics import LEGACY_SECRET_ENV, PUBLIC_KEYS_ENV
from runwatch.worker.state.classes import StateUnpickler

MAGIC = b"RWS1"
FORMAT = 1
_LENGTH = struct.Struct(">I")

STATE_SECRET_ENV = "RUNWATCH_STATE_SECRET"
MIN_SECRET_BYTES = 32  # HMAC-SHA256's key should be at least its output's size; shorter is guessable


class SnapshotError(ValueError):
    """A state record that cannot be read."""


class MissingStateSecretError(MissingKeyError):
    """No usable state key: durable state is refused (``--no-state`` runs without it)."""


def resolve_state_secret(secret: str | bytes | None = None, action_secret: bytes | None = None) -> bytes:
    """The given state key, else ``$RUNWATCH_STATE_SECRET``: 32 bytes or more, never the action signing
    key (``action_secret``: its seed), and never what trainers are given (``$RUNWATCH_ACTION_PUBLIC_KEYS``,
    the old ``$RUNWATCH_ACTION_SECRET``). Raises ``MissingStateSecretError`` saying what to do."""
    value = secret if secret is not None else os.environ.get(STATE_SECRET_ENV)
    make = "python -c 'import secrets; print(secrets.token_hex(32))'"
    if not value:
        raise MissingStateSecretError(
            f"no state key: set {STATE_SECRET_ENV} for the workers (one value for every worker of the "
            f"group, never given to trainers; make one with: {make}), or run with --no-state"
        )
    key = value.encode() if isinstance(value, str) else value
    if len(key) < MIN_SECRET_BYTES:
        raise MissingStateSecretError(
            f"{STATE_SECRET_ENV} is {len(key)} bytes; at least {MIN_SECRET_BYTES} are needed "
            f"(HMAC-SHA256). Make one with: {make}"
        )
    if action_secret is not None and hmac.compare_digest(key, action_secret):
        raise MissingStateSecretError(
            f"{STATE_SECRET_ENV} is the action signing key: give the workers' state a key of its own "
            f"(make one with: {make})"
        )
    for name in (PUBLIC_KEYS_ENV, LEGACY_SECRET_ENV):
        if hmac.compare_digest(key, os.environ.get(name, "").encode()):
            raise MissingStateSecretError(
                f"{STATE_SECRET_ENV} is {name}, which trainers are given: give the workers a key of their "
                f"own (make one with: {make})"
            )
    return key


class SnapshotHeader(BaseModel):
    """What a snapshot is of. ``offset``: the telemetry offset (in ``partition``) of the last event it
    includes, -1 when none; events at or below it are skipped when the run is restored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    format: int = FORMAT
    run_id: str
    partition: int
    offset: int
    events: int  # events the run had seen when it was taken
    taken_at: datetime
    # set on the marker of an ended run (no body): kept until retention ends it
    ended_at: datetime | None = None
    # set on the record of a run let go without its end: its body is the run's ledger (RunLedger), kept
    # until runs.ledger_retention_s ends it
    let_go_at: datetime | None = None
    config_sha: str  # the detector config it was taken under: another config starts the run fresh
    # the telemetry topic's id (where the broker reports one) when ``offset`` was read: a snapshot of
    # another log (the topic was recreated since) is not restored as it is (processor.py)
    log_id: str | None = None


def config_digest(config_json: str) -> str:
    return hashlib.sha256(config_json.encode()).hexdigest()[:16]


_MAC = 32


def encode_snapshot(header: SnapshotHeader, state: Any, secret: bytes, level: int = 1) -> bytes:
    """The record value, signed with the state key ``secret``. ``state`` None: a marker with no body
    (an ended run)."""
    head = header.model_dump_json().encode()
    body = (
        b"" if state is None else zlib.compress(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL), level)
    )
    signed = _LENGTH.pack(len(head)) + head + body
    return MAGIC + hmac.digest(secret, signed, "sha256") + signed


def decode_header(raw: bytes, secret: bytes) -> tuple[SnapshotHeader, memoryview]:
    """The header, and the body still compressed (restoring a run it is not kept for costs nothing).
    ``secret``: the workers' state key."""
    view = memoryview(raw)
    start = 4 + _MAC
    if len(raw) < start + 4 or bytes(view[:4]) != MAGIC:
        raise SnapshotError("not a runwatch state record (bad magic)")
    if not hmac.compare_digest(bytes(view[4:start]), hmac.digest(secret, view[start:], "sha256")):
        raise SnapshotError(
            f"a state record not signed with the workers' state key ({STATE_SECRET_ENV}; one signed with "
            "any key a trainer holds is refused too): refused unread"
        )
    (length,) = _LENGTH.unpack(view[start : start + 4])
    head_at = start + 4
    if head_at + length > len(raw):
        raise SnapshotError("a truncated state record (its header is cut)")
    try:
        header = SnapshotHeader.model_validate_json(bytes(view[head_at : head_at + length]))
    except ValidationError as exc:
        raise SnapshotError(f"a state record with an unreadable header: {exc.errors()[0]['msg']}") from exc
    if header.format != FORMAT:
        raise SnapshotError(f"a state record of format {header.format} (this worker reads {FORMAT})")
    return header, view[head_at + length :]


def decode_body(body: memoryview) -> Any:
    """The state a snapshot holds (None for a marker), unpickled by ``StateUnpickler``: only the classes
    a run's state is made of are resolved, whatever key signed the record."""
    if not len(body):
        return None
    try:
        return StateUnpickler(io.BytesIO(zlib.decompress(body))).load()
    except Exception as exc:  # zlib, a refused class, or a class that changed shape: all unreadable
        raise SnapshotError(f"a state record whose body cannot be read: {type(exc).__name__}: {exc}") from exc
