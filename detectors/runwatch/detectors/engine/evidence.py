"""A rank's stack evidence as the liveness findings carry it: where its training thread waits, and in what.

A rank whose steps stop sends an ``evidence`` event (the producer's heartbeat thread captures every thread's
Python stack: producer/runwatch/producer/instrument/stacks.py). Its ``RankProgress`` (progress.py) keeps a
bounded summary of the latest one, :func:`summarize`, until the rank's step moves again; the ``hung_rank``
and ``stall`` findings attach the summaries (:func:`stacks_evidence`) and name the frames in their message
(:func:`waits_phrase`).

Where a rank waits is the innermost frame of its training thread (the thread that drives the loop: the
main thread of a plain one). It *waits for its peers* when that frame is inside ``torch.distributed`` (a
collective such as ``all_reduce`` or ``barrier``, named by the frame's function); it does not when the frame
is anywhere else but autograd (user code, a ``time.sleep``, a data loader); inside autograd the stack cannot
tell a backward that computes from one that waits for DDP's gradient all-reduce, so there the heartbeat's
``in_sync`` decides (:func:`stack_waits`).

Plain data only (dicts of strings and numbers): a run's state pickles it as it is.
"""

from __future__ import annotations

from typing import Any

import orjson

from runwatch.contract.schema import StackEvidenceEvent, ThreadStack

KEPT_FRAMES = 24  # of a rank's training thread, the innermost, in its progress and in a finding
PEER_FRAMES = 8  # of a peer's, in a finding about another rank
STACKS_LISTED = 16  # ranks whose stacks one finding carries: the one it is about, then the lowest others
FRAME_CHARS = 300  # one frame as text
RECORDER_CHARS = 600  # the flight recorder's summary
_COLLECTIVE_DIRS = ("torch/distributed/",)
_AMBIGUOUS_DIRS = ("torch/autograd/", "torch/_tensor.py")


def _path(file: str) -> str:
    return file.replace("\\", "/")


def short_path(file: str) -> str:
    """A frame's file as a message names it: from the package down (``torch/distributed/...``) when it is
    installed, else its base name."""
    path = _path(file)
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    return path.rsplit("/", 1)[-1]


def _frame_text(file: str, line: int, function: str, short: bool = False) -> str:
    text = f"{short_path(file) if short else file}:{line} in {function}"
    return text if len(text) <= FRAME_CHARS else "\u2026" + text[-FRAME_CHARS + 1 :]


def _training_thread(threads: list[ThreadStack]) -> ThreadStack | None:
    for t in threads:
        if t.training and t.frames:
            return t
    return next((t for t in threads if t.frames and not t.runwatch), None)


def summarize(event: StackEvidenceEvent) -> dict[str, Any]:
    """The bounded summary a rank's progress keeps of its evidence (see the module doc)."""
    thread = _training_thread(event.threads)
    summary: dict[str, Any] = {
        "step": event.step,
        "captured_at": event.ts.isoformat(),
        "event_id": event.event_id,
        "reason": event.reason,
        "seconds_since_step": event.seconds_since_step,
        "source": event.source,
        "threads": len(event.threads) + event.threads_dropped,
        "truncated": event.truncated,
    }
    if thread is not None:
        inner = thread.frames[-1]
        path = _path(inner.file)
        kept = thread.frames[-KEPT_FRAMES:]
        summary.update(
            thread=thread.name[:128],
            waits_in=_frame_text(inner.file, inner.line, inner.function, short=True),
            frames=[_frame_text(f.file, f.line, f.function) for f in kept],
            frames_dropped=thread.frames_dropped + len(thread.frames) - len(kept),
            collective=inner.function[:128] if any(d in path for d in _COLLECTIVE_DIRS) else None,
            ambiguous=any(d in path for d in _AMBIGUOUS_DIRS),
        )
        code = getattr(inner, "code", None)
        if isinstance(code, str) and code:
            summary["code"] = code[:160]
    if event.flight_recorder_status is not None:
        summary["flight_recorder_status"] = event.flight_recorder_status[:256]
    if event.flight_recorder:
        summary["flight_recorder"] = recorder_summary(event.flight_recorder)
    return summary


