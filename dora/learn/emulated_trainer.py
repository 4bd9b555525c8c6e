"""The emulated trainer: the real `dora learn` step loop, with modelled training time.

Everything but the large model's forward and backward pass is the real trainer
(`dora.learn.trainer.Trainer`): the link and its receiver, duplicate dropping, filtering,
group advantages (`prepare_group`), packing into micro-batches (`plan_micro_batches`), the step's
close, version publication (the small model's weights, over the configured transport),
checkpoints, `StepDone` and `Durable`. Where the real trainer runs a group's micro-batches
forward and backward, this one spends `Setup.train_s(tokens, gpus)` modelled seconds (prompt and
response tokens, the simulator's calibrated cost per token), and at the step's close
`train_step_overhead_s`; a modelled second lasts `emulate.time_scale` real seconds. With
`emulate.stream_training` the time is spent as groups arrive (the trainer is busy until
`max(busy, arrival) + work`), as the simulator's disaggregated trainer does; off (colocated sync:
the accelerators are generating until the step is full), all of it at the close. No optimizer
step is taken: there are no gradients, so every version publishes the same small weights.

`gpus` is `emulate.train_gpus`, or the preset's trainer pool (`gpus - rollout_gpus`). With
`emulate.colocated` (the trainer shares the instances' accelerators, as colocated sync and
partial do in the simulator) the instances are paused over their control route while the trainer
spends its time at the step's close, and resumed after.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import msgspec
import numpy as np

from dora.config import DoraConfig
from dora.emulated.setup import emulated_setup, urls_path
from dora.learn.trainer import Trainer, _Step, _Update
from dora.protocol import Group
from dora.records import Consumed

__all__ = ["EmulatedTrainer"]


class EmulatedTrainer(Trainer):
    """`Trainer` with modelled compute (see the module docstring)."""

    def _load(self, config: DoraConfig, run_dir: Path, *, resume: bool) -> None:
        super()._load(config, run_dir, resume=resume)
        e = self.config.emulate
        self.setup = emulated_setup(self.config)
        self.gpus = e.train_gpus or self.setup.train_gpus
        self.scale = e.time_scale
        self.stream = e.stream_training
        self.colocated = e.colocated
        self.busy_until = 0.0
        self.pending_s = 0.0
        self.sequence_tokens = 0
        self.modelled_train_s = 0.0
        self._step = 0
        self._consumed = (run_dir / "consumed.jsonl").open("ab", buffering=0)

    def run(self) -> int:
        try:
            return super().run()
        finally:
            self._consumed.close()

    def _train_step(self, step: int) -> dict[str, float] | None:
        self._step = step
        return super()._train_step(step)

    def _record(self, group: Group) -> None:
        """One line per consumed group in `consumed.jsonl`: the versions of its sampled tokens
        (what `dora.emulated.checks` proves C1 and C3 on)."""
        versions: set[int] = set()
        for sample in group.samples:
            v = np.frombuffer(sample.versions, dtype=np.int32)
            versions.update(np.unique(v[v >= 0]).tolist())
        if self.rank == 0:
            record = Consumed(
                step=self._step,
                group=group.id,
                version=group.version,
                incarnation=group.incarnation,
                samples=len(group.samples),
                masked=sum(s.masked for s in group.samples),
                token_versions=sorted(versions),
            )
            self._consumed.write(msgspec.json.encode(record) + b"\n")

    def _pause_instances(self, paused: bool) -> None:
        """Colocated: the trainer holds the accelerators, so the instances stop decoding (their
        `/control/pause` route) until it is done."""
        if self.rank != 0:
            return
        path = urls_path(self.run_dir)
        urls = path.read_text().split() if path.is_file() else []
        route = "pause" if paused else "resume"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only
        for url in urls:
            request = urllib.request.Request(f"{url}/control/{route}", data=b"{}", method="POST")
            request.add_header("Content-Type", "application/json")
            with opener.open(request, timeout=30.0) as response:
                response.read()

    def _spend(self, modelled_s: float) -> None:
        """Be busy for `modelled_s` more modelled seconds, from now or from the last work's end."""
        now = time.monotonic()
        self.busy_until = max(self.busy_until, now) + modelled_s * self.scale
        self.modelled_train_s += modelled_s
        if self.busy_until > now:
            time.sleep(self.busy_until - now)

    def _add_group(self, group: Group, state: _Step, updates: list[_Update]) -> None:
        self._record(group)
        placed = self._plan_group(group, state, updates)
        if placed is None:
            return
        u, prepared, _ = placed
        update = updates[u]
        tokens = sum(item.length for item in prepared.items)
        update.sums["tokens"] += float(sum(float(item.loss_mask.sum()) for item in prepared.items))
        self.sequence_tokens += tokens
        work = self.setup.train_s(float(tokens), self.gpus)
        if self.stream:
            self._spend(work)
        else:
            self.pending_s += work

    def _apply_update(self, u: int, update: _Update) -> float:
        if u == 0:
            if self.colocated:
                self._pause_instances(True)
            self._spend(self.pending_s + self.setup.train_step_overhead_s)
            self.pending_s = 0.0
            if self.colocated:
                self._pause_instances(False)
        self.optimizer.zero_grad(set_to_none=True)
        return 0.0

    def _metrics(
        self, step: int, state: _Step, updates: list[_Update], grad_norms: list[float]
    ) -> dict[str, float]:
        metrics = super()._metrics(step, state, updates, grad_norms)
        metrics["sequence_tokens"] = float(self.sequence_tokens)
        metrics["modelled_train_s"] = self.modelled_train_s
        self.sequence_tokens = 0
        self.modelled_train_s = 0.0
        return metrics
