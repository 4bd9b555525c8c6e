"""Where serve, its instances and the trainer run on one CPU machine, and with how many threads.

Cores are not GPUs: on one machine the rollout and the trainer can share every core and let the
operating system balance them. So every mode gets every core:

- `colocated` (sync): nothing is pinned; rollout and training take turns, so each phase may use
  every core: instances `cores // instances` threads each (at least 1), the trainer `cores`.
- `shared` (one_step_off, partial, dora: the default): nothing is pinned either, but rollout and
  training run at the same time, so the threads are shared out rather than each process taking
  every core: instances `cores // (instances + 1)` threads each (at least 1), the trainer the
  cores the instances leave over (at least 1). On the project's 2-core machine with 4 instances
  that is 1 and 1, the setting measured there (docs/benchmarks.md; other thread counts with this
  placement were not measured, and larger machines follow the same rule unmeasured).
- `split` (an option, `dora bench modes --placement split`): serve and its instances pinned
  (`taskset -c`, inherited by children) to the first `cores - trainer_cores` cores, the trainer to
  the rest, as separate GPU pools would be. On 2 cores it leaves the rollout on one core while the
  trainer's waits, so it is reported, never the default.

`dora run` applies the same rule (it pins nothing): `serve.threads_per_instance` and
`learn.threads`, where the config leaves them unset, get the threads above for the run's mode, and
every process runs with `OMP_WAIT_POLICY=PASSIVE` unless the environment sets it (a trainer with two
OpenMP threads on a shared core otherwise spins at every barrier while its peer is descheduled).
The functions are pure; `dora bench modes` and `dora run` apply them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["KINDS", "CorePlan", "given_keys", "place", "run_threads", "threads_for"]

Kind = Literal["colocated", "shared", "split"]
KINDS: tuple[str, ...] = ("shared", "split")
"""The placements one may ask for the asynchronous modes (sync is always colocated, except the
benchmark's `sync_split`)."""


@dataclass(frozen=True, kw_only=True)
class CorePlan:
    """Where one run's processes go and with how many threads."""

    name: str
    mode: str
    kind: Kind
    serve_cores: list[int]
    trainer_cores: list[int]
    instance_threads: int
    trainer_threads: int

    @property
    def pinned(self) -> bool:
        return self.kind == "split"

    def describe(self) -> str:
        """What the benchmark prints in its `cores` column: the kind, the cores, the threads."""
        if self.kind == "split":
            return f"split: serve {_cores(self.serve_cores)} | learn {_cores(self.trainer_cores)}"
        return (
            f"{self.kind} {_cores(self.serve_cores)}, inst {self.instance_threads} thr, "
            f"trainer {self.trainer_threads} thr"
        )


def _cores(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def threads_for(kind: Kind, cores: int, instances: int) -> tuple[int, int]:
    """(threads per instance, trainer threads) of an unpinned placement on `cores` cores."""
    if kind == "colocated":
        return max(1, cores // max(1, instances)), cores
    instance_threads = max(1, cores // (instances + 1))
    return instance_threads, max(1, cores - instances * instance_threads)


def place(
    name: str,
    mode: str,
    cores: list[int],
    *,
    instances: int,
    kind: Kind,
    trainer_cores: int = 1,
    trainer_threads: int | None = None,
) -> CorePlan:
    """The placement of one run on `cores`: `kind` as asked, except that an unpinned sync run is
    always colocated (its phases take turns)."""
    if kind == "split":
        if len(cores) < 2:
            raise ValueError(f"a split needs at least 2 cores, this process may use {cores}")
        if not 1 <= trainer_cores < len(cores):
            raise ValueError(f"--trainer-cores must be in 1..{len(cores) - 1}, got {trainer_cores}")
        serve, learn = cores[: len(cores) - trainer_cores], cores[len(cores) - trainer_cores :]
        return CorePlan(
            name=name,
            mode=mode,
            kind="split",
            serve_cores=serve,
            trainer_cores=learn,
            instance_threads=max(1, len(serve) // max(1, instances)),
            trainer_threads=trainer_threads or len(learn),
        )
    if mode == "sync":
        kind = "colocated"
    inst, trainer = threads_for(kind, len(cores), instances)
    return CorePlan(
        name=name,
        mode=mode,
        kind=kind,
        serve_cores=list(cores),
        trainer_cores=list(cores),
        instance_threads=inst,
        trainer_threads=trainer_threads or trainer,
    )


def run_threads(mode: str, cores: int, *, instances: int, given: set[str]) -> list[str]:
    """`dora run`'s thread overrides on a machine with `cores` cores: the rule above for `mode`
    (sync colocated, the others shared), for each of `serve.threads_per_instance` and
    `learn.threads` that the user did not set (`given`: the dotted keys the config file or the
    command line set)."""
    inst, trainer = threads_for("colocated" if mode == "sync" else "shared", cores, instances)
    wanted = {"serve.threads_per_instance": inst, "learn.threads": trainer}
    return [f"{key}={value}" for key, value in wanted.items() if key not in given]


def given_keys(raw: dict[str, object], overrides: list[str]) -> set[str]:
    """The dotted `section.key` names a raw config table and `key=value` overrides set."""
    keys = {
        f"{section}.{key}"
        for section, table in raw.items()
        if isinstance(table, dict)
        for key in table
    }
    return keys | {item.partition("=")[0].strip() for item in overrides}
