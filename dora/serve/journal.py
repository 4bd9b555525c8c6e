"""`dora serve`'s journal: what a restarted `dora serve` needs to lose nothing (see reliability.md).

Two append-only files under `{run_dir}/journal/`, msgpack frames (a 4-byte little-endian length,
then a msgspec-encoded record; never pickle):

- `queue.msgpack`: every operation on the transfer queue, in order (admissions, starts,
  completions, failures, loads, `StepDone`, `Durable`, roll-backs, restarts), plus the prompt
  stream position of each admitted group and one `Opened` record per start of `dora serve`. The
  transfer queue is pure and deterministic, so replaying these operations into a fresh queue gives
  exactly the queue that died: its step, deadlines, group states and its accounting (admitted,
  consumed, filtered, rolled back, the staleness histogram). Records are small (tens of bytes);
  this file is never rewritten.
- `groups-NNNNNN.msgpack`: the samples of every completed group (`dora.protocol.Group`), which the
  trainer may need again until the step that consumed the group is durable, in segments
  (`GroupLog`). A new segment starts at every `Durable(t)`, and a segment is deleted as soon as
  none of its groups is held any more: compaction deletes whole files and never reads, encodes or
  rewrites a sample again (at 8,192 episodes a step, rewriting the held groups took the event
  loop 0.2-0.6 s at every `Durable`).

Every record is written with one `write` to the file descriptor (no user-space buffer) on the
journal's own thread, which also runs the `fsync`s, closes and deletes, one at a time in the order
asked: the event loop never waits for the disk, and whatever a killed process leaves on disk is a
prefix of what it asked for, across both files (a torn last frame is cut off, or skipped in a sealed
segment, when the journal is opened again). The trainer link waits for the journal (`written`)
before a group goes out, so the trainer never holds a group the journal could lose. `fsync` is
asked for at the points a machine crash would cost the most (a step's last group sent, `Durable`).
A failure on the thread (a full disk) is raised by the next journal call.

Restoring (`JournaledQueue.restore`): replay the operations, keep the payloads of groups that are
completed or assigned, and list the groups whose episodes died with the process (admitted or
started, or completed without a payload: the samples were lost between two writes); the rollout
restarts those (`TransferQueue.restart`, counted) once the trainer has said hello.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, ParamSpec, TypeVar

import msgspec

from dora.core.transfer_queue import (
    Admitted,
    Assigned,
    FailureOutcome,
    GroupState,
    Refused,
    RollbackReport,
    TransferQueue,
)
from dora.errors import ProtocolError, RunDirError
from dora.protocol import Group
from dora.serve.journal_files import Background, GroupLog, JournalFile

__all__ = ["JournaledQueue", "Restored"]

P = ParamSpec("P")
T = TypeVar("T")


class _Op(msgspec.Struct, array_like=True, tag_field="op"):
    pass


class Bind(_Op, tag="bind"):
    """`try_admit` (admitted) or `restart` of group `gid` at `version`."""

    how: Literal["admit", "restart"]
    gid: str
    version: int


class Mark(_Op, tag="mark"):
    """`start` or `filter` of group `gid`."""

    how: Literal["start", "filter"]
    gid: str


class Task(_Op, tag="task"):
    gid: str
    position: int
    """Index of the group's task in the prompt stream."""


class Complete(_Op, tag="complete"):
    gid: str
    filtered: bool


class Fail(_Op, tag="fail"):
    gid: str
    retry_allowed: bool


class Ack(_Op, tag="ack"):
    """A version loaded (`loaded`, its number) or the trainer's `StepDone`/`Durable` (a step)."""

    how: Literal["loaded", "trained", "durable"]
    number: int
    incarnation: int | None


class Rollback(_Op, tag="rollback"):
    step: int
    tainted: list[str]


class Opened(_Op, tag="opened"):
    """`dora serve` started on this journal (the first one, or a restart)."""


Op = Bind | Mark | Task | Complete | Fail | Ack | Rollback | Opened


@dataclass
class Restored:
    """What a journal held when `dora serve` started on it."""

    groups: dict[str, Group] = field(default_factory=dict)
    """Completed or assigned groups, with their samples."""
    lost: list[str] = field(default_factory=list)
    """Groups whose episodes died with the previous process (to restart), in admission order."""
    task_positions: dict[str, int] = field(default_factory=dict)
    """Prompt stream position of each group's task."""
    prompt_position: int = 0
    """Where the prompt stream continues."""
    starts: int = 0
    """How many times `dora serve` started on this journal before (0: a fresh run)."""
    trained_step: int = -1
    durable_step: int = -1
    next_group: int = 0
    """The next free group number (ids are `g<number>`)."""


_FACTS = ("step", "trained_step", "admitted")


