"""`dora report` says how many trajectories spanned versions, from the trainer's records."""

from __future__ import annotations

from pathlib import Path

from dora.records import TrainerStep
from dora.report import RunData, version_rows


def test_the_summary_counts_trajectories_that_span_versions(tmp_path: Path) -> None:
    steps = [
        TrainerStep(
            step=i,
            time=float(i),
            metrics={"trajectories_spanning_versions": n, "off_first_version_fraction": f},
        )
        for i, (n, f) in enumerate([(0.0, 0.0), (3.0, 0.25), (1.0, 0.05)])
    ]
    rows = dict(version_rows(RunData(run_dir=tmp_path, learn=steps)))
    assert rows["trajectories_spanning_versions"] == "4"
    assert rows["off_first_version_fraction"] == "0.1"  # mean over the steps
    assert "trajectories_spanning_versions" not in dict(version_rows(RunData(run_dir=tmp_path)))
