"""The simulator's state: requests, groups and instances as the event loop (events.py) sees them,
and `Run`, what one simulated mode measured. Plain records with slots; every rule that changes
them lives in the event loop.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from dora.core.orchestrator import Load
from dora.costs import Setup
from dora.sim.modes import ModePlan
from dora.sim.workload import Episode

__all__ = ["Group", "Inst", "Req", "Run"]


class Req:
    """One sample of a group. A sample of an agentic episode holds its slot (its lease) while it
    waits for a tool; its KV cache goes to host memory meanwhile (as the production system does)
    and only the tool's tokens are prefilled on return."""

    __slots__ = (
        "cached",
        "ctx",
        "ctx0",
        "ep",
        "group",
        "inst",
        "mark",
        "p0",
        "remaining",
        "rid",
        "shard",
        "tool_pending",
        "turn",
        "v_first",
        "v_last",
        "where",
    )

    def __init__(self, rid: str, group: Group, ep: Episode, version: int) -> None:
        self.rid = rid
        self.shard = 0
        self.group = group
        self.ep = ep
        self.turn = 0
        self.ctx = float(ep.prompt)
        self.remaining = float(ep.turns[0])
        self.cached = -1.0  # -1: a fresh prompt, prefilled once per group (shared prefix)
        self.inst: Inst | None = None
        self.where = 0  # 0: neither running nor waiting (tool, parked), 1: waiting, 2: running
        self.mark = self.p0 = self.ctx0 = 0.0
        self.tool_pending = False
        self.v_first = self.v_last = version


@dataclass(slots=True)
class Group:
    gid: str
    version: int
    left: int
    tokens: int
    chain_s: float = 0.0
    """The least time its slowest episode takes (`workload.chain_s`)."""
    admitted_s: float = 0.0
    done_s: float = 0.0
    """When it was admitted, and when its last episode ended."""


class Inst:
    __slots__ = (
        "busy",
        "draining",
        "heap",
        "id",
        "kv",
        "load",
        "paused",
        "prog",
        "ready",
        "roomy",
        "running",
        "seg_start",
        "shard",
        "stall",
        "t",
        "target",
        "token",
        "used",
        "version",
        "waiting",
    )

    def __init__(self, iid: str, shard: int) -> None:
        self.id = iid
        self.shard = shard
        self.version: int | None = None
        self.ready = False
        self.draining = False
        self.paused = False
        self.running: dict[str, Req] = {}
        self.waiting: deque[Req] = deque()
        self.heap: list[tuple[float, int, Req]] = []
        self.kv = 0.0  # context tokens of the running sequences
        self.prog = 0.0  # progress: tokens decoded per running sequence since the start
        self.t = 0.0
        self.stall = 0.0
        self.token = 0
        self.load: Load | None = None  # the pending load
        self.target = 0.0
        self.used = 0  # slots the orchestrator counts (running, waiting, in a tool)
        self.roomy: int | None = None
        self.busy = False
        self.seg_start = 0.0


@dataclass
class Run:
    """Everything one simulated mode measured."""

    mode: str
    plan: ModePlan
    setup: Setup
    step_end_s: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    step_groups: list[int] = field(default_factory=list)
    step_chain_s: list[float] = field(default_factory=list)
    """Per step: the longest least-time chain (`workload.chain_s`) among its groups."""
    step_chain_group: list[tuple[int, float, float]] = field(default_factory=list)
    """Per step: that group's version, when it was admitted and when it completed."""
    step_versions: list[dict[int, int]] = field(default_factory=list)
    """Per step: groups consumed per version (sync must be all version t)."""
    snapshots: list[tuple[float, float, float, float, float]] = field(default_factory=list)
    """At each step end: (time, instance busy s, running-seq s, trainer busy s, rollout-only s)."""
    versions: list[dict[int, int]] = field(default_factory=list)
    """At each step end: instances per version."""
    staleness: list[int] = field(default_factory=list)
    spans: Counter[int] = field(default_factory=Counter)
    segments: list[tuple[int, float, float, int]] = field(default_factory=list)
    """Timeline: (instance index, start, end, version; -1 while loading)."""
    trainer: list[list[float]] = field(default_factory=list)
    migrations: int = 0
    migrated_gb: float = 0.0
    preemptions: int = 0
    parks: int = 0
    loads: int = 0
    events: int = 0
    admission_waits: dict[str, int] = field(default_factory=dict)
    accounting: dict[str, int] = field(default_factory=dict)
