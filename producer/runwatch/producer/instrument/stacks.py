"""What a rank whose steps stopped is doing: the Python stack of every thread of its process, and PyTorch's
flight recorder where it is on. Standard library only; torch is looked up, never imported.

The heartbeat thread (heartbeat.py) calls :func:`capture_threads` when the rank's last completed step has
not moved for ``stacks_after_s``: ``sys._current_frames()`` (CPython's view of every thread's innermost
frame, taken under the GIL, so each stack is consistent), or, where that is missing or fails,
``faulthandler.dump_traceback`` (the same frames as text, read back). Only threads that run Python are
seen: native threads (gloo's, NCCL's, the CUDA driver's) and the C++ frames of a Python thread (the
collective's wait inside ``work.wait()``) are not. The capturing thread leaves itself out; runwatch's own
threads (named ``runwatch-*``) are kept but marked, and cut first by the bounds.

The flight recorder (:func:`flight_recorder_dump`): torch keeps a ring of its recent collectives when
``TORCH_FR_BUFFER_SIZE`` (or the older ``TORCH_NCCL_TRACE_BUFFER_SIZE``) is above 0, and dumps it as JSON
through ``torch._C._distributed_c10d._dump_fr_trace_json`` (torch 2.7 and later: NCCL, and gloo too) or
``_dump_nccl_trace_json`` (older torch: NCCL only). Its oldest entries are dropped to fit the bound.
"""

from __future__ import annotations

import faulthandler
import linecache
import os
import re
import sys
import tempfile
import threading
from collections.abc import Mapping
from types import FrameType
from typing import Any

import orjson

from runwatch.contract.schema import DEFAULT_LIMITS, StackFrame, ThreadStack, clip_flight_recorder

# The deepest a stack is walked: frames beyond (the outermost of a runaway recursion) are counted, not read
MAX_WALK = 10_000
FLIGHT_RECORDER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
# torch's dump functions, newest first: (name, what it covers)
_DUMPS = (("_dump_fr_trace_json", "gloo and NCCL"), ("_dump_nccl_trace_json", "NCCL"))
_OWN_THREAD_PREFIX = "runwatch-"


def _walk(frame: FrameType | None, max_frames: int) -> tuple[list[StackFrame], int]:
    """The innermost ``max_frames`` frames from ``frame`` outwards, outermost first; and how many beyond."""
    inner: list[StackFrame] = []
    dropped = 0
    depth = 0
    while frame is not None and depth < MAX_WALK:
        if len(inner) < max_frames:
            code = frame.f_code
            inner.append(StackFrame(file=code.co_filename, line=frame.f_lineno or 0, function=code.co_name))
        else:
            dropped += 1
        frame = frame.f_back
        depth += 1
    if frame is not None:
        dropped += 1  # (and more: the walk stopped there)
    if inner:
        inner[0] = _with_code(inner[0])
    inner.reverse()
    return inner, dropped


def _with_code(frame: StackFrame) -> StackFrame:
    """The innermost frame with its line's source text, where the file can be read (linecache)."""
    try:
        code = linecache.getline(frame.file, frame.line).strip()
    except Exception:  # noqa: BLE001 - a file that cannot be read has no code to show
        code = ""
    return frame.model_copy(update={"code": code}) if code else frame


def _thread_names() -> dict[int, str]:
    return {t.ident: t.name for t in threading.enumerate() if t.ident is not None}


def capture_threads(
    training_thread: int | None,
    max_frames: int = DEFAULT_LIMITS.max_evidence_frames,
    exclude: int | None = None,
) -> tuple[list[ThreadStack], str]:
    """Every Python thread's stack (``exclude``: a thread id to leave out, the caller's own), the training
    thread (``training_thread``, its id) first; and the source (``current_frames`` or ``faulthandler``)."""
    try:
        frames: Mapping[int, FrameType] = sys._current_frames()
    except Exception:  # noqa: BLE001 - an interpreter without it (or one that fails): faulthandler's text
        return _from_faulthandler(training_thread, max_frames, exclude), "faulthandler"
    names = _thread_names()
    stacks = []
    for ident, frame in frames.items():
        if ident == exclude:
            continue
        walked, dropped = _walk(frame, max_frames)
        stacks.append(_stack(ident, names, training_thread, walked, dropped))
    return _ordered(stacks), "current_frames"


