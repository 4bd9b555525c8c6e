"""Serve's trainer link on its real parts (journaled queue, placement, weight store), for tests
that drive it without a serve process."""

from __future__ import annotations

from pathlib import Path

from dora.config import DoraConfig
from dora.core.orchestrator import Mode, Orchestrator
from dora.serve.journal import JournaledQueue
from dora.serve.metrics import MetricsLog
from dora.serve.placement import Placement
from dora.serve.router import Router
from dora.serve.spawn import Spawner
from dora.serve.stats import ServeStats
from dora.serve.trainer_link import TrainerLink
from dora.serve.versions import InstanceVersions
from dora.serve.weights import WeightStore


def trainer_link(
    config: DoraConfig,
    q: JournaledQueue,
    router: Router,
    run_dir: Path,
    link: object = None,
    *,
    versions: InstanceVersions | None = None,
) -> tuple[TrainerLink, MetricsLog]:
    """A TrainerLink for `config`'s mode over `q` and `router` (and `versions`, the record of
    the versions instances hold), version 0's weights stored; the caller closes the metrics log
    it returns."""
    metrics = MetricsLog(run_dir)
    spawn = Spawner()
    orchestrator = Orchestrator(mode=Mode(config.rollout.mode))
    placement = Placement(orchestrator, router, metrics=metrics, spawn=spawn)
    store = WeightStore()
    store.add_path(0, str(run_dir))
    r = TrainerLink(
        config,
        link=link,  # type: ignore[arg-type]  # a fake, or None where nothing is sent
        queue=q,
        placement=placement,
        versions=versions if versions is not None else InstanceVersions(multi_version=False),
        store=store,
        metrics=metrics,
        stats=ServeStats(),
        spawn=spawn,
        restored=q.restore(),
    )
    return r, metrics
