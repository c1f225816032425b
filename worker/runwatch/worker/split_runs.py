"""The worker's side of a run split by rank group (issue 36; contract/groups.py): which monitor an event
goes to, what is refused, and the signed reports a group's monitor sends to its run's.

An event of a split run's rank (it says ``group_size``) goes to the monitor of its group, keyed
``<run id>#<group>`` (its Kafka key: the group's partition). That ``GroupMonitor`` reports, in a
``GroupReport`` signed with the workers' key and keyed by the run id, to the ``RunMergeMonitor`` of the
run's own key, wherever that partition is owned. A report that does not verify is refused: nothing a
trainer holds can speak for a group.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import ValidationError

from runwatch.contract import groups
from runwatch.contract.group_report import ReportBody, ReportItem
from runwatch.contract.schema import GroupReport, RunStartEvent, TelemetryEvent
from runwatch.contract.signing import ActionPublicKeys, ActionSigningKey
from runwatch.detectors import RunMonitor, RunwatchConfig
from runwatch.detectors.engine.group_monitor import GroupMonitor
from runwatch.detectors.engine.merge_monitor import RunMergeMonitor


class SplitRunError(ValueError):
    """An event a split run cannot take: its one-line reason goes into the dead letter."""


def state_key(event: TelemetryEvent) -> str:
    """The key of the monitor ``event`` goes to: its group's in a split run, else its run's."""
    if event.group_size is None or isinstance(event, GroupReport):
        return event.run_id
    return groups.group_key(event.run_id, groups.group_of(event.rank, event.group_size))


def open_report(event: GroupReport, keys: ActionPublicKeys) -> ReportBody:
    """The body of a group report, once its signature verifies; ``SplitRunError`` otherwise."""
    if not keys.verify_report(event.body, event.signature):
        raise SplitRunError(
            f"group_report: group {event.group} of run {event.run_id[:100]!r} is not signed by the workers' "
            "key (only a worker reports a group)"
        )
    try:
        return ReportBody.model_validate_json(event.body)
    except ValidationError as exc:
        raise SplitRunError(
            f"group_report: its body does not validate ({exc.error_count()} error(s))"
        ) from None


def check_shape(monitor: RunMonitor | None, event: TelemetryEvent, body: ReportBody | None) -> None:
    """``SplitRunError`` when ``event`` disagrees with the run it belongs to: another group or world size
    than the run's first events said, or a split run's event that says none (the run goes on)."""
    if monitor is None:
        return
    shape = getattr(monitor, "shape", None)
    said = (body.group_size, body.world_size) if body is not None else (event.group_size, event.world_size)
    if shape is None:
        return  # (a run watched whole: a report replaces its monitor, new_monitor)
    if said[0] is None:
        if isinstance(event, RunStartEvent):
            return  # a new attempt of the run, not split: it is watched whole (processor.py)
        raise SplitRunError(
            f"group_size: run {event.run_id[:100]!r} is split by rank group (group_size {shape[0]}), "
            f"this {event.kind} of rank {getattr(event, 'rank', 0)} says none"
        )
    if said != shape:
        raise SplitRunError(
            f"group_size/world_size: {said[0]}/{said[1]} disagrees with the run's {shape[0]}/{shape[1]} "
            "(every event of a split run says the same)"
        )


def new_monitor(event: TelemetryEvent, config: RunwatchConfig, body: ReportBody | None) -> RunMonitor:
    """The monitor of ``event``'s key: a group's, a split run's own (``body``: a report's), or a whole
    run's."""
    if body is not None:
        return RunMergeMonitor(event.run_id, config, body.group_size, body.world_size)
    if event.group_size is not None and event.world_size is not None:
        group = groups.group_of(event.rank, event.group_size)
        return GroupMonitor(event.run_id, config, group, event.group_size, event.world_size)
    return RunMonitor(event.run_id, config)


REPORT_BODY_BYTES = 256 * 1024  # a report's body at most (items beyond it go in the next report)


def signed_reports(
    monitor: GroupMonitor, items: list[ReportItem], at: datetime, key: ActionSigningKey
) -> list[GroupReport]:
    """The reports of ``items`` in order, each signed with the workers' key and of at most
    ``REPORT_BODY_BYTES`` (one item larger than that goes alone: the message limit refuses it)."""
    group_size, world_size = monitor.shape
    body = ReportBody.model_construct(
        group_size=group_size,
        world_size=world_size,
        late=monitor.join.late,
        duplicates=monitor.join.duplicates,
        items=items,
    ).model_dump_json(exclude_none=True)
    if len(body) > REPORT_BODY_BYTES and len(items) > 1:
        half = len(items) // 2
        return signed_reports(monitor, items[:half], at, key) + signed_reports(monitor, items[half:], at, key)
    monitor.reports_sent += 1
    return [
        GroupReport(
            event_id=f"report|{monitor.run_id}|{monitor.group}|{monitor.reports_sent}",
            run_id=monitor.run_id,
            group=monitor.group,
            ts=at,
            body=body,
            signature=key.sign_report(body),
        )
    ]
