"""``RunWatch``: the object training code holds to publish one rank's telemetry.

It is composed of three parts, each with one job: :class:`~runwatch.producer.publish.events.RunEvents`
builds the typed events (run id, rank, clock), a :class:`~runwatch.producer.publish.delivery.Delivery`
takes them (:class:`~runwatch.producer.publish.kafka_delivery.KafkaDelivery` by default; the JSONL
recorder's writes a file), and :mod:`~runwatch.producer.publish.metadata` says what the run is.
What is left here is the run's own bookkeeping: its checkpoints and their LR, the watchers it
made, a stop that was applied, and how the run ended.
"""

from __future__ import annotations

import atexit
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

from runwatch.contract import groups, topics
from runwatch.contract.schema import (
    ActionAckEvent,
    CheckpointEvent,
    CheckpointRef,
    CrashEvent,
    EvalEvent,
    EventBase,
    HeartbeatEvent,
    RunEndEvent,
    RunStartEvent,
    StackEvidenceEvent,
    StepEvent,
    bound_crash,
    bound_evidence,
)
from runwatch.producer.publish.crash_capture import CrashCapture
from runwatch.producer.publish.delivery import Delivery, PublisherStats
from runwatch.producer.publish.events import RunEvents, declared_fields, unknown_field_error
from runwatch.producer.publish.kafka_client import DEFAULT_LINGER_MS
from runwatch.producer.publish.kafka_delivery import (
    DEFAULT_BATCH_INTERVAL_S,
    DEFAULT_SPOOL_MAX_BYTES,
    KafkaDelivery,
    default_spool_dir,
)
from runwatch.producer.publish.lr import base_lrs
from runwatch.producer.publish.metadata import detect_rank_world, run_start_fields
from runwatch.producer.publish.run_end import end_status, exit_status, stop_record
from runwatch.producer.publish.spool import Overflow

if TYPE_CHECKING:
    from runwatch.producer.instrument.watch import Watcher

log = logging.getLogger(__name__)

R = TypeVar("R", bound="RunWatch")


