"""The journal's files on disk: length-prefixed msgpack frames written by one background thread.

`JournalFile` is the append-only log of the transfer queue's operations, with an index beside it
(`<file>.index`: record count, bytes, and the queue's progress at the last sync) that tells a file
cut short from one whose last frame was torn; `GroupLog` keeps completed groups in segments that are
deleted whole. Every write is one `write` to the file descriptor on the journal's own thread, in
the order asked, so what a killed process leaves is a prefix of what it asked for. What the records
mean and how they are replayed is `dora.serve.journal`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import struct
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import ParamSpec, TypeVar

import msgspec

from dora.errors import RunDirError

__all__ = ["Background", "GroupLog", "JournalFile", "read_frames", "read_index"]

_LEN = struct.Struct("<I")

P = ParamSpec("P")
T = TypeVar("T")


def read_frames(path: Path) -> tuple[list[bytes], int]:
    """The complete frames of `path` and the byte length they cover (a torn tail is left out)."""
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    frames: list[bytes] = []
    at = 0
    while at + _LEN.size <= len(data):
        (n,) = _LEN.unpack_from(data, at)
        if at + _LEN.size + n > len(data):
            break
        frames.append(data[at + _LEN.size : at + _LEN.size + n])
        at += _LEN.size + n
    return frames, at


def _frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Background:
    """The journal's thread: writes, fsync, close and unlink, in the order asked, off the event
    loop."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dora-journal")
        self._error: BaseException | None = None
        self._last: Future[object] | None = None

    def submit(self, fn: Callable[P, object], *args: P.args, **kwargs: P.kwargs) -> None:
        self.check()
        self._last = self._pool.submit(fn, *args, **kwargs)
        self._last.add_done_callback(self._done)

    async def written(self) -> None:
        """Wait until everything asked of the thread so far is done (never cancels a write)."""
        last = self._last
        if last is not None and not last.done():
            await asyncio.shield(asyncio.wrap_future(last))
        self.check()

    def flush(self) -> None:
        """Block until everything asked of the thread so far is done."""
        if self._last is not None:
            concurrent.futures.wait([self._last])
        self.check()

    def _done(self, future: Future[object]) -> None:
        if self._error is None and future.exception() is not None:
            self._error = future.exception()

    def check(self) -> None:
        """Raise what failed on the journal's thread (the journal cannot be trusted after it)."""
        if self._error is not None:
            raise OSError(f"dora serve's journal could not be written: {self._error!r}")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.check()


class JournalFile:
    """One append-only file of frames, opened after cutting off a torn tail; written on the
    journal's thread.

    Its index (`<name>.index`, JSON) says how many records and bytes the file held at its last
    `sync` (after the fsync) or `close`, with the `facts` the caller gave then: a file that holds
    fewer was cut short (a truncation, a lost block, a copy cut off), which no kill mid-write can
    do. Such a file is left as it is, and `cut` holds its index for the caller to report."""

    def __init__(self, path: Path, background: Background) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.index = path.with_name(f"{path.name}.index")
        self._bg = background
        self.frames, good = read_frames(path)
        self.records, self.good_bytes = len(self.frames), good
        self.writes = self.bytes_written = 0
        self.cut = read_index(self.index)
        if self.cut is not None and int(self.cut.get("records", 0)) <= self.records:
            self.cut = None
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if self.cut is None and os.fstat(self._fd).st_size != good:
            os.ftruncate(self._fd, good)

    def append(self, payload: bytes) -> None:
        frame = _frame(payload)
        self._bg.submit(_write_all, self._fd, frame)
        self.writes += 1
        self.bytes_written += len(frame)

    def sync(self, **facts: int) -> None:
        self._bg.submit(os.fsync, self._fd)
        self._write_index(facts)

    def _write_index(self, facts: dict[str, int]) -> None:
        if self.cut is None:  # a cut file's index is the record of what it lost: kept
            total = {"records": self.records + self.writes, "bytes": self.good_bytes}
            total["bytes"] += self.bytes_written
            self._bg.submit(_write_json, self.index, {**total, **facts})

    def close(self, **facts: int) -> None:
        if self._fd >= 0:
            self._write_index(facts)
            self._bg.submit(os.close, self._fd)
            self._fd = -1


