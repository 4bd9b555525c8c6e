"""`dora serve`'s journal: a queue restored from it is the queue that died, a torn last record is
cut off, compaction keeps only the segments of groups still held and never rewrites a sample,
lost groups restart (counted), and records are written off the caller's thread, with a wait for
them that the trainer link uses before a group goes out."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import msgspec
import pytest

from dora.core.transfer_queue import Admitted, GroupState
from dora.protocol import Group, Sample
from dora.serve.journal import JournaledQueue
from dora.serve.journal_files import read_frames

B, K, T = 2, 2, 8


def _queue(run_dir: Path) -> JournaledQueue:
    return JournaledQueue(run_dir, groups_per_step=B, max_staleness=K, num_steps=T, max_retries=1)


def _group(gid: str, version: int) -> Group:
    sample = Sample.build(
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -0.25],
        versions=[-1, version, version],
        prompt_len=1,
        reward=1.0,
        finish_reason="stop",
    )
    return Group(id=gid, prompt_id=f"p{gid}", version=version, samples=[sample, sample])


def _drive(q: JournaledQueue, rng: random.Random, *, events: int) -> dict[str, Group]:
    """Random admissions, starts, completions (some filtered or failed), trainer acks,
    durability and one trainer restart, as the rollout makes them."""
    q.on_version_loaded(0)
    held: dict[str, Group] = {}
    running: list[str] = []
    n = trained = 0
    durable = -1
    rolled_back = False
    for _ in range(events):
        roll = rng.random()
        if roll < 0.35 and q.admission_blocker() is None:
            gid = f"g{n}"
            n += 1
            admitted = q.try_admit(gid)
            assert isinstance(admitted, Admitted)
            q.task(gid, n - 1)
            if rng.random() < 0.8:
                q.start(gid)
            running.append(gid)
        elif roll < 0.7 and running:
            gid = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.1:
                outcome = q.fail(gid)
                if outcome.retried:
                    running.append(gid)
                    continue
            else:
                group = _group(gid, q.group_version(gid))
                q.keep(group)
                held[gid] = group
                q.complete(gid, filtered=rng.random() < 0.1)
        elif roll < 0.85 and trained < q.step:
            q.on_step_done(trained, incarnation=q.incarnation)
            q.on_version_loaded(trained + 1, incarnation=q.incarnation)
            if trained % 2 == 1:
                durable = trained
                for gid in q.on_durable(trained, incarnation=q.incarnation):
                    held.pop(gid, None)
                q.compact(held.keys())
            trained += 1
        elif roll < 0.87 and not rolled_back and trained > durable + 1 and durable >= 0:
            rolled_back = True
            report = q.rollback(durable)
            for gid in report.rolled_back:
                held.pop(gid, None)
                if gid in running:
                    running.remove(gid)
            trained = durable + 1
    return held


@pytest.mark.parametrize("seed", range(12))
def test_restored_queue_is_the_queue_that_died(tmp_path: Path, seed: int) -> None:
    q = _queue(tmp_path)
    assert q.restore().starts == 0  # a fresh run directory (the rollout always restores first)
    held = _drive(q, random.Random(seed), events=200)
    q.close()

    again = _queue(tmp_path)
    restored = again.restore()
    assert restored.starts == 1
    assert again.accounting() == q.accounting()
    assert again.group_states() == q.group_states()
    assert again.staleness_histogram() == q.staleness_histogram()
    assert (again.step, again.incarnation) == (q.step, q.incarnation)
    assert again.admission_blocker() == q.admission_blocker()
    assert again.version_counts() == q.version_counts()
    # the samples of every completed or assigned group, and nothing the trainer made durable
    done = {
        g for g, s in q.group_states().items() if s in (GroupState.COMPLETED, GroupState.ASSIGNED)
    }
    assert set(restored.groups) == done
    for gid in done:
        assert restored.groups[gid].samples[0].tokens().tolist() == [1, 2, 3]
    running = {
        g for g, s in q.group_states().items() if s in (GroupState.ADMITTED, GroupState.STARTED)
    }
    assert set(restored.lost) == running
    assert all(restored.task_positions[g] == int(g[1:]) for g in running)
    assert restored.next_group == max((int(g[1:]) + 1 for g in restored.task_positions), default=0)
    assert restored.prompt_position == restored.next_group
    # compaction kept only segments that hold a group still held, and every held group's samples
    kept = again._payloads.segments()  # type: ignore[union-attr]
    again.close()
    on_disk = _segments(tmp_path)
    assert sorted(on_disk) == kept
    assert all(ids & set(restored.groups) for n, ids in on_disk.items() if n != max(on_disk))
    assert set(restored.groups) <= set().union(*on_disk.values())
    assert set(restored.groups) == set(held) & done


def _segments(run_dir: Path) -> dict[int, set[str]]:
    """The group ids in each samples segment on disk."""
    decode = msgspec.msgpack.Decoder(Group).decode
    return {
        int(p.stem.split("-")[1]): {decode(f).id for f in read_frames(p)[0]}
        for p in (run_dir / "journal").glob("groups-*.msgpack")
    }


def test_compaction_deletes_whole_segments_and_never_rewrites_a_sample(tmp_path: Path) -> None:
    q = JournaledQueue(tmp_path, groups_per_step=1, max_staleness=4, num_steps=8)
    q.restore()
    q.on_version_loaded(0)
    held: set[str] = set()

    def complete(gid: str) -> None:
        q.try_admit(gid)
        q.start(gid)
        q.keep(_group(gid, 0))
        q.complete(gid)  # assigned to the next step at once (one group a step)
        held.add(gid)

    def durable(step: int) -> None:
        q.on_step_done(step)
        held.difference_update(q.on_durable(step))
        q.compact(held)

    complete("g0")
    complete("g1")
    durable(0)  # g0 goes, g1 keeps the first segment; a new one starts
    first = tmp_path / "journal" / "groups-000000.msgpack"
    q.flush()
    before = (first.stat().st_ino, first.read_bytes())
    complete("g2")
    q.sync()
    q.flush()
    assert (first.stat().st_ino, first.read_bytes()) == before  # never rewritten
    durable(1)  # g1 goes: the first segment has nothing left and is deleted
    q.close()
    assert {n: ids for n, ids in _segments(tmp_path).items() if ids} == {1: {"g2"}}
    again = JournaledQueue(tmp_path, groups_per_step=1, max_staleness=4, num_steps=8)
    assert set(again.restore().groups) == {"g2"}
    again.close()


def test_lost_groups_restart_at_a_newer_version_and_are_counted(tmp_path: Path) -> None:
    q = _queue(tmp_path)
    q.restore()
    q.on_version_loaded(0)
    for gid in ("g0", "g1", "g2"):
        q.try_admit(gid)
        q.task(gid, int(gid[1:]))
    q.start("g0")
    q.start("g1")
    q.keep(_group("g2", 0))
    q.start("g2")
    q.complete("g2")  # assigned to step 0 at once
    q.close()

    again = _queue(tmp_path)
    restored = again.restore()
    assert restored.lost == ["g0", "g1"] and set(restored.groups) == {"g2"}
    assert again.state("g2") is GroupState.ASSIGNED
    assert again.restart("g0", version=0) == []
    assert again.state("g0") is GroupState.ADMITTED
    again.start("g0")
    again.keep(_group("g0", 0))
    assert [(a.group_id, a.step) for a in again.complete("g0")] == [("g0", 0)]
    again.on_step_done(0)
    again.on_version_loaded(1)
    again.restart("g1", version=1)  # the newest version: a later deadline
    assert again.group_version("g1") == 1 and again.deadline("g1") == 3
    acct = again.accounting()
    assert acct.restarted == 2 and acct.admitted == 3
    again.close()

    # the restarts are journaled too: a third start sees them
    third = _queue(tmp_path)
    restored = third.restore()
    assert restored.starts == 2 and third.accounting() == acct
    assert restored.lost == ["g1"] and set(restored.groups) == {"g0", "g2"}
    third.close()


async def test_records_are_written_off_the_loop_and_waited_for_before_sending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dora.serve import journal_files

    gate = threading.Event()
    write = journal_files._write_all

    def held_write(fd: int, data: bytes) -> None:
        gate.wait(5)
        write(fd, data)

    monkeypatch.setattr(journal_files, "_write_all", held_write)
    q = _queue(tmp_path)
    q.restore()
    q.on_version_loaded(0)
    q.try_admit("g0")
    q.start("g0")
    q.keep(_group("g0", 0))
    q.complete("g0")  # none of these waited for the disk
    ops = tmp_path / "journal" / "queue.msgpack"
    assert read_frames(ops)[0] == []
    waiting = asyncio.ensure_future(q.written())
    cancelled = asyncio.ensure_future(q.written())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    cancelled.cancel()  # a sender that gives up does not cancel the writes it waited for
    gate.set()
    await asyncio.wait_for(waiting, 5)
    assert len(read_frames(ops)[0]) == 5  # opened, loaded, admit, start, complete
    assert _segments(tmp_path) == {0: {"g0"}}
    q.close()
    again = _queue(tmp_path)
    assert set(again.restore().groups) == {"g0"}
    again.close()


def test_a_torn_last_record_is_cut_off(tmp_path: Path) -> None:
    q = _queue(tmp_path)
    q.restore()
    q.on_version_loaded(0)
    q.try_admit("g0")
    q.close()
    path = tmp_path / "journal" / "queue.msgpack"
    whole = path.read_bytes()
    with path.open("ab") as f:
        f.write(b"\x40\x00\x00\x00\x93")  # a frame of 64 bytes, killed after one
    again = _queue(tmp_path)
    restored = again.restore()
    assert restored.lost == ["g0"] and again.accounting().admitted == 1
    again.close()
    frames, size = read_frames(path)
    assert path.read_bytes()[: len(whole)] == whole and size == path.stat().st_size
    assert len(frames) == 4  # opened, loaded, admit, opened: the torn frame is gone


def test_restart_keeps_the_invariant_and_refuses_assigned_groups(tmp_path: Path) -> None:
    from dora.errors import SchedulingError

    q = JournaledQueue(None, groups_per_step=1, max_staleness=1, num_steps=4)
    q.on_version_loaded(0)
    q.try_admit("a")
    q.try_admit("b")
    q.start("a")
    q.complete("a")
    with pytest.raises(SchedulingError, match="assigned"):
        q.restart("a", version=0)
    with pytest.raises(SchedulingError, match="cannot restart"):
        q.restart("b", version=1)  # not loaded
    q.restart("b", version=0)
    q.check_invariant()
    assert q.restore().starts == 0  # no run directory: nothing journaled


def test_a_journal_cut_in_half_is_reported_with_what_was_lost(tmp_path: Path) -> None:
    from dora.errors import RunAborted

    q = _queue(tmp_path)
    q.restore()
    _drive(q, random.Random(3), events=300)
    q.sync()
    q.close()
    path = tmp_path / "journal" / "queue.msgpack"
    frames, _ = read_frames(path)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])  # not a torn last record: half the file
    left, _ = read_frames(path)
    again = _queue(tmp_path)
    with pytest.raises(RunAborted) as refused:
        again.restore()
    message = str(refused.value)
    assert str(path) in message
    assert f"{len(left)} of the {len(frames)} records" in message, message
    assert f"{len(frames) - len(left)} records lost" in message, message
    assert path.read_bytes() == whole[: len(whole) // 2], "the cut journal is left as it is"