def recorder_summary(text: str) -> str:
    """The flight recorder's collectives in flight (not retired) and the last one retired, in a line; the
    text's head where it is not the JSON torch writes. Text only: nothing of it is run or rendered."""
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        data = None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return text[:RECORDER_CHARS]

    def name(e: dict[str, Any]) -> str:
        return f"{e.get('profiling_name', '?')} #{e.get('collective_seq_id', '?')} ({e.get('state', '?')})"

    items = [e for e in entries if isinstance(e, dict)]
    open_ = [name(e) for e in items if not e.get("retired")]
    retired = [e for e in items if e.get("retired")]
    parts = [f"in flight: {', '.join(open_[-8:]) if open_ else 'none'}"]
    if retired:
        parts.append(f"last retired: {name(retired[-1])}")
    parts.append(f"{len(items)} entries")
    return "; ".join(parts)[:RECORDER_CHARS]


def stack_waits(stack: dict[str, Any] | None) -> bool | None:
    """Whether a rank's stack says it waits for its peers: True in a collective, False elsewhere, None where
    it cannot say (no stack, no training thread, or a frame in autograd)."""
    if stack is None or "waits_in" not in stack:
        return None
    if stack.get("collective") is not None:
        return True
    return None if stack.get("ambiguous") else False


def _listed(stack: dict[str, Any], frames: int) -> dict[str, Any]:
    shown = {k: v for k, v in stack.items() if k not in ("frames", "ambiguous")}
    kept = stack.get("frames") or []
    shown["frames"] = kept[-frames:]
    if len(kept) > frames:
        shown["frames_dropped"] = stack.get("frames_dropped", 0) + len(kept) - frames
    return shown


def stacks_evidence(rank: int, stacks: dict[int, dict[str, Any] | None]) -> dict[str, Any]:
    """A finding's ``evidence`` entries about stacks: ``stacks`` (rank -> its summary, ``rank``'s with up to
    ``KEPT_FRAMES`` frames, the peers' with ``PEER_FRAMES``; at most ``STACKS_LISTED`` ranks), ``waits_in``
    (rank -> its frame, the same ranks) and ``stacks_missing`` (the count of ranks without one); {} when no
    rank has one."""
    have = {r: s for r, s in stacks.items() if s is not None}
    if not have:
        return {}
    order = ([rank] if rank in have else []) + sorted(r for r in have if r != rank)
    listed = order[:STACKS_LISTED]
    return {
        "stacks": {str(r): _listed(have[r], KEPT_FRAMES if r == rank else PEER_FRAMES) for r in listed},
        "waits_in": {str(r): have[r]["waits_in"] for r in listed if "waits_in" in have[r]},
        "stacks_missing": len(stacks) - len(have),
    }


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    more = f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


def waits_phrase(rank: int, stacks: dict[int, dict[str, Any] | None]) -> str:
    """``rank 2 waits in dist_train.py:151 in main (`time.sleep(600)`); ranks 0, 1, 3 wait in all_reduce
    (torch/distributed/distributed_c10d.py:3252)``: the finding's words for the stacks; "" without them."""
    parts = []
    own = stacks.get(rank)
    if own is not None and "waits_in" in own:
        code = f" (`{own['code']}`)" if own.get("code") else ""
        parts.append(f"rank {rank} waits in {own['waits_in']}{code}")
    groups: dict[str, list[int]] = {}
    for r, stack in sorted(stacks.items()):
        if r == rank or stack is None or "waits_in" not in stack:
            continue
        collective = stack.get("collective")
        where = (
            f"{collective} ({stack['waits_in'].rsplit(' in ', 1)[0]})" if collective else stack["waits_in"]
        )
        groups.setdefault(where, []).append(r)
    for where, ranks in sorted(groups.items(), key=lambda item: (-len(item[1]), item[1][0]))[:4]:
        parts.append(f"{_ranks(ranks)} wait{'s' if len(ranks) == 1 else ''} in {where}")
    return "; ".join(parts)
