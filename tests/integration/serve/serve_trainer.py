"""A small trainer for the serve tests: it speaks the real protocol over the real ZMQ link.

It receives groups, checks the stream's shape (every group once, `StepClosed` after `B`), "trains"
by sleeping, and publishes version `t + 1` as inline `WeightChunk`s of perturbed weights (so the
engines really load new weights and logprobs change), then acknowledges with `StepDone(t)`.
It runs on a thread: the trainer side of the link is blocking by design.

`restart_config` and `check_resumed` are shared by the restart tests: a trainer that dies after
step 4 (steps 1 and 3 durable) and a second incarnation that resumes at step 4.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from dora.config import DoraConfig, ServeConfig, load_config
from dora.errors import ServerTimeout
from dora.link import LearnLink
from dora.protocol import (
    Assigned,
    Durable,
    Group,
    Hello,
    Shutdown,
    StepClosed,
    StepDone,
    WeightChunk,
    WeightsReady,
)


class ToyTrainer:
    def __init__(
        self,
        address: str,
        *,
        model_dir: Path,
        steps: int,
        batch_size: int,
        step_time_s: float = 0.05,
        noise: float = 0.01,
        timeout_s: float = 60.0,
        on_trained: Callable[[int], None] | None = None,
        incarnation: int = 0,
        start_step: int = 0,
        durable_every: int | None = None,
        crash_after: int | None = None,
        link_config: ServeConfig | None = None,
    ) -> None:
        self.address = address
        self.link_config = link_config
        """The trainer's `serve.*` (CURVE keys, token), as `dora learn` reads it; None: plain."""
        self.steps = steps
        self.batch_size = batch_size
        self.step_time_s = step_time_s
        self.noise = noise
        self.timeout_s = timeout_s
        self.on_trained = on_trained
        self.incarnation = incarnation
        self.start_step = start_step
        self.durable_every = durable_every
        self.crash_after = crash_after
        self.base = load_file(str(next(model_dir.glob("*.safetensors"))))
        self.received: list[tuple[int, Group]] = []
        self.by_step: dict[int, list[Group]] = defaultdict(list)
        self.closed: list[int] = []
        self.trained: list[int] = []
        self.shutdown = False
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="toy-trainer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the trainer's loop now (it stops waiting for serve) and join it; its error, if it
        had one before, is dropped."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError("the toy trainer did not stop")

    def join(self, timeout_s: float = 30.0) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError("the toy trainer did not stop")
        if self.error is not None:
            raise self.error

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(version + 1000 * self.incarnation)
        return {
            name: t + self.noise * torch.randn(t.shape, generator=gen, dtype=t.dtype)
            for name, t in self.base.items()
        }

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            self.error = exc

    def _run(self) -> None:
        serve = self.link_config or ServeConfig()
        link = LearnLink.from_config(self.address, serve)
        try:
            link.send(
                Hello(
                    role="learn",
                    incarnation=self.incarnation,
                    step=self.start_step,
                    token=serve.token,
                )
            )
            step = self.start_step
            if step > 0:  # like dora learn: a resumed trainer publishes its starting version again
                self._publish(link, step)
            while not self.shutdown:
                msg = self._recv(link, f"groups of step {step}")
                if msg is None:
                    return  # stopped
                match msg:
                    case Assigned(step=s, group=g):
                        assert s >= step, f"group {g.id} assigned to step {s}, already trained"
                        self.received.append((s, g))
                        self.by_step[s].append(g)
                    case StepClosed(step=s, num_groups=n):
                        assert n == self.batch_size == len(self.by_step[s]), (s, n)
                        assert len({g.id for g in self.by_step[s]}) == n, "a group twice"
                        self.closed.append(s)
                    case Shutdown():
                        self.shutdown = True
                    case Hello():
                        pass
                while step in self.closed and step < self.steps:
                    time.sleep(self.step_time_s)
                    self._publish(link, step + 1)
                    link.send(
                        StepDone(step=step, incarnation=self.incarnation, metrics={"groups": 1.0})
                    )
                    every = self.durable_every
                    if (every and (step + 1) % every == 0) or step + 1 == self.steps:
                        # like dora learn: a checkpoint every `durable_every` steps and at the end
                        link.send(Durable(step=step, incarnation=self.incarnation))
                    self.trained.append(step)
                    if self.on_trained is not None:
                        self.on_trained(step)
                    if step == self.crash_after:
                        return  # a crash: no Shutdown, the socket just goes away
                    step += 1
        finally:
            link.close()

    def _recv(self, link: LearnLink, waiting_for: str) -> object | None:
        """The next message, within `timeout_s`; None once `stop()` was called."""
        deadline = time.monotonic() + self.timeout_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServerTimeout(
                    f"the toy trainer waited {self.timeout_s:g} s for {waiting_for}"
                )
            with contextlib.suppress(ServerTimeout):
                return link.recv(timeout_s=min(0.25, left), waiting_for=waiting_for)
        return None

    def _publish(self, link: LearnLink, version: int) -> None:
        weights = self.weights(version)
        names = list(weights)
        half = len(names) // 2
        for index, part in enumerate((names[:half], names[half:])):
            link.send(
                WeightChunk(
                    version=version,
                    index=index,
                    names=part,
                    dtypes=[str(weights[n].dtype).removeprefix("torch.") for n in part],
                    shapes=[list(weights[n].shape) for n in part],
                    data=[
                        weights[n].contiguous().view(torch.uint8).numpy().tobytes() for n in part
                    ],
                )
            )
        link.send(WeightsReady(version=version, incarnation=self.incarnation, num_chunks=2))