class JournaledQueue(TransferQueue):
    """A transfer queue that writes every operation to the run's journal before returning.

    Only the outermost call is written (`fail` completes a masked group and `rollback` marks steps
    durable through the public methods; replaying the outer call repeats those)."""

    def __init__(
        self,
        run_dir: Path | None,
        *,
        groups_per_step: int,
        max_staleness: int,
        num_steps: int | None = None,
        max_retries: int = 0,
        admit_old_versions: bool = False,
    ) -> None:
        super().__init__(
            groups_per_step=groups_per_step,
            max_staleness=max_staleness,
            num_steps=num_steps,
            max_retries=max_retries,
            admit_old_versions=admit_old_versions,
        )
        self._depth = 0
        self._ops: JournalFile | None = None
        self._payloads: GroupLog | None = None
        self._bg: Background | None = None
        if run_dir is not None:
            self._bg = Background()
            self._ops = JournalFile(run_dir / "journal" / "queue.msgpack", self._bg)
            self._payloads = GroupLog(run_dir / "journal", self._bg)
        self._encoder = msgspec.msgpack.Encoder()
        self._group_encoder = msgspec.msgpack.Encoder()  # used on the journal's thread only

    # --- restoring -------------------------------------------------------------------------------

    def restore(self) -> Restored:
        """Replay the journal into this (fresh) queue; then record this start."""
        out = Restored()
        if self._ops is None or self._payloads is None:
            return out
        decode_op = msgspec.msgpack.Decoder(Op).decode
        try:
            with self._inner():  # replaying: nothing is written again
                for frame in self._ops.frames:
                    self._replay(decode_op(frame), out)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"{self._ops.path}: unreadable journal record: {exc}") from exc
        if self._ops.cut is not None:
            raise RunDirError(self._cut_short(self._ops, self._ops.cut))
        self._ops.frames = []
        decode_group = msgspec.msgpack.Decoder(Group).decode
        for segment, frame in self._payloads.frames:
            group = decode_group(frame)
            if self.state(group.id) in (GroupState.COMPLETED, GroupState.ASSIGNED):
                out.groups[group.id] = group
                self._payloads.hold(group.id, segment)
        self._payloads.frames = []
        self._payloads.release_all_but(out.groups)
        for gid, state in self.group_states().items():
            if state in (GroupState.ADMITTED, GroupState.STARTED) or (
                state is GroupState.COMPLETED and gid not in out.groups
            ):
                out.lost.append(gid)
        out.lost.sort(key=lambda gid: int(gid[1:]) if gid[1:].isdigit() else 0)
        self._write(Opened())
        return out

    def _cut_short(self, ops: JournalFile, index: dict[str, int]) -> str:
        """What a cut queue log lost: its records, and the run's progress they held."""
        lost = index["records"] - ops.records
        had = ", ".join(f"{k} {index[k]}" for k in _FACTS if k in index)
        left = ", ".join(f"{k} {v}" for k, v in self._facts().items())
        return (
            f"{ops.path} was cut short: it holds {ops.records} of the {index['records']} records "
            f"({ops.good_bytes} of {index['bytes']} bytes) that {ops.index.name} says were "
            f"written, {lost} records lost. The queue had reached {had}; what is left replays "
            f"to {left}. Restoring it would lose that progress and its accounting (a torn last "
            "record from a kill mid-write is cut off silently; this is not one): put the file "
            "back from a copy, or start a new run in another directory"
        )

    def _facts(self) -> dict[str, int]:
        """The queue's progress, written into the queue log's index at every sync."""
        acc = self.accounting()
        return {"step": self.step, "trained_step": self.trained_step, "admitted": acc.admitted}

    def _replay(self, op: Op, out: Restored) -> None:
        match op:
            case Bind(how="admit", gid=gid, version=v):
                self.try_admit(gid, version=v)
                if gid[1:].isdigit():
                    out.next_group = max(out.next_group, int(gid[1:]) + 1)
            case Bind(gid=gid, version=v):
                self.restart(gid, version=v)
            case Task(gid=gid, position=p):
                out.task_positions[gid] = p
                out.prompt_position = max(out.prompt_position, p + 1)
            case Mark(how="start", gid=gid):
                self.start(gid)
            case Mark(gid=gid):
                self.filter(gid)
            case Complete(gid=gid, filtered=filtered):
                self.complete(gid, filtered=filtered)
            case Fail(gid=gid, retry_allowed=allowed):
                self.fail(gid, retry_allowed=allowed)
            case Ack(how="loaded", number=v, incarnation=inc):
                self.on_version_loaded(v, incarnation=inc)
            case Ack(how="trained", number=s, incarnation=inc):
                if self.on_step_done(s, incarnation=inc):
                    out.trained_step = max(out.trained_step, s)
            case Ack(number=s, incarnation=inc):
                self.on_durable(s, incarnation=inc)
                if inc is None or inc == self.incarnation:
                    out.durable_step = max(out.durable_step, s)
            case Rollback(step=s, tainted=tainted):
                self.rollback(s, tainted=tainted)
                out.trained_step = s
            case Opened():
                out.starts += 1

    # --- writing ---------------------------------------------------------------------------------

    def _write(self, op: _Op) -> None:
        if self._ops is not None and self._depth == 0:
            self._ops.append(self._encoder.encode(op))

    def keep(self, group: Group) -> None:
        """Journal a completed group's samples (before the trainer may need them; the trainer
        link waits for `written`). Encoded on the journal's thread: `group` must not change
        after this call, and nothing in serve changes a completed group."""
        if self._payloads is not None:
            self._payloads.append(group.id, functools.partial(self._group_encoder.encode, group))

    def task(self, group_id: str, position: int) -> None:
        """Journal the prompt stream position of an admitted group's task."""
        self._write(Task(group_id, position))

    def sync(self) -> None:
        """fsync both files, on the journal's thread (a step went out, or became durable)."""
        if self._ops is not None and self._payloads is not None:
            self._ops.sync(**self._facts())
            self._payloads.sync()

    def compact(self, held: Collection[str]) -> None:
        """After `Durable`: start a new samples segment and drop the samples of every group not
        in `held` (the ids of the groups the trainer may still need)."""
        if self._payloads is not None:
            self._payloads.roll()
            self._payloads.release_all_but(held)
            self.sync()

    async def written(self) -> None:
        """Wait (without blocking the loop) until every record journaled so far is written."""
        if self._bg is not None:
            await self._bg.written()

    def flush(self) -> None:
        """Block until every record journaled so far is written."""
        if self._bg is not None:
            self._bg.flush()

    def close(self) -> None:
        """Close the files once the journal's thread has done everything asked of it."""
        if self._payloads is not None:
            self._payloads.close()
        if self._ops is not None:
            self._ops.close(**self._facts())
        if self._bg is not None:
            self._bg.close()

    def journal_writes(self) -> tuple[int, int]:
        """(frames appended, bytes appended) to the journal's files so far."""
        files = [f for f in (self._ops, self._payloads) if f is not None]
        return sum(f.writes for f in files), sum(f.bytes_written for f in files)

    # --- the queue's operations, journaled ----------------------------------------------------

    @contextlib.contextmanager
    def _inner(self) -> Iterator[None]:
        """Calls made inside a journaled operation are not journaled themselves."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def _journaled(self, op: _Op, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run the queue's `call`, then journal `op` (only if it returned: a refused operation
        changed nothing)."""
        with self._inner():
            out = call(*args, **kwargs)
        self._write(op)
        return out

    def try_admit(self, group_id: str, *, version: int | None = None) -> Admitted | Refused:
        with self._inner():
            out = super().try_admit(group_id, version=version)
        if isinstance(out, Admitted):
            self._write(Bind("admit", group_id, out.version))
        return out

    def start(self, group_id: str) -> None:
        self._journaled(Mark("start", group_id), super().start, group_id)

    def restart(self, group_id: str, *, version: int) -> list[Assigned]:
        op = Bind("restart", group_id, version)
        return self._journaled(op, super().restart, group_id, version=version)

    def complete(self, group_id: str, *, filtered: bool = False) -> list[Assigned]:
        op = Complete(group_id, filtered)
        return self._journaled(op, super().complete, group_id, filtered=filtered)

    def filter(self, group_id: str) -> list[Assigned]:
        return self._journaled(Mark("filter", group_id), super().filter, group_id)

    def fail(self, group_id: str, *, retry_allowed: bool = True) -> FailureOutcome:
        op = Fail(group_id, retry_allowed)
        return self._journaled(op, super().fail, group_id, retry_allowed=retry_allowed)

    def on_version_loaded(self, version: int, *, incarnation: int | None = None) -> bool:
        op = Ack("loaded", version, incarnation)
        return self._journaled(op, super().on_version_loaded, version, incarnation=incarnation)

    def on_step_done(self, step: int, *, incarnation: int | None = None) -> bool:
        op = Ack("trained", step, incarnation)
        return self._journaled(op, super().on_step_done, step, incarnation=incarnation)

    def on_durable(self, step: int, *, incarnation: int | None = None) -> list[str]:
        op = Ack("durable", step, incarnation)
        return self._journaled(op, super().on_durable, step, incarnation=incarnation)

    def rollback(self, checkpoint_step: int, *, tainted: Collection[str] = ()) -> RollbackReport:
        names = sorted(tainted)
        op = Rollback(checkpoint_step, names)
        return self._journaled(op, super().rollback, checkpoint_step, tainted=names)
