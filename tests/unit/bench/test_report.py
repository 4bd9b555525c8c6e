"""`dora report` on recorded run directories: finished, running (a partial last line), empty."""

from __future__ import annotations

import argparse
import base64
import re
from pathlib import Path

from dora.records import Budget, TrainerStep, read_records, read_trainer_steps
from dora.report import load_run, main, version_segments, write_report
from tests.unit.bench.fixtures import write_run

PNG_MAGIC = b"\x89PNG"


def test_partial_and_broken_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "rollout.jsonl"
    budget = '{"kind": "budget", "time_s": 2.5, "max_minutes": 1.0, "last_step": 3}'
    path.write_text(f'not json\n[1, 2]\n{{"kind": "nope"}}\n{budget}\n{{"kind": "budget", ')
    assert read_records(path) == [Budget(time_s=2.5, max_minutes=1.0, last_step=3)]
    assert read_records(tmp_path / "missing.jsonl") == []
    learn = tmp_path / "learn-metrics.jsonl"
    learn.write_text('{"step": 0, "time": 5.0, "loss": 1.5}\n{"x": "y"}\n{"step": 1, "ti')
    assert read_trainer_steps(learn) == [TrainerStep(step=0, time=5.0, metrics={"loss": 1.5})]


def test_versions_per_instance_follow_the_weight_loads(tmp_path: Path) -> None:
    run = load_run(
        write_run(
            tmp_path / "r", mode="dora", steps=3, step_s=2.0, tokens=10.0, wait_s=0.0, train_s=1.0
        )
    )
    segs = version_segments(run)
    assert list(segs) == ["i0", "i1"]
    # v0 until the first load (1.0 .. 1.1), then v1 until the next (3.0 .. 3.1), ...
    assert [(v, loading) for _, _, v, loading in segs["i0"]] == [
        (0, False),
        (1, True),
        (1, False),
        (2, True),
        (2, False),
        (3, True),
    ]
    starts = [s for s, _, _, _ in segs["i0"]]
    assert starts == sorted(starts) and starts[0] == 0.0


def test_report_embeds_every_image_and_writes_them_beside(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "r",
        mode="dora",
        steps=6,
        step_s=1.5,
        tokens=200.0,
        wait_s=0.2,
        train_s=1.0,
        staleness=2,
    )
    page = write_report(run, tmp_path / "out")
    text = page.read_text()
    uris = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", text)
    assert len(uris) == 4
    assert all(base64.b64decode(u).startswith(PNG_MAGIC) for u in uris)
    for name in ("reward.png", "throughput.png", "staleness.png", "timeline.png"):
        assert (tmp_path / "out" / name).read_bytes().startswith(PNG_MAGIC)
    assert "max_versions_serving" in text and "src='http" not in text


def test_a_running_run_is_reported_from_what_is_there(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "r",
        mode="dora",
        steps=3,
        step_s=1.0,
        tokens=50.0,
        wait_s=0.1,
        train_s=0.5,
        finished=False,
        partial_last_line=True,
    )
    page = write_report(run)
    assert page == run / "report.html"
    text = page.read_text()
    assert "running (no summary yet)" in text
    assert text.count("data:image/png;base64,") == 4


def test_main_refuses_a_folder_without_records(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(argparse.Namespace(run_dir=str(tmp_path), out=None)) == 1
    assert "no rollout.jsonl" in capsys.readouterr().out


def test_eval_records_become_the_accuracy_curve(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "r",
        mode="dora",
        steps=4,
        step_s=1.0,
        tokens=50.0,
        wait_s=0.1,
        train_s=0.5,
        evals=True,
    )
    data = load_run(run)
    assert [round(e.accuracy, 2) for e in data.evals] == [0.2, 0.3, 0.4, 0.5]
    text = write_report(run).read_text()
    assert "No accuracy is recorded" not in text
    no_evals = write_run(
        tmp_path / "n", mode="dora", steps=4, step_s=1.0, tokens=50.0, wait_s=0.1, train_s=0.5
    )
    assert "No accuracy is recorded" in write_report(no_evals).read_text()


def test_a_load_under_running_calls_is_marked_on_its_instance_row(tmp_path: Path) -> None:
    """Mode inflight: an instance that changed version under running calls shows a marker at the
    load's end on its own row; a load that waited for the instance to empty shows none."""
    from matplotlib.collections import PathCollection

    from dora.records import WeightLoad
    from dora.report import _plt, draw_timeline

    run = load_run(
        write_run(
            tmp_path / "r",
            mode="inflight",
            steps=3,
            step_s=2.0,
            tokens=10.0,
            wait_s=0.0,
            train_s=1.0,
        )
    )
    _fig, ax = _plt().subplots()
    draw_timeline(ax, run)
    assert not [c for c in ax.collections if isinstance(c, PathCollection)], "no marker yet"
    run.weight_loads.append(
        WeightLoad(time_s=4.0, instance="i1", version=2, seconds=0.1, under_calls=3)
    )
    _fig, ax = _plt().subplots()
    draw_timeline(ax, run)
    markers = [c for c in ax.collections if isinstance(c, PathCollection)]
    assert len(markers) == 1
    assert markers[0].get_offsets().tolist() == [[4.0, 1.4]]  # row i1, at the load's end
    assert "loaded under calls" in [t.get_text() for t in ax.get_legend().get_texts()]