def restart_config(
    run_dir: Path, model_dir: Path, *, steps: int, batch_size: int, k: int
) -> DoraConfig:
    """The serve config of the restart tests: two in-process instances, short single-turn groups."""
    return load_config(
        None,
        [
            f"model.path={json.dumps(str(model_dir))}",
            "model.max_model_len=256",
            "serve.instances=2",
            "serve.max_running=8",
            "serve.request_timeout_s=60",
            f"rollout.staleness={k}",
            "rollout.group_size=2",
            f"rollout.batch_size={batch_size}",
            "rollout.max_tokens=32",
            "rollout.max_turns=1",
            f"learn.steps={steps}",
            f"log.run_dir={json.dumps(str(run_dir))}",
            "log.metrics_every_s=0.25",
            "log.progress=false",
        ],
    )


def dying_trainer(address: str, model_dir: Path, *, steps: int, batch_size: int) -> ToyTrainer:
    """Trains steps 0..4, makes steps 1 and 3 durable, dies without a word."""
    return ToyTrainer(
        address,
        model_dir=model_dir,
        steps=steps,
        batch_size=batch_size,
        durable_every=2,
        crash_after=4,
    )


def resumed_trainer(address: str, model_dir: Path, *, steps: int, batch_size: int) -> ToyTrainer:
    """The next incarnation, resumed from the checkpoint of step 3."""
    return ToyTrainer(
        address,
        model_dir=model_dir,
        steps=steps,
        batch_size=batch_size,
        incarnation=1,
        start_step=4,
    )


def check_resumed(first: ToyTrainer, second: ToyTrainer, *, steps: int, k: int) -> None:
    """The resumed trainer (from the checkpoint of step 3) trained steps 4.. with exactly B groups
    each, every group once, none of a durable step, C1 and C3."""
    assert second.trained == list(range(4, steps)) and second.shutdown
    assert sorted(second.by_step) == list(range(4, steps))
    assert all(len(gs) == second.batch_size for gs in second.by_step.values())
    ids = [g.id for _, g in second.received]
    assert len(ids) == len(set(ids)), "every group once in the new run"
    durable = {g.id for s, gs in first.by_step.items() if s <= 3 for g in gs}
    assert not durable & set(ids), "durable steps are not trained again"
    for step, group in second.received:
        assert group.incarnation == 1
        assert 0 <= step - group.version <= k
        for s in group.samples:
            assert (s.token_versions()[s.mask() == 1] == group.version).all(), "C1"
