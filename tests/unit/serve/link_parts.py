"""Serve's trainer link on its real parts (journaled queue, placement, weight store), and its
roll-back, for tests that drive them without a serve process."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from dora.config import DoraConfig
from dora.core.orchestrator import Mode, Orchestrator
from dora.serve.journal import JournaledQueue
from dora.serve.metrics import MetricsLog
from dora.serve.placement import Placement
from dora.serve.rollback import Rollback
from dora.serve.router import Router
from dora.serve.running import RunningGroups
from dora.serve.spawn import Spawner
from dora.serve.stats import ServeStats
from dora.serve.trainer_link import TrainerLink
from dora.serve.versions import InstanceVersions
from dora.serve.weights import WeightStore


class Parts(NamedTuple):
    link: TrainerLink
    rollback: Rollback
    running: RunningGroups
    placement: Placement
    orchestrator: Orchestrator
    store: WeightStore
    stats: ServeStats
    spawn: Spawner
    metrics: MetricsLog


def serve_parts(
    config: DoraConfig,
    q: JournaledQueue,
    router: Router,
    run_dir: Path,
    link: object = None,
    *,
    versions: InstanceVersions | None = None,
) -> Parts:
    """A TrainerLink for `config`'s mode over `q` and `router`, version 0's weights stored, and
    its roll-back wired as the composition root wires it (over `versions`, the record of the
    versions instances hold); the caller closes the metrics log."""
    metrics = MetricsLog(run_dir)
    spawn = Spawner()
    orchestrator = Orchestrator(mode=Mode(config.rollout.mode))
    placement = Placement(orchestrator, router, metrics=metrics, spawn=spawn)
    store = WeightStore()
    store.add_path(0, str(run_dir))
    stats = ServeStats()
    r = TrainerLink(
        config.rollout,
        config.learn,
        request_timeout_s=config.serve.request_timeout_s,
        env_name=config.env.cls,
        link=link,  # type: ignore[arg-type]  # a fake, or None where nothing is sent
        queue=q,
        placement=placement,
        orchestrator=orchestrator,
        store=store,
        metrics=metrics,
        stats=stats,
        spawn=spawn,
        restored=q.restore(),
    )
    running = RunningGroups(group_size=config.rollout.group_size, close_lease=placement.drop)
    rollback = Rollback(
        group_size=config.rollout.group_size,
        queue=q,
        trainer=r,
        running=running,
        placement=placement,
        orchestrator=orchestrator,
        versions=versions if versions is not None else InstanceVersions(multi_version=False),
        store=store,
        metrics=metrics,
    )
    r.on_restart = rollback
    return Parts(r, rollback, running, placement, orchestrator, store, stats, spawn, metrics)


def trainer_link(
    config: DoraConfig, q: JournaledQueue, router: Router, run_dir: Path, link: object = None
) -> tuple[TrainerLink, MetricsLog]:
    """The trainer link of `serve_parts` and the metrics log to close."""
    parts = serve_parts(config, q, router, run_dir, link)
    return parts.link, parts.metrics
