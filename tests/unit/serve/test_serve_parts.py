"""Serve's parts reach no other part's state: they call its methods. The router's instances and
leases are read through the router's methods, no part goes through `Placement` to the router or
the orchestrator (the composition root hands each part those it uses), and a part does not wire
itself into others when it is built (the composition root does)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import dora.serve
from dora.config import ServeConfig
from dora.core.orchestrator import Mode, Orchestrator
from dora.serve.journal import JournaledQueue
from dora.serve.lifecycle import InstanceLifecycle
from dora.serve.metrics import MetricsLog
from dora.serve.placement import Placement
from dora.serve.router import Router
from dora.serve.spawn import Spawner
from dora.serve.stats import ServeStats
from dora.serve.versions import InstanceVersions
from dora.serve.weights import WeightStore

SERVE = Path(dora.serve.__file__).parent

OWNED = {
    "router": {"instances", "leases", "turns"},
    "placement": {"router", "orchestrator"},
}
"""A part's name (as the attribute or variable that holds it ends) and the state of it that
only its own module reads."""


def _holder(node: ast.expr) -> str:
    """The name an expression ends with: `self._router` -> `router`."""
    if isinstance(node, ast.Attribute):
        return node.attr.lstrip("_")
    if isinstance(node, ast.Name):
        return node.id.lstrip("_")
    return ""


def reach_throughs(root: Path) -> list[str]:
    """`file:line holder.attr` for each read of another part's own state."""
    found = []
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            holder = _holder(node.value)
            if path.stem != holder and node.attr in OWNED.get(holder, ()):
                found.append(f"{path.name}:{node.lineno} {holder}.{node.attr}")
    return found


def test_no_part_reaches_into_another() -> None:
    assert reach_throughs(SERVE) == []


def test_the_check_finds_a_reach_through(tmp_path: Path) -> None:
    (tmp_path / "part.py").write_text(
        "def f(self):\n    return self._router.instances['i0'], self.placement.router.leases\n"
    )
    assert sorted(reach_throughs(tmp_path)) == [
        "part.py:2 placement.router",
        "part.py:2 router.instances",
        "part.py:2 router.leases",
    ]


def test_the_lifecycle_does_not_wire_itself_into_other_parts(tmp_path: Path) -> None:
    metrics = MetricsLog(tmp_path)
    spawn = Spawner()
    router, orchestrator = Router(kv_migration=False), Orchestrator(mode=Mode.DORA)
    placement = Placement(orchestrator, router, metrics=metrics, spawn=spawn)
    on_load, on_unload = placement.on_load, placement.on_unload
    try:
        InstanceLifecycle(
            ServeConfig(),
            placement=placement,
            orchestrator=orchestrator,
            router=router,
            versions=InstanceVersions(multi_version=False),
            queue=JournaledQueue(tmp_path, groups_per_step=1, max_staleness=1, num_steps=1),
            store=WeightStore(),
            metrics=metrics,
            stats=ServeStats(),
            spawn=spawn,
        )
        assert placement.on_load == on_load and placement.on_unload == on_unload
        assert router.on_failure is None
    finally:
        metrics.close()


def test_parts_get_the_settings_they_use_not_the_whole_config() -> None:
    """Only the composition root reads the whole config; a part gets its sections."""
    from dora.serve.dispatcher import Dispatcher
    from dora.serve.evaluate import Evaluator
    from dora.serve.trainer_link import TrainerLink

    for part in (Dispatcher, TrainerLink, Evaluator, InstanceLifecycle):
        hints = inspect.signature(part).parameters.values()
        whole = [p.name for p in hints if "DoraConfig" in str(p.annotation)]
        assert not whole, f"{part.__name__} takes the whole config as {whole}"
