"""What a rank whose steps stopped was doing (``kind`` ``evidence``): every thread's stack and the flight
recorder, and the bounds that cut an over-sized one down (``bound_evidence``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from runwatch.contract.limits import DEFAULT_LIMITS, WireLimits, Within
from runwatch.contract.messages.base import ELLIPSIS, EventBase, Phase, WireFloat, WireModel


class StackFrame(WireModel):
    """One frame of a thread's Python stack: the file, the line being run, the function; ``code``, that
    line's source text (the innermost frame's only, where the file is readable)."""

    file: str
    line: int = Field(ge=0)
    function: str
    code: str | None = None


class ThreadStack(WireModel):
    """One thread's Python stack at the capture, ``frames`` outermost first and innermost (where the thread
    is now) last. ``training``: the thread that drives the training loop (the one that built the heartbeat:
    the main thread of a plain loop); ``runwatch``: one of runwatch's own threads (the publisher, the
    action reader...). ``truncated``: the bounds cut something of it (``frames_dropped`` outermost frames,
    or a string clipped with an ellipsis)."""

    name: str = ""
    thread_id: int | None = None
    training: bool = False
    runwatch: bool = False
    frames: list[StackFrame] = Field(default_factory=list)
    frames_dropped: int = Field(default=0, ge=0)
    truncated: bool = False


EvidenceReason = Literal["no_progress", "requested"]
StackSource = Literal["current_frames", "faulthandler"]


class StackEvidenceEvent(EventBase):
    """What a rank whose steps stopped was doing (``kind`` ``evidence``): the Python stack of every thread
    of its process, captured by its heartbeat thread (instrument/stacks.py), and PyTorch's flight recorder
    dump where it is on. Bounded (``bound_evidence``): at most ``WireLimits.max_evidence_threads`` threads
    (the training thread always kept), ``max_evidence_frames`` innermost frames each, strings clipped
    (``EVIDENCE_STRING_CHARS``), and ``max_evidence_bytes`` as JSON, the flight recorder's text cut first;
    what was cut is marked (``truncated``, ``threads_dropped``, each thread's ``frames_dropped``). A worker
    given one over its bounds truncates it the same way: it is never refused for its size alone (only a
    message over ``max_message_bytes`` is, as any kind)."""

    kind: Literal["evidence"] = "evidence"
    step: int | None = Field(default=None, ge=0)  # the last completed step
    reason: EvidenceReason = "no_progress"
    phase: Phase = "train"
    seconds_since_step: Annotated[WireFloat | None, Within("max_duration_s")] = Field(default=None, ge=0)
    source: StackSource = "current_frames"
    threads: list[ThreadStack] = Field(default_factory=list)
    threads_dropped: int = Field(default=0, ge=0)
    truncated: bool = False
    # PyTorch's flight recorder (the ring of recent collectives: torch._C._distributed_c10d's dump, as JSON
    # text): present where it is on (TORCH_FR_BUFFER_SIZE / TORCH_NCCL_TRACE_BUFFER_SIZE) and this torch
    # can dump it; ``flight_recorder_status`` says why not otherwise ("off: ...", "not available: ...").
    # Text, never executed or parsed as anything but JSON.
    flight_recorder: str | None = None
    flight_recorder_status: str | None = None


# Evidence bounds that are not configurable: one string of a frame or thread (the end of a file path says
# the most, so a path keeps its end), and the flight recorder's share of the whole.
EVIDENCE_STRING_CHARS = {"file": 512, "function": 256, "name": 128, "code": 160}
EVIDENCE_STATUS_CHARS = 256


def _clip_start(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters, its end kept (a path's end names the file)."""
    return text if len(text) <= limit else ELLIPSIS + text[len(text) - limit + 1 :]


def clip_flight_recorder(text: str, limit: int) -> str:
    """The flight recorder's text within ``limit`` characters, its head kept and the cut marked."""
    if len(text) <= limit:
        return text
    mark = f"{ELLIPSIS} [flight recorder truncated: {{}} of {len(text)} characters kept]"
    keep = max(0, limit - len(mark) - 8)
    return text[:keep] + mark.format(keep)


def _bound_thread(thread: ThreadStack, max_frames: int) -> ThreadStack:
    """``thread`` with at most ``max_frames`` frames (the innermost), strings clipped, only the known fields
    of its frames; itself when it is within them."""
    frames, dropped = thread.frames, thread.frames_dropped
    if len(frames) > max_frames:
        dropped += len(frames) - max_frames
        frames = frames[len(frames) - max_frames :]
    limits = EVIDENCE_STRING_CHARS
    clipped = False
    kept: list[StackFrame] = []
    for f in frames:
        file, function = _clip_start(f.file, limits["file"]), _clip_start(f.function, limits["function"])
        code = (
            f.code
            if f.code is None or len(f.code) <= limits["code"]
            else f.code[: limits["code"] - 1] + ELLIPSIS
        )
        same = file is f.file and function is f.function and code is f.code
        clipped = clipped or not same
        kept.append(
            f
            if same and not f.model_extra
            else StackFrame(file=file, line=f.line, function=function, code=code)
        )
    name = _clip_start(thread.name, limits["name"])
    if (
        dropped == thread.frames_dropped
        and not clipped
        and name is thread.name
        and all(a is b for a, b in zip(kept, thread.frames, strict=True))
    ):
        return thread
    return thread.model_copy(
        update={"frames": kept, "frames_dropped": dropped, "name": name, "truncated": True}
    )


def bound_evidence(event: StackEvidenceEvent, limits: WireLimits | None = None) -> StackEvidenceEvent:
    """``event`` within the evidence bounds of ``limits`` (see ``StackEvidenceEvent``), what was cut marked;
    ``event`` itself when nothing needs cutting. The producer sends what this returns, and the worker and the
    sink apply it again to what they receive (a producer of another language, a newer one with other
    bounds): an over-sized evidence event is truncated, never refused whole."""
    lim = limits if limits is not None else DEFAULT_LIMITS
    threads, dropped = list(event.threads), event.threads_dropped
    if len(threads) > lim.max_evidence_threads:
        # the training thread first, runwatch's own last, then in their order
        order = sorted(range(len(threads)), key=lambda i: (not threads[i].training, threads[i].runwatch, i))
        keep = sorted(order[: lim.max_evidence_threads])
        dropped += len(threads) - len(keep)
        threads = [threads[i] for i in keep]
    threads = [_bound_thread(t, lim.max_evidence_frames) for t in threads]
    update: dict[str, Any] = {}
    if dropped != event.threads_dropped or any(
        a is not b for a, b in zip(threads, event.threads, strict=True)
    ):
        update.update(threads=threads, threads_dropped=dropped)
    status = event.flight_recorder_status
    if status is not None and len(status) > EVIDENCE_STATUS_CHARS:
        update["flight_recorder_status"] = _clip_start(status[::-1], EVIDENCE_STATUS_CHARS)[::-1]
    recorder = event.flight_recorder
    if recorder is not None and len(recorder) > lim.max_evidence_bytes // 2:
        update["flight_recorder"] = recorder = clip_flight_recorder(recorder, lim.max_evidence_bytes // 2)
    bounded = event.model_copy(update={**update, "truncated": True}) if update else event
    size = len(bounded.to_json())
    if size <= lim.max_evidence_bytes:
        return bounded
    # Still too large: threads from the end (never the training one), then frames (the innermost kept), within
    # what the flight recorder leaves (at most half); then the flight recorder itself (multi-byte or escaped
    # text), then extra fields.
    threads = list(bounded.threads)
    sizes = [len(t.model_dump_json(exclude_none=True)) + 1 for t in threads]
    excess = size - lim.max_evidence_bytes
    for i in reversed(range(len(threads))):  # (by each thread's size: one serialisation of the whole)
        if excess <= 0:
            break
        if not threads[i].training:
            excess -= sizes[i]
            threads.pop(i)
            dropped += 1
    if len(threads) != len(bounded.threads):
        update.update(threads=threads, threads_dropped=dropped)
        bounded = event.model_copy(update={**update, "truncated": True})
        size = len(bounded.to_json())
    while size > lim.max_evidence_bytes:
        droppable = [i for i, t in enumerate(threads) if not t.training]
        if droppable:
            threads.pop(droppable[-1])
            dropped += 1
        elif max((len(t.frames) for t in threads), default=0) > 1:
            threads = [_bound_thread(t, max(1, len(t.frames) // 2)) for t in threads]
        else:
            break
        update.update(threads=threads, threads_dropped=dropped)
        bounded = event.model_copy(update={**update, "truncated": True})
        size = len(bounded.to_json())
    if size > lim.max_evidence_bytes and recorder:
        chars = max(0, len(recorder) - (size - lim.max_evidence_bytes) - 128)
        update["flight_recorder"] = clip_flight_recorder(recorder, chars) if chars > 96 else None
        bounded = event.model_copy(update={**update, "truncated": True})
        size = len(bounded.to_json())
    if size > lim.max_evidence_bytes:  # what is left is the extra fields of a newer (or hostile) producer
        known = {name: getattr(bounded, name) for name in StackEvidenceEvent.model_fields}
        bounded = StackEvidenceEvent.model_construct(**known)
    return bounded