# What a launcher sets on every rank of one launch, and changes at each requeue or restart: the job, and
# how many times it was restarted (Slurm's requeue keeps the job id; torchelastic restarts its workers)
LAUNCH_IDS = (
    ("slurm", "SLURM_JOB_ID", "SLURM_RESTART_COUNT"),
    ("torchelastic", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"),
)


def launch_attempt(env: Mapping[str, str] = os.environ) -> str | None:
    """The attempt every rank of this launch can name alike, from its launcher's variables (Slurm's job id
    and restart count, torchelastic's run id and restart count); None when no launcher says."""
    parts = [
        f"{name}-{env[job]}.{env.get(restarts, '0')}" for name, job, restarts in LAUNCH_IDS if env.get(job)
    ]
    return "+".join(parts)[:128] or None


def resolve_attempt(attempt: str | None, rank: int) -> str | None:
    """The attempt a ``RunWatch`` names: given, from ``$RUNWATCH_ATTEMPT``, from the launcher's variables
    (``launch_attempt``: the same on every rank, so that ranks 1..N of a requeued job refuse the old
    attempt's stop without rank sync, issue 35), or new on rank 0."""
    attempt = (
        attempt
        or os.environ.get(topics.ATTEMPT_ENV)
        or launch_attempt()
        or (uuid.uuid4().hex if rank == 0 else None)
    )
    if attempt is not None and not 0 < len(attempt) <= 128:
        raise ValueError(f"attempt: {len(attempt)} characters (1 to 128)")
    return attempt


def resolve_group_size(group_size: int | None) -> int:
    """The ranks per group of a split run: given, from ``$RUNWATCH_GROUP_SIZE``, or 64."""
    if group_size is None:
        text = os.environ.get(topics.GROUP_SIZE_ENV, "").strip()
        try:
            group_size = int(text) if text else groups.DEFAULT_GROUP_SIZE
        except ValueError:
            raise ValueError(f"{topics.GROUP_SIZE_ENV}={text[:40]!r}: not a whole number of ranks") from None
    if not 1 <= group_size <= groups.MAX_GROUP_SIZE:
        raise ValueError(f"group_size: {group_size} ranks (1 to {groups.MAX_GROUP_SIZE})")
    return group_size


class RunWatch:
    """Publishes one rank's telemetry for one run.

    Construction returns immediately whether or not a broker is reachable. Call
    :meth:`close` at the end of the run (it is also registered with ``atexit``), or use it as
    a context manager, ``with RunWatch(...) as rw:``, which ends the run as ``completed``,
    ``stopped`` (after an applied stop action), ``failed`` (the body raised) or ``interrupted``.

    ``rank`` and ``world_size`` default to what torch.distributed or the launcher's
    environment says. Rank 0 publishes ``run_start`` with metadata collected on the spot
    (git sha and dirty flag, host, versions, GPUs, the ``config`` and its hash, ``seed``,
    ``dataset_version``, ``tags``, ``baseline_key``, ``job_id``); ``collect_metadata=False``
    skips the collection, and ``run_start`` overrides any field (``RunStartEvent``'s: another name raises
    ``UnknownFieldError``, as in every method here; a field of your own goes in ``extra={...}``, there and in
    :meth:`step`, :meth:`eval` and :meth:`ack`). ``clock`` stamps every event's ``ts`` (default: now, UTC).

    Events the broker does not take go to a disk spool under ``spool_dir`` (default
    :func:`default_spool_dir`; ``spool=False`` turns it off, and then they are dropped),
    bounded by ``spool_max_bytes``; past the bound ``spool_overflow`` drops the newest
    (default) or the oldest events. A ``RunWatch`` started with the same spool directory
    (a restarted run) replays what an earlier process left there.

    Events go to the broker in batches at most every ``batch_interval_s`` (default 0.1 s: a fast
    loop's events share produce requests, which cost the publisher thread far more than the events);
    an event after a quieter spell goes at once.

    ``delivery``: where the events go instead of Kafka (the Kafka and spool options are then
    unused); :class:`~runwatch.producer.publish.recorder.JsonlRecorder` is a ``RunWatch`` whose
    delivery writes a JSONL file.

    ``group_size``: ranks per group of a run split by rank group (default ``$RUNWATCH_GROUP_SIZE``, else
    64; docs/operations.md): a run of more ranks is split, each group's telemetry keyed to its own
    partition, so that one run spreads over every worker. Give every rank the same value.

    ``attempt`` names this attempt of the run (default: ``$RUNWATCH_ATTEMPT``, else a new random id on
    rank 0 and none on the other ranks): a job requeued or restarted under the same ``run_id`` is a new
    attempt, watched as a fresh run, and its listener refuses actions issued for another attempt. Give
    every rank the same value (``RUNWATCH_ATTEMPT`` set by the launcher, new for each launch) for every
    rank's listener to check it; without it, rank 0 decides for the others when they apply in step.

    ``capture_crashes`` (default on): the process's last words are published as a ``crash`` event
    (an uncaught exception, SIGTERM; a fatal signal's stacks for ``runwatch launch`` to report:
    :mod:`~runwatch.producer.publish.crash_capture`, docs/launch.md). The hooks found are chained, never
    replaced, and put back at :meth:`close`.
    """

    def __init__(
        self,
        run_id: str,
        bootstrap: str | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        queue_size: int = 10_000,
        max_block_ms: int = 100,
        linger_ms: int = DEFAULT_LINGER_MS,
        delivery_timeout_ms: int = 3000,
        topic: str = topics.TELEMETRY,
        run_start: dict[str, Any] | None = None,
        config: Any = None,
        seed: int | None = None,
        dataset_version: str | None = None,
        tags: dict[str, str] | None = None,
        baseline_key: str | None = None,
        job_id: str | None = None,
        collect_metadata: bool = True,
        spool: bool = True,
        spool_dir: str | os.PathLike[str] | None = None,
        spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES,
        spool_overflow: Overflow = "drop_newest",
        clock: Callable[[], datetime] | None = None,
        delivery: Delivery | None = None,
        attempt: str | None = None,
        batch_interval_s: float = DEFAULT_BATCH_INTERVAL_S,
        group_size: int | None = None,
        capture_crashes: bool = True,
    ):
        if run_start:  # (refused before anything is started: a typo here is the caller's to fix)
            declared = declared_fields(RunStartEvent) | {"extra"}
            unknown = [name for name in run_start if name not in declared]
            if unknown:
                raise unknown_field_error(RunStartEvent, unknown)
        if rank is None or world_size is None:
            detected_rank, detected_world = detect_rank_world()
            rank = detected_rank if rank is None else rank
            world_size = detected_world if world_size is None else world_size
        self.group_size = resolve_group_size(group_size)
        self.world_size = world_size
        split = (self.group_size, world_size) if groups.is_split(world_size, self.group_size) else None
        self._events = RunEvents(run_id, rank, clock, split)
        self._leads_group = split is not None and rank % self.group_size == 0  # (rank 0's group too)
        self.attempt = resolve_attempt(attempt, rank)
        self.bootstrap = bootstrap or topics.bootstrap_from_env("127.0.0.1:9092")
        # the Kafka delivery's disk spool (None: off, or another delivery)
        self.spool_path: Path | None = None
        if delivery is None:
            if spool:
                self.spool_path = (
                    Path(spool_dir).resolve() if spool_dir is not None else default_spool_dir(run_id, rank)
                )
            delivery = KafkaDelivery(
                run_id,
                rank,
                self.bootstrap,
                key=groups.record_key(run_id, rank, split[0] if split else None),
                topic=topic,
                queue_size=queue_size,
                max_block_ms=max_block_ms,
                linger_ms=linger_ms,
                delivery_timeout_ms=delivery_timeout_ms,
                spool_path=self.spool_path,
                spool_max_bytes=spool_max_bytes,
                spool_overflow=spool_overflow,
                batch_interval_s=batch_interval_s,
            )
        self.delivery = delivery
        self.checkpoints: list[CheckpointRef] = []
        # the applied stop action's id and cause (see note_stop)
        self.stopped_by: dict[str, str] | None = None
        # Whose param groups' LR a checkpoint records (watch()'s optimizer, or an ActionListener's), and
        # the LR it had when first seen: what a rollback scales (publish/lr.py).
        self.lr_optimizer: Any = None
        self.initial_lr: list[float] | None = None
        self._watchers: list[Watcher] = []  # made by watch(), closed by close()
        self._warned_invalid = False
        self._closed = False
        self.last_step: int | None = None  # the last step published: what a crash event names
        atexit.register(self.close, timeout=2.0)
        self.crash_capture: CrashCapture | None = CrashCapture(self).install() if capture_crashes else None
        if rank == 0:
            # What the run is (code, machine, versions, config) is collected here, once, so every
            # run in ClickHouse can be compared with its baseline; ``run_start`` overrides any of it.
            found = run_start_fields(
                world_size,
                collect_metadata,
                config=config,
                seed=seed,
                dataset_version=dataset_version,
                tags=tags,
                baseline_key=baseline_key,
                job_id=job_id,
            )
            if self.attempt is not None:
                found["attempt"] = self.attempt
            self.publish(self._events.build(RunStartEvent, **{**found, **(run_start or {})}))
        elif self._leads_group:
            # The first rank of each rank group of a split run says when the run starts and ends too (only
            # the attempt and the world): its group's worker never sees rank 0's (contract/groups.py)
            fields: dict[str, Any] = {"world_size": world_size}
            if self.attempt is not None:
                fields["attempt"] = self.attempt
            self.publish(self._events.build(RunStartEvent, **fields))

    @property
    def run_id(self) -> str:
        return self._events.run_id

    @property
    def rank(self) -> int:
        return self._events.rank

    @property
    def clock(self) -> Callable[[], datetime] | None:
        """What stamps every event's ``ts`` (None: now, UTC); may be set while the run goes on."""
        return self._events.clock

    @clock.setter
    def clock(self, clock: Callable[[], datetime] | None) -> None:
        self._events.clock = clock

    @property
    def stats(self) -> PublisherStats:
        """What happened to this run's events so far (final after :meth:`close`)."""
        return self.delivery.stats

    # -- what training code calls -------------------------------------------------

    def publish(self, event: EventBase) -> bool:
        """Hand one event to the delivery; never blocks. Returns False if it was dropped."""
        if self._closed:
            self.delivery.refuse("closed")
            return False
        return self.delivery.deliver(event)

    def step(self, step: int, *, extra: Mapping[str, Any] | None = None, **fields: Any) -> bool:
        """Publish step ``step``: ``fields`` are ``StepEvent``'s (``loss=``, ``grad_norm=``...; another name
        raises ``UnknownFieldError`` with the nearest ones), ``extra`` figures of your own, kept as they are.
        A field of the wrong type is dropped with a warning, never raised (``stats.dropped``)."""
        self.last_step = step
        return self._build_and_publish(StepEvent, extra, step=step, **fields)

    def queue_step(self, step: int, fields: dict[str, Any]) -> bool:
        """:meth:`step` for runwatch's own instrumentation (the watcher's step events), with less of its cost
        in the training loop: ``fields`` (taken over) are checked by name now (``UnknownFieldError``) and
        validated by a delivery that has a thread of its own (Kafka's) there, in its batch; a value that
        does not validate is dropped and counted as ``invalid`` there. Returns False only when the event
        was dropped at once (closed, queue full)."""
        self.last_step = step
        deliver_later = getattr(self.delivery, "deliver_later", None)
        if deliver_later is None:
            return self._build_and_publish(StepEvent, None, step=step, **fields)
        fields["step"] = step
        pending = self._events.pending(StepEvent, fields)
        if self._closed:
            self.delivery.refuse("closed")
            return False
        ok: bool = deliver_later(pending)
        return ok

    def publish_crash(self, *, extra: Mapping[str, Any] | None = None, **fields: Any) -> bool:
        """Publish a ``crash`` event (``CrashEvent`` fields), bounded (``bound_crash``); the crash capture
        calls it, and so may a framework that catches the error itself."""
        try:
            event = bound_crash(self._events.build(CrashEvent, extra, **fields))
        except ValidationError as exc:
            self.delivery.refuse("invalid")
            log.warning("runwatch: dropped an invalid crash event: %s", exc)
            return False
        return self.publish(event)

    def eval(
        self,
        step: int,
        split: str = "val",
        loss: float | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> bool:
        """Publish an eval of step ``step``: ``fields`` are ``EvalEvent``'s (``metrics=``, ``per_category=``),
        ``extra`` fields of your own."""
        return self._build_and_publish(EvalEvent, extra, step=step, split=split, loss=loss, **fields)

    def heartbeat(
        self,
        step: int | None,
        phase: str = "train",
        time_in_phase_s: float = 0.0,
        in_sync: bool | None = None,
        interval_s: float | None = None,
        host_load: dict[str, Any] | None = None,
        gpu: dict[str, Any] | None = None,
        host: str | None = None,
    ) -> bool:
        """``in_sync``: this rank has done its part of the current step and waits for its peers
        (True), is still working on it (False), or it is not measured (None: left out).
        ``interval_s``: the period of the heartbeats (the worker's silence timeout follows it).
        ``host_load``: how busy the host was (``HostLoad`` fields; the heartbeat thread samples it).
        ``gpu``: the rank's GPU as NVML reports it (``GpuHealth`` fields; instrument/gpu_health.py).
        ``host``: the rank's host name (the heartbeat thread sends it on its first beat)."""
        return self._build_and_publish(
            HeartbeatEvent,
            None,
            step=step,
            phase=phase,
            time_in_phase_s=time_in_phase_s,
            in_sync=in_sync,
            interval_s=interval_s,
            host_load=host_load,
            gpu=gpu,
            host=host,
        )

    def evidence(
        self,
        step: int | None,
        *,
        threads: list[Any],
        reason: str = "no_progress",
        phase: str = "train",
        seconds_since_step: float | None = None,
        source: str = "current_frames",
        flight_recorder: str | None = None,
        flight_recorder_status: str | None = None,
    ) -> bool:
        """Publish what this rank is doing while its steps do not move: ``threads`` (``ThreadStack``s or
        their fields), and PyTorch's flight recorder dump (``flight_recorder``, JSON text) with its status.
        Bounded before it goes (``bound_evidence``: threads, frames, strings, bytes; what was cut is marked).
        The heartbeat thread calls this (``stacks_after_s``)."""
        try:
            event = self._events.build(
                StackEvidenceEvent,
                step=step,
                reason=reason,
                phase=phase,
                seconds_since_step=seconds_since_step,
                source=source,
                threads=threads,
                flight_recorder=flight_recorder,
                flight_recorder_status=flight_recorder_status,
            )
        except ValidationError as exc:
            self.delivery.refuse("invalid")
            log.warning("runwatch: dropped an invalid evidence event: %s", exc)
            return False
        return self.publish(bound_evidence(event))

    def checkpoint(
        self, step: int, path: str, ok: bool = True, lr: list[float] | None = None
    ) -> CheckpointRef:
        """Register a checkpoint already written at ``path`` and announce it to the worker.

        A rollback restores the newest confirmed-good checkpoint taken before the fault, and sets
        the LR to the LR recorded here times its scale. ``lr``: each param group's LR at the save
        (default: read from the optimizer given to :meth:`watch` or an ``ActionListener``).
        """
        if lr is None:
            lr = base_lrs(self.lr_optimizer)
        ref = CheckpointRef(step=step, uri=str(path), lr=lr)
        if ok:
            self.checkpoints.append(ref)
        self.publish(self._events.build(CheckpointEvent, step=step, uri=str(path), ok=ok, lr=lr))
        return ref

    def track_lr(self, optimizer: Any) -> None:
        """Record ``optimizer``'s LR with each checkpoint (and now, as the run's starting LR)."""
        if optimizer is None:
            return
        self.lr_optimizer = optimizer
        if self.initial_lr is None:
            self.initial_lr = base_lrs(optimizer)

    def ack(self, *, extra: Mapping[str, Any] | None = None, **fields: Any) -> bool:
        return self._build_and_publish(ActionAckEvent, extra, **fields)

    def watch(self, model: Any, optimizer: Any = None, **options: Any) -> Watcher:
        """Instrument ``model`` and ``optimizer``: see :class:`runwatch.producer.instrument.watch.Watcher`.

        ``optimizer=None`` watches a loop with a hand-written update: call
        ``watch.before_optimizer_step()`` and ``watch.after_optimizer_step()`` around it (and pass
        ``lr=`` here or to ``end_step``). :meth:`close` closes the watchers made here."""
        from runwatch.producer.instrument.watch import Watcher  # imports torch; the publisher alone does not

        self.track_lr(optimizer)
        watcher = Watcher(self, model, optimizer, **options)
        self._watchers.append(watcher)
        return watcher

    def note_stop(self, action: Any) -> None:
        """A stop action was applied (the :class:`~runwatch.producer.actions.listener.ActionListener` calls
        this): a later ``close()`` with no explicit status ends the run as ``stopped``, with the
        action's id and cause (``params["cause"]``, else ``"stop"``) in ``run_end``'s summary."""
        self.stopped_by = stop_record(action)

    def close(
        self, timeout: float = 10.0, status: str | None = None, summary: dict[str, Any] | None = None
    ) -> PublisherStats:
        """Publish ``run_end`` (rank 0, and the first rank of each group of a split run), deliver what is
        queued or spooled within ``timeout``, stop.

        ``status`` (``completed``, ``failed``, ``stopped``, ``interrupted``) defaults to ``stopped``
        after an applied stop action (its id and cause go into ``summary``, see :meth:`note_stop`)
        and to ``completed`` otherwise; the ``with RunWatch(...)`` form picks it for you. The
        watchers made by :meth:`watch` are closed first (their last steps are published).

        Every event offered (or recovered from the spool) is then exactly one of
        ``published``, ``dropped`` or ``spooled_at_close`` (on disk, replayed next time).
        """
        if self._closed:
            return self.stats
        self._close_watchers()
        if self.rank == 0 or self._leads_group:
            status, summary = end_status(status, summary, self.stopped_by)
            self.publish(self._events.build(RunEndEvent, status=status, summary=summary))
        if self.crash_capture is not None:
            self.crash_capture.mark_closed(status or ("stopped" if self.stopped_by else "completed"))
        self._closed = True
        self.delivery.close(timeout)
        atexit.unregister(self.close)
        if self.crash_capture is not None:
            self.crash_capture.uninstall()
        return self.stats

    def delivered_offsets(self) -> dict[int, int]:
        """Highest broker-acknowledged offset per partition of the telemetry topic ({} when the
        events do not go to Kafka)."""
        offsets = getattr(self.delivery, "delivered_offsets", None)
        return offsets() if offsets is not None else {}

    def __enter__(self: R) -> R:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, _tb: object) -> None:
        """``with RunWatch(...) as rw:`` ends the run as ``completed``, ``stopped`` after an applied
        stop action, ``failed`` when the body raised (type and message in the summary) or
        ``interrupted`` on Ctrl-C. The exception is not swallowed."""
        status, summary = exit_status(exc_type, exc)
        if status == "failed" and exc is not None and self.crash_capture is not None:
            # the run's last words: the exception leaves the block (and the run) here, before any excepthook
            self.crash_capture.report_exception(
                type(exc), exc, exc.__traceback__, source="exception", final=True
            )
        self.close(status=status, summary=summary)

    # -- inside ------------------------------------------------------------------------

    def _build_and_publish(
        self, model: type[EventBase], extra: Mapping[str, Any] | None, **fields: Any
    ) -> bool:
        # A bad value is the caller's bug, but it must not crash hours of training: count it, warn once,
        # carry on. A field name the model does not declare (UnknownFieldError, a TypeError) is raised: a
        # typo that would otherwise be published as an extra field forever, fixed once at the first step.
        try:
            event = self._events.build(model, extra, **fields)
        except ValidationError as exc:
            self.delivery.refuse("invalid")
            if not self._warned_invalid:
                self._warned_invalid = True
                log.warning(
                    "runwatch: dropped an invalid %s event (further ones are only counted): %s",
                    model.__name__,
                    exc,
                )
            return False
        return self.publish(event)

    def _close_watchers(self) -> None:
        """Publish the watchers' last pending steps and stop their heartbeats before ``run_end``."""
        for watcher in self._watchers:
            try:
                watcher.close()
            except Exception:  # telemetry must not end the run, nor its close
                log.debug("runwatch: closing a watcher failed", exc_info=True)