def _stack(
    ident: int, names: Mapping[int, str], training: int | None, frames: list[StackFrame], dropped: int
) -> ThreadStack:
    name = names.get(ident, f"thread-{ident:#x}")
    return ThreadStack(
        name=name,
        thread_id=ident,
        training=ident == training,
        runwatch=name.startswith(_OWN_THREAD_PREFIX),
        frames=frames,
        frames_dropped=dropped,
        truncated=dropped > 0,
    )


def _ordered(stacks: list[ThreadStack]) -> list[ThreadStack]:
    """The training thread first, runwatch's own last."""
    return sorted(stacks, key=lambda t: (not t.training, t.runwatch))


_THREAD_LINE = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME_LINE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_faulthandler(text: str) -> list[tuple[int, list[StackFrame]]]:
    """``faulthandler.dump_traceback`` output as (thread id, frames outermost first) per thread."""
    threads: list[tuple[int, list[StackFrame]]] = []
    for line in text.splitlines():
        head = _THREAD_LINE.match(line)
        if head:
            threads.append((int(head.group(1), 16), []))
            continue
        frame = _FRAME_LINE.match(line)
        if frame and threads:
            threads[-1][1].append(
                StackFrame(file=frame.group(1), line=int(frame.group(2)), function=frame.group(3))
            )
    return [(ident, frames[::-1]) for ident, frames in threads]  # (it writes the most recent call first)


def _from_faulthandler(training: int | None, max_frames: int, exclude: int | None) -> list[ThreadStack]:
    try:
        with tempfile.TemporaryFile() as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            text = f.read(4 << 20).decode(errors="replace")
    except Exception:  # noqa: BLE001 - nothing to show is an empty list, never a failed heartbeat
        return []
    names = _thread_names()
    stacks = []
    for ident, frames in parse_faulthandler(text):
        if ident == exclude:
            continue
        kept = frames[-max_frames:]
        if kept:
            kept[-1] = _with_code(kept[-1])
        stacks.append(_stack(ident, names, training, kept, len(frames) - len(kept)))
    return _ordered(stacks)


def flight_recorder_dump(
    max_chars: int = DEFAULT_LIMITS.max_evidence_bytes // 2, environ: Mapping[str, str] | None = None
) -> tuple[str | None, str]:
    """PyTorch's flight recorder as JSON text within ``max_chars`` (its oldest entries dropped to fit), and a
    status: ``attached``, ``off: ...`` (no buffer size set) or ``not available: ...`` (no torch loaded, a
    torch without a dump, no process group)."""
    env = os.environ if environ is None else environ
    size = next((env[name] for name in FLIGHT_RECORDER_ENV if env.get(name)), None)
    if size is None or size.strip() in ("", "0"):
        return None, f"off: {FLIGHT_RECORDER_ENV[0]} / {FLIGHT_RECORDER_ENV[1]} not set"
    c10d = sys.modules.get("torch._C._distributed_c10d")  # (loaded with torch.distributed: never imported)
    if c10d is None:
        return None, "not available: torch.distributed is not loaded in this process"
    for name, covers in _DUMPS:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            raw = dump()
        except Exception as exc:  # noqa: BLE001 - no process group yet, a backend without one
            return None, f"not available: {name} failed ({exc!r:.160})"
        return _fit(raw, max_chars), f"attached ({name}: {covers})"
    return None, "not available: this torch has no flight recorder dump (torch 2.7 or later dumps gloo's)"


def _fit(raw: bytes | str, max_chars: int) -> str:
    """The dump within ``max_chars``: its oldest collectives dropped (``dropped_entries`` says how many);
    plain text cut at the end where it is not the JSON expected."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    if len(text) <= max_chars:
        return text
    try:
        data: Any = orjson.loads(text)
    except orjson.JSONDecodeError:
        data = None
    entries = data.get("entries") if isinstance(data, dict) else None
    if isinstance(entries, list) and entries:
        sizes = [len(orjson.dumps(e)) + 1 for e in entries]
        total, keep = len(text) - sum(sizes) + 40, 0  # (the rest of the dump, and the count's field)
        for size in reversed(sizes):  # the newest entries are last
            if total + size > max_chars:
                break
            total, keep = total + size, keep + 1
        trimmed = {
            **data,
            "entries": entries[len(entries) - keep :],
            "dropped_entries": len(entries) - keep,
        }
        fitted = orjson.dumps(trimmed).decode()
        if len(fitted) <= max_chars:
            return fitted
    return clip_flight_recorder(text, max_chars)
