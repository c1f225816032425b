"""The bounds pydantic's types do not say: sizes, ranges, finiteness and the time window of a decoded
telemetry event, against ``WireLimits``. A field's range is declared on the field (``Within``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from pydantic import BaseModel

from runwatch.contract.limits import WireLimits, Within
from runwatch.contract.messages.base import run_id_problem
from runwatch.contract.messages.crash import CrashEvent
from runwatch.contract.messages.evidence import StackEvidenceEvent
from runwatch.contract.messages.run import CheckpointEvent, EvalEvent, RunEndEvent, RunStartEvent
from runwatch.contract.messages.step import StepEvent
from runwatch.contract.messages.telemetry import EVENT_MODELS


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests objects/arrays deeper than ``limit`` (iterative: no recursion limit)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def _longest_string(value: Any) -> int:
    """Length of the longest string (key or value) in a decoded JSON value."""
    longest, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            longest = max(longest, len(item))
        elif isinstance(item, dict):
            for k, v in item.items():
                longest = max(longest, len(k))
                stack.append(v)
        elif isinstance(item, list):
            stack.extend(item)
    return longest


# Known fields whose decoded shape is already fixed by the schema (flat maps of numbers): the
# generic depth/string walk skips them, which keeps it off the hot path of a step event.
_TYPED_FLAT = frozenset(
    {"module_grad_norms", "module_activations", "category_loss", "memory", "lr", "metrics", "per_category"}
)
_STEP_FIELDS = frozenset(StepEvent.model_fields) - {"event_id", "run_id"}
# An evidence event's own fields are bounded by truncation (bound_evidence), not refused by the walk
_EVIDENCE_FIELDS = frozenset(StackEvidenceEvent.model_fields) - {"event_id", "run_id"}
# A crash event's own strings are bounded by truncation (bound_crash), not refused by the walk
_CRASH_FIELDS = _TYPED_FLAT | (frozenset(CrashEvent.model_fields) - {"event_id", "run_id"})
# A group report's body is signed JSON text, whose events are checked again when it is opened (the message
# size bounds it)
_REPORT_FIELDS = _TYPED_FLAT | {"body"}


def _check_free_form(key: str, value: Any, lim: WireLimits) -> str | None:
    if isinstance(value, str):
        if len(value) > lim.max_string_chars:
            return f"{key}: a string of {len(value)} characters (limit {lim.max_string_chars})"
    elif isinstance(value, dict | list):
        if _depth_exceeds(value, lim.max_depth - 1):
            return f"{key}: nested deeper than {lim.max_depth} levels"
        if _longest_string(value) > lim.max_string_chars:
            return f"{key}: holds a string longer than {lim.max_string_chars} characters"
        if len(value) > lim.max_metrics and key != "config":
            return f"{key}: {len(value)} entries (limit {lim.max_metrics})"
    return None


def _check_time(ts: datetime, received_at: datetime | None, limits: WireLimits) -> str | None:
    if ts.tzinfo is None or ts.utcoffset() is None:
        return "ts: needs a timezone (ISO 8601 with Z or +00:00)"
    if received_at is None:
        return None
    ahead = (ts - received_at).total_seconds()
    if ahead > limits.max_future_s:
        return (
            f"ts: {ts.isoformat()} is {ahead:.0f} s after the receive time {received_at.isoformat()} "
            f"(allowed: {limits.max_future_s:.0f} s)"
        )
    if -ahead > limits.max_past_s:
        return (
            f"ts: {ts.isoformat()} is {-ahead:.0f} s before the receive time {received_at.isoformat()} "
            f"(allowed: {limits.max_past_s:.0f} s)"
        )
    return None


def _out_of_range(
    name: str, value: float | int | None, upper: float, *, positive: bool = False
) -> str | None:
    # One chained comparison is False for NaN, infinities and anything outside [0, upper].
    if value is None or (0 <= value <= upper and (value > 0 or not positive)):
        return None
    if value != value or value in (float("inf"), float("-inf")):
        return f"{name}: must be finite, got {value}"
    if value < 0 or (positive and value == 0):
        return f"{name}: must be {'positive' if positive else 'non-negative'}, got {value}"
    return f"{name}: {value} is above the limit {upper:g}"


def check_limits(
    event: Any, data: dict[str, Any], received_at: datetime | None, lim: WireLimits
) -> str | None:
    """The bounds pydantic's types do not say: sizes, ranges, finiteness, the time window. The first
    problem found, in this order: the envelope, unknown and free-form fields, the step number, the kind's
    own sizes and shapes, then the ranges its fields declare (``Within``, in the model's field order)."""
    problem = _check_envelope(event, received_at, lim)
    if problem:
        return problem
    problem = _check_extras(event, data, lim)
    if problem:
        return problem
    step = getattr(event, "step", None)
    if step is not None and step > lim.max_step:
        return f"step: {step} is above the limit {lim.max_step}"
    check = _KIND_CHECKS.get(event.kind)
    return (None if check is None else check(event, lim)) or _check_bounds(event, lim)


def bounded_fields(model: type[BaseModel]) -> tuple[tuple[str, Within], ...]:
    """The fields of ``model`` that declare their range (``Within`` in their annotation), in the model's
    order. A bound naming no ``WireLimits`` field raises (at import, where the table below is built)."""
    found = []
    for name, info in model.model_fields.items():
        for bound in info.metadata:
            if isinstance(bound, Within):
                if isinstance(bound.limit, str) and bound.limit not in WireLimits.model_fields:
                    raise TypeError(
                        f"{model.__name__}.{name}: Within({bound.limit!r}) is no WireLimits field"
                    )
                found.append((name, bound))
    return tuple(found)


# Each event kind's fields that declare a range, read from its model
_BOUNDED: dict[str, tuple[tuple[str, Within], ...]] = {
    model.model_fields["kind"].default: bounded_fields(model) for model in EVENT_MODELS
}


def _check_bounds(event: Any, lim: WireLimits) -> str | None:
    """The ranges the event's fields declare: a number itself, a list's every value, a map's every value
    (named ``field.key``)."""
    # (_out_of_range's own first test is written out here: a value within its range, every value of
    # nearly every event, costs no call; one outside gets _out_of_range's message, which is never None)
    for name, bound in _BOUNDED.get(event.kind, ()):
        value = getattr(event, name)
        if value is None:
            continue
        upper, positive = bound.upper(lim), bound.positive
        if isinstance(value, dict):
            for key, item in value.items():
                if item is None or (0 <= item <= upper and (item > 0 or not positive)):
                    continue
                return _out_of_range(f"{name}.{key}", item, upper, positive=positive)
        elif isinstance(value, list):
            for item in value:
                if item is None or (0 <= item <= upper and (item > 0 or not positive)):
                    continue
                return _out_of_range(name, item, upper, positive=positive)
        elif not (0 <= value <= upper and (value > 0 or not positive)):
            return _out_of_range(name, value, upper, positive=positive)
    return None


def _check_envelope(event: Any, received_at: datetime | None, lim: WireLimits) -> str | None:
    """The fields every event has: its id, run id, rank and timestamp."""
    if len(event.event_id) > lim.max_id_chars:
        return f"event_id: longer than {lim.max_id_chars} characters"
    problem = run_id_problem(event.run_id, lim.max_id_chars)
    if problem:
        return problem
    if event.rank >= lim.max_world_size:
        return f"rank: {event.rank} is not below the maximum world size {lim.max_world_size}"
    problem = _check_time(event.ts, received_at, lim)
    if problem:
        return problem
    return None


def _check_extras(event: Any, data: dict[str, Any], lim: WireLimits) -> str | None:
    """Unknown fields (kept from a newer producer) and free-form maps: nesting and string length. A step
    event's own fields are numbers and flat maps whose shape the schema fixed: only its extras are walked."""
    skip = (
        _STEP_FIELDS
        if event.kind == "step"
        else _REPORT_FIELDS
        if event.kind == "group_report"
        else _EVIDENCE_FIELDS
        if event.kind == "evidence"
        else _CRASH_FIELDS
        if event.kind == "crash"
        else _TYPED_FLAT
    )
    for key in data.keys() - skip:
        problem = _check_free_form(key, data[key], lim)
        if problem:
            return problem
    return None


def _check_run_start(event: RunStartEvent, lim: WireLimits) -> str | None:
    if event.world_size > lim.max_world_size:
        return f"world_size: {event.world_size} is above the limit {lim.max_world_size}"
    if len(event.gpu_names) > lim.max_metrics or len(event.tags) > lim.max_metrics:
        return f"gpu_names/tags: more than {lim.max_metrics} entries"
    return None


def _check_eval(event: EvalEvent, lim: WireLimits) -> str | None:
    if len(event.metrics) > lim.max_metrics:
        return f"metrics: {len(event.metrics)} entries (limit {lim.max_metrics})"
    if len(event.per_category) > lim.max_categories or any(
        len(m) > lim.max_metrics for m in event.per_category.values()
    ):
        return f"per_category: more than {lim.max_categories} categories or {lim.max_metrics} metrics each"
    return None


def _check_run_end(event: RunEndEvent, lim: WireLimits) -> str | None:
    if len(event.summary) > lim.max_metrics:
        return f"summary: {len(event.summary)} entries (limit {lim.max_metrics})"
    return None


def _check_checkpoint(event: CheckpointEvent, lim: WireLimits) -> str | None:
    if len(event.uri) > lim.max_string_chars:
        return f"uri: longer than {lim.max_string_chars} characters"
    if event.lr is not None and len(event.lr) > lim.max_metrics:
        return f"lr: {len(event.lr)} param groups (limit {lim.max_metrics})"
    return None


def _check_step(event: StepEvent, lim: WireLimits) -> str | None:
    modules, categories = event.module_grad_norms, event.category_loss
    if len(modules) > lim.max_modules:
        return f"module_grad_norms: {len(modules)} modules (limit {lim.max_modules})"
    if len(event.module_activations) > lim.max_modules:
        return f"module_activations: {len(event.module_activations)} modules (limit {lim.max_modules})"
    if len(categories) > lim.max_categories:
        return f"category_loss: {len(categories)} categories (limit {lim.max_categories})"
    if len(event.lr) > lim.max_metrics:
        return f"lr: {len(event.lr)} param groups (limit {lim.max_metrics})"
    # (its times, rates and mfu declare their ranges: _check_bounds)
    if event.memory is not None:
        for name, value in event.memory.__dict__.items():
            if type(value) is int and not 0 <= value <= lim.max_memory_bytes:
                return _out_of_range(f"memory.{name}", value, lim.max_memory_bytes)
    for name, cat in categories.items():
        if cat.count > 2**53:
            return f"category_loss.{name}.count: {cat.count} is above 2^53"
    if (modules and max(map(len, modules)) > lim.max_string_chars) or (
        categories and max(map(len, categories)) > lim.max_string_chars
    ):
        return f"module/category name longer than {lim.max_string_chars} characters"
    return None


# The sizes and shapes of one event kind's own fields, by ``kind``; kinds not here have none beyond the
# envelope's and their fields' declared ranges.
_KIND_CHECKS: dict[str, Callable[[Any, WireLimits], str | None]] = {
    "step": _check_step,
    "run_start": _check_run_start,
    "eval": _check_eval,
    "run_end": _check_run_end,
    "checkpoint": _check_checkpoint,
}