def read_index(path: Path) -> dict[str, int] | None:
    try:
        index = msgspec.json.decode(path.read_bytes(), type=dict[str, int])
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RunDirError(f"{path}: unreadable journal index: {exc}") from None
    return index


def _write_json(path: Path, value: dict[str, int]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(msgspec.json.encode(value))
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class GroupLog:
    """The samples of completed groups, in segment files `groups-NNNNNN.msgpack` of frames.

    Appends go to the newest segment; `roll` (at every `Durable`) starts a new one. Each group id
    is known to live in one segment; `release_all_but(held)` forgets the groups no longer held and
    deletes every sealed segment left with none. Opening reads every segment's complete frames
    (`frames`, with their segment numbers) and starts a fresh segment for this process's writes.
    """

    _PATTERN = "groups-*.msgpack"

    def __init__(self, directory: Path, background: Background) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._bg = background
        found = sorted((int(p.stem.split("-")[1]), p) for p in directory.glob(self._PATTERN))
        self.frames: list[tuple[int, bytes]] = [
            (n, frame) for n, path in found for frame in read_frames(path)[0]
        ]
        self._members: dict[int, set[str]] = {n: set() for n, _ in found}
        self._where: dict[str, int] = {}
        self.writes = self.bytes_written = 0
        self._active = self._fd = -1
        self._active_frames = 0
        self._open(found[-1][0] + 1 if found else 0)

    def _path(self, number: int) -> Path:
        return self.directory / f"groups-{number:06d}.msgpack"

    def _open(self, number: int) -> None:
        self._active = number
        self._active_frames = 0
        self._members[number] = set()
        self._fd = os.open(self._path(number), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._bg.submit(_fsync_dir, self.directory)

    def hold(self, group_id: str, segment: int) -> None:
        """A group restored from `segment` is held (the newest frame of an id wins)."""
        old = self._where.get(group_id)
        if old is not None:
            self._members[old].discard(group_id)
        self._where[group_id] = segment
        self._members[segment].add(group_id)

    def append(self, group_id: str, encode: Callable[[], bytes]) -> None:
        """Append the group's frame to the active segment. `encode` makes its payload on the
        journal's thread: a group's samples are hundreds of KB, too long an encoding to hold
        the event loop for, at every completion."""
        self._bg.submit(self._write_frame, self._fd, encode)
        self.writes += 1
        self._active_frames += 1
        self.hold(group_id, self._active)

    def _write_frame(self, fd: int, encode: Callable[[], bytes]) -> None:
        frame = _frame(encode())
        _write_all(fd, frame)
        self.bytes_written += len(frame)  # added to on the journal's thread only

    def sync(self) -> None:
        self._bg.submit(os.fsync, self._fd)

    def roll(self) -> None:
        """Seal the active segment (if it has frames) and start the next one."""
        if not self._active_frames:
            return
        sealed, fd = self._active, self._fd
        self._bg.submit(os.fsync, fd)
        self._bg.submit(os.close, fd)
        self._open(sealed + 1)
        self._prune(sealed)

    def release_all_but(self, held: Collection[str]) -> None:
        """Forget every group not in `held`; delete the sealed segments that hold none."""
        for gid in [g for g in self._where if g not in held]:
            self._members[self._where.pop(gid)].discard(gid)
        for n in [n for n, ids in self._members.items() if not ids]:
            self._prune(n)

    def _prune(self, number: int) -> None:
        if number != self._active and number in self._members and not self._members[number]:
            del self._members[number]
            self._bg.submit(os.unlink, self._path(number))

    def segments(self) -> list[int]:
        """The segment numbers on disk (or about to be deleted by the journal's thread)."""
        return sorted(self._members)

    def close(self) -> None:
        if self._fd >= 0:
            self._bg.submit(os.close, self._fd)
            self._fd = -1
