"""``DiskSpool``: a bounded, append-only on-disk FIFO of byte records.

The publisher writes here what the broker did not take, and replays it head first
when the broker answers again. Stdlib only (training jobs install the producer).

Layout of a spool directory::

    00000000000000000001.seg   records, each: u32 length, u32 crc32, payload (big-endian)
    00000000000000000002.seg   the tail segment is the only one appended to
    head                       "<segment> <offset>": the oldest record not yet committed
    lock                       flock'd while a process has the spool open

A record is *committed* once the broker acknowledged it; ``commit`` moves the head,
a fully committed segment is deleted, and an empty spool leaves no segment behind.
The head file is rewritten (tmp + rename) at most every ``head_interval_s``, so a
crash replays at most that much again (duplicates, which consumers deduplicate on
``event_id``), never less. Appends are written through to the OS at once (a killed
process loses nothing) and fsync'd at most every ``fsync_interval_s``, on segment
roll and on close (a power cut loses at most that interval). On open, a torn or
corrupt record ends its segment: the rest of that segment is cut off and counted
in ``stats.corrupt``.

The bound ``max_bytes`` is on live (uncommitted) record bytes, headers included;
the disk holds at most one segment more (the committed part of the head segment).
Past the bound, ``overflow`` says what goes: ``"drop_newest"`` refuses the new record,
``"drop_oldest"`` evicts records from the head until the new one fits.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import struct
import time
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

try:  # POSIX; elsewhere the spool is simply not locked
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

Overflow = Literal["drop_newest", "drop_oldest"]
OVERFLOW_POLICIES: tuple[str, ...] = ("drop_newest", "drop_oldest")

_HEADER = struct.Struct(">II")  # payload length, crc32(payload)
HEADER_BYTES = _HEADER.size
_SUFFIX = ".seg"


class SpoolError(OSError):
    pass


class SpoolLockedError(SpoolError):
    """Another process (or another open ``DiskSpool``) holds this spool directory."""


@dataclass
class SpoolStats:
    appended: int = 0  # records accepted by append()
    refused: int = 0  # records append() refused: over the bound under drop_newest, or larger than it
    evicted: int = 0  # records removed unsent from the head to make room (drop_oldest)
    committed: int = 0  # records removed by commit()
    recovered: int = 0  # records found on open, left by an earlier process
    corrupt: int = 0  # torn or corrupt records found on open (the rest of their segment is cut off)


@dataclass
class _Segment:
    number: int
    records: int = 0  # records in the file, committed or not
    size: int = 0  # bytes in the file

    def path(self, directory: Path) -> Path:
        return directory / f"{self.number:020d}{_SUFFIX}"


class DiskSpool:
    """A bounded FIFO of byte records in a directory; survives a process restart.

    Not safe for concurrent use from several threads without outside locking; the
    publisher uses it from its one background thread.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int = 256 * 1024 * 1024,
        overflow: Overflow = "drop_newest",
        *,
        segment_bytes: int | None = None,
        fsync_interval_s: float = 1.0,
        head_interval_s: float = 0.5,
    ):
        if max_bytes <= HEADER_BYTES:
            raise ValueError(f"max_bytes must exceed {HEADER_BYTES}, got {max_bytes}")
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {overflow!r}")
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self.overflow: Overflow = overflow
        # Segments small against the bound keep the committed-but-not-deleted overhead small.
        self.segment_bytes = int(segment_bytes or min(8 << 20, max(64 << 10, max_bytes // 16)))
        self.fsync_interval_s = fsync_interval_s
        self.head_interval_s = head_interval_s
        self.stats = SpoolStats()

        self._segments: deque[_Segment] = deque()
        self._head_offset = 0  # byte offset of the oldest live record in the head segment
        self._head_consumed = 0  # records before it in the head segment
        self._head_index = 0  # absolute index of the oldest live record (this process's count)
        self._live_records = 0
        self._live_bytes = 0
        self._tail_fd: int | None = None
        self._read_fd: tuple[int, int] | None = None  # (segment number, fd)
        self._last_fsync = time.monotonic()
        self._head_dirty = False
        self._last_head_write = time.monotonic()
        self._lock_fd: int | None = None
        self._closed = False

        self.path.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._recover()
        except BaseException:
            self._unlock()
            raise

    # -- what users call -----------------------------------------------------------------

    def __len__(self) -> int:
        """Live (uncommitted) records."""
        return self._live_records

    @property
    def bytes(self) -> int:
        """Live record bytes, headers included (what ``max_bytes`` bounds)."""
        return self._live_bytes

    @property
    def head_index(self) -> int:
        """Absolute index of the oldest live record; ``commit`` takes indexes on this scale."""
        return self._head_index

    def append(self, record: builtins.bytes) -> bool:  # (`bytes` here is the property above)
        """Add ``record`` at the tail. False if it was refused by the bound (then counted)."""
        self._check_open()
        size = HEADER_BYTES + len(record)
        if size > self.max_bytes:
            self.stats.refused += 1
            return False
        if self._live_bytes + size > self.max_bytes:
            if self.overflow == "drop_newest":
                self.stats.refused += 1
                return False
            while self._live_records and self._live_bytes + size > self.max_bytes:
                self._advance(1)
                self.stats.evicted += 1
        tail = self._segments[-1] if self._segments else None
        if tail is None or (tail.size > 0 and tail.size + size > self.segment_bytes):
            tail = self._roll()
        data = _HEADER.pack(len(record), zlib.crc32(record)) + record
        written = os.write(self._tail_fd, data)  # type: ignore[arg-type]
        if written != len(data):  # a short write on a regular file means the disk is full
            os.ftruncate(self._tail_fd, tail.size)  # type: ignore[arg-type]
            raise SpoolError(f"short write to {tail.path(self.path)} ({written} of {len(data)} bytes)")
        tail.size += size
        tail.records += 1
        self._live_records += 1
        self._live_bytes += size
        self.stats.appended += 1
        if time.monotonic() - self._last_fsync >= self.fsync_interval_s:
            self.sync()
        return True

    def peek(self, max_records: int, max_bytes: int = 1 << 20) -> tuple[int, list[builtins.bytes]]:
        """The oldest live records, without removing them: ``(index of the first, records)``.

        Returns at least one record when the spool is not empty, even past ``max_bytes``.
        """
        self._check_open()
        out: list[bytes] = []
        total = 0
        seg_i = 0
        offset = self._head_offset
        while len(out) < max_records and seg_i < len(self._segments):
            seg = self._segments[seg_i]
            if offset >= seg.size:
                seg_i += 1
                offset = 0
                continue
            fd = self._reader(seg)
            header = os.pread(fd, HEADER_BYTES, offset)
            length, _crc = _HEADER.unpack(header)
            if out and total + HEADER_BYTES + length > max_bytes:
                break
            out.append(os.pread(fd, length, offset + HEADER_BYTES))
            total += HEADER_BYTES + length
            offset += HEADER_BYTES + length
        return self._head_index, out

    def commit(self, upto_index: int) -> int:
        """Remove every live record with index below ``upto_index``; returns how many.

        Indexes come from :meth:`peek`; records already evicted are skipped.
        """
        self._check_open()
        n = min(max(0, upto_index - self._head_index), self._live_records)
        if n:
            self._advance(n)
            self.stats.committed += n
        return n

    def sync(self) -> None:
        """fsync the tail segment and persist the head now."""
        if self._tail_fd is not None:
            os.fsync(self._tail_fd)
        self._last_fsync = time.monotonic()
        self._write_head(force=True)

    def close(self) -> None:
        """Sync and release the directory. An empty spool leaves nothing behind but the directory."""
        if self._closed:
            return
        try:
            if self._live_records == 0:
                self._reset()
            else:
                self.sync()
        finally:
            self._close_fds()
            self._unlock()
            self._closed = True

    def remove_if_empty(self) -> bool:
        """After :meth:`close`: delete the directory if it holds no records. True if it did."""
        if not self._closed or self._live_records:
            return False
        for name in ("lock", "head"):
            with contextlib.suppress(FileNotFoundError):
                (self.path / name).unlink()
        try:
            self.path.rmdir()
        except OSError:  # something else lives there: leave it
            return False
        return True

    def __enter__(self) -> DiskSpool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SpoolError(f"spool {self.path} is closed")

    def _lock(self) -> None:
        if fcntl is None:  # pragma: no cover
            return
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise SpoolLockedError(f"spool {self.path} is in use by another process") from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _close_fds(self) -> None:
        if self._tail_fd is not None:
            os.close(self._tail_fd)
            self._tail_fd = None
        if self._read_fd is not None:
            os.close(self._read_fd[1])
            self._read_fd = None

    def _reader(self, seg: _Segment) -> int:
        if self._read_fd is None or self._read_fd[0] != seg.number:
            if self._read_fd is not None:
                os.close(self._read_fd[1])
            self._read_fd = (seg.number, os.open(seg.path(self.path), os.O_RDONLY))
        return self._read_fd[1]

    def _roll(self) -> _Segment:
        number = self._segments[-1].number + 1 if self._segments else 1
        if self._tail_fd is not None:
            os.fsync(self._tail_fd)
            os.close(self._tail_fd)
        seg = _Segment(number)
        self._tail_fd = os.open(seg.path(self.path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._segments.append(seg)
        self._last_fsync = time.monotonic()
        return seg

    def _advance(self, n: int) -> None:
        """Move the head past ``n`` live records (committed or evicted)."""
        while n > 0:
            seg = self._segments[0]
            if self._head_consumed >= seg.records:
                self._drop_head_segment()
                continue
            fd = self._reader(seg)
            length, _crc = _HEADER.unpack(os.pread(fd, HEADER_BYTES, self._head_offset))
            size = HEADER_BYTES + length
            self._head_offset += size
            self._head_consumed += 1
            self._head_index += 1
            self._live_records -= 1
            self._live_bytes -= size
            n -= 1
        if self._live_records == 0:
            self._reset()
            return
        while self._head_consumed >= self._segments[0].records and len(self._segments) > 1:
            self._drop_head_segment()
        self._head_dirty = True
        self._write_head()

    def _drop_head_segment(self) -> None:
        seg = self._segments.popleft()
        if self._read_fd is not None and self._read_fd[0] == seg.number:
            os.close(self._read_fd[1])
            self._read_fd = None
        if not self._segments:  # it was also the tail
            if self._tail_fd is not None:
                os.close(self._tail_fd)
                self._tail_fd = None
        with contextlib.suppress(FileNotFoundError):
            seg.path(self.path).unlink()
        self._head_offset = 0
        self._head_consumed = 0

    def _reset(self) -> None:
        """No live records: delete every segment and the head file."""
        self._close_fds()
        while self._segments:
            with contextlib.suppress(FileNotFoundError):
                self._segments.popleft().path(self.path).unlink()
        with contextlib.suppress(FileNotFoundError):
            (self.path / "head").unlink()
        self._head_offset = 0
        self._head_consumed = 0
        self._live_bytes = 0
        self._head_dirty = False

    def _write_head(self, force: bool = False) -> None:
        if not self._head_dirty or not self._segments:
            return
        now = time.monotonic()
        if not force and now - self._last_head_write < self.head_interval_s:
            return
        tmp = self.path / "head.tmp"
        tmp.write_text(f"{self._segments[0].number} {self._head_offset}\n")
        os.replace(tmp, self.path / "head")
        self._last_head_write = now
        self._head_dirty = False

    def _read_head(self) -> tuple[int, int] | None:
        try:
            number, offset = (self.path / "head").read_text().split()
            return int(number), int(offset)
        except (FileNotFoundError, ValueError):
            return None

    def _recover(self) -> None:
        numbers = sorted(
            int(p.name[: -len(_SUFFIX)])
            for p in self.path.glob(f"*{_SUFFIX}")
            if p.name[: -len(_SUFFIX)].isdigit()
        )
        head = self._read_head()
        head_number, head_offset = head if head is not None and head[0] in numbers else (None, 0)
        for number in numbers:
            seg = _Segment(number)
            if head_number is not None and number < head_number:  # committed before the crash
                with contextlib.suppress(FileNotFoundError):
                    seg.path(self.path).unlink()
                continue
            self._scan(seg)
            if seg.records:
                self._segments.append(seg)
            else:
                with contextlib.suppress(FileNotFoundError):
                    seg.path(self.path).unlink()
        if self._segments and self._segments[0].number == head_number:
            self._head_offset, self._head_consumed = self._boundary(self._segments[0], head_offset)
        for seg in self._segments:
            self._live_records += seg.records
            self._live_bytes += seg.size
        self._live_records -= self._head_consumed
        self._live_bytes -= self._head_offset
        self.stats.recovered = self._live_records
        if self._live_records == 0:
            self._reset()
            return
        seg = self._segments[-1]  # keep appending to the last segment
        self._tail_fd = os.open(seg.path(self.path), os.O_WRONLY | os.O_APPEND)

    def _scan(self, seg: _Segment) -> None:
        """Count the valid records of a segment; cut it at the first torn or corrupt one."""
        path = seg.path(self.path)
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            if offset + HEADER_BYTES > len(data):
                break
            length, crc = _HEADER.unpack_from(data, offset)
            end = offset + HEADER_BYTES + length
            if end > len(data) or zlib.crc32(data[offset + HEADER_BYTES : end]) != crc:
                break
            seg.records += 1
            offset = end
        if offset < len(data):
            self.stats.corrupt += 1
            with open(path, "r+b") as f:
                f.truncate(offset)
                f.flush()
                os.fsync(f.fileno())
        seg.size = offset

    def _boundary(self, seg: _Segment, head_offset: int) -> tuple[int, int]:
        """(offset, records before it) of the last record boundary at or before ``head_offset``."""
        fd = os.open(seg.path(self.path), os.O_RDONLY)
        try:
            offset = records = 0
            while records < seg.records:
                length, _crc = _HEADER.unpack(os.pread(fd, HEADER_BYTES, offset))
                if offset + HEADER_BYTES + length > head_offset:
                    break
                offset += HEADER_BYTES + length
                records += 1
            return offset, records
        finally:
            os.close(fd)
