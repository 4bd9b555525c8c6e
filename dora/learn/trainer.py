"""The synchronous step loop of `dora learn`: plain torch under Accelerate (over gloo on CPU), the
ranks sharing the model by DDP or FSDP2 (`learn.strategy`, `dora.learn.parallel`).

Step `t`, on every rank (they see the same messages in the same order, `dora.learn.receiver`):

1. `Assigned(step=t, group)`: a duplicate group id is dropped (counted); a zero-variance group is
   dropped when `learn.filter_zero_variance` (counted); advantages are computed over the whole group
   (`batching.prepare_group`); its sequences are split over the ranks and packed to
   `learn.micro_batch_tokens` with equal micro-batch counts per rank. The i-th group of the step
   belongs to mini-batch `i * U // B` (`U = learn.updates_per_step`). Groups of mini-batch 0 run
   forward and backward at once (streaming: gradients accumulate unnormalised, under DDP's
   `no_sync` or reduce-scattered into FSDP's shards, while later groups are still being
   generated). Groups of later mini-batches are kept, with their proximal logprobs computed at
   once (no grad) while the weights are still the step's starting weights, which is what
   decoupled PPO and TIS need.
2. `StepClosed(step=t)`: for each mini-batch `u` (after running the kept groups for `u > 0`), under
   DDP one zero-weight micro-batch outside `no_sync` all-reduces the accumulated gradients; they
   are scaled by `world / Z_u` (DDP and FSDP average over ranks; `Z_u` is the update's
   normaliser, the same on every rank because every rank prepares every group), clipped and
   applied. The loss is exactly the one of `dora.learn.loss` over the whole mini-batch, whatever
   the arrival order or the split.
3. Version `t + 1` is published (`dora.learn.publish`), then `WeightsReady(t + 1)`, then
   `StepDone(t, metrics)`; every `learn.checkpoint_every` steps a checkpoint, then `Durable(t)`.
   With `learn.weight_transport = "nccl"` rank 0 also keeps the version, and broadcasts it when
   serve's `NcclBroadcast` arrives among the next step's messages (`dora.learn.nccl`).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dora.config import DoraConfig
from dora.errors import ConfigError, ProtocolError, TrainingError
from dora.learn.batching import (
    MicroBatch,
    PreparedGroup,
    SequenceItem,
    collate,
    forward_logprobs,
    packing_refusal,
    packs,
    plan_micro_batches,
    prepare_group,
    shared_prefix,
)
from dora.learn.checkpoint import (
    CheckpointInfo,
    checkpoints_dir,
    commit_checkpoint,
    latest_checkpoint,
    rewind_incarnation,
    stage_checkpoint,
    staging_dir,
    start_incarnation,
)
from dora.learn.diagnostics import WIDTH, level_sums, step_diagnostics
from dora.learn.lora import adapter_tensors, apply_lora, enabled, resume_lora
from dora.learn.loss import LossSettings, policy_loss, token_entropy
from dora.learn.metrics import SUMS, step_metrics
from dora.learn.nccl import NcclSender, nccl_sender
from dora.learn.parallel import make_parallel, refuse_accelerate_plugins
from dora.learn.publish import inline_chunks, publish_filesystem
from dora.learn.receiver import Receiver
from dora.learn.segment_attention import use_segment_attention
from dora.protocol import (
    Assigned,
    Durable,
    Group,
    Hello,
    NcclBroadcast,
    NcclOpen,
    Refused,
    Shutdown,
    StepClosed,
    StepDone,
    WeightsReady,
)
from dora.records import TrainerStep, write_trainer_step


@dataclass
class _Update:
    """One optimizer update's share of the step on this rank."""

    norm: float = 0.0
    kept: list[list[list[SequenceItem]]] = field(default_factory=list)  # later mini-batches
    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    ratio_max: float = 0.0
    ratio_min: float = float("inf")
    levels: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # diagnostics' sums


@dataclass
class _Step:
    prepared: list[PreparedGroup] = field(default_factory=list)
    duplicates: int = 0
    wait_s: float = 0.0


class Trainer:
    """The model, its optimizer and the step loop; one per rank."""

    def __init__(self, config: DoraConfig, *, run_dir: Path, address: str, resume: bool) -> None:
        from accelerate import Accelerator, InitProcessGroupKwargs

        self.config = config
        self.cfg = config.learn
        self.run_dir = run_dir
        torch.set_num_threads(self.cfg.threads)
        torch.manual_seed(self.cfg.seed)
        timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=self.cfg.recv_timeout_s + 300))
        refuse_accelerate_plugins()
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[timeout])
        self.rank = self.accelerator.process_index
        self.world = self.accelerator.num_processes
        self.parallel = make_parallel(self.cfg.strategy, self.accelerator)
        group = dist.new_group(backend="gloo") if self.world > 1 else None
        self.receiver = Receiver(
            address=address,
            rank=self.rank,
            world=self.world,
            group=group,
            recv_timeout_s=self.cfg.recv_timeout_s,
            serve=config.serve,  # CURVE keys and the message size limit of the link
        )
        self._group = group

        self.nccl: NcclSender | None = None
        """Rank 0's side of each version's broadcast (`learn.weight_transport = "nccl"`)."""
        try:
            if self.rank == 0 and self.cfg.weight_transport == "nccl":
                self.nccl = nccl_sender(config, self.receiver.send)  # no GPU or vLLM: refused
            self._load(config, run_dir, resume=resume)
        except BaseException:
            self.receiver.close()
            raise
        self.settings = LossSettings.from_config(self.cfg)
        self._seen: set[str] = set()
        self._step = -1

    def _load(self, config: DoraConfig, run_dir: Path, *, resume: bool) -> None:
        """Incarnation, start step, `Hello`, then the model and optimizer (from the checkpoint)."""
        from transformers import AutoTokenizer

        from dora.models.prepare import prepare_model

        incarnation = start_incarnation(run_dir, resume=resume) if self.rank == 0 else 0
        self.incarnation = self._broadcast_int(incarnation)
        checkpoint: CheckpointInfo | None = latest_checkpoint(run_dir) if resume else None
        self.start_step = checkpoint.step + 1 if checkpoint else 0
        # Hello before loading the model: serve starts generating while the weights load (its
        # groups wait in the link's bounded queue).
        self.receiver.send(
            Hello(
                role="learn",
                incarnation=self.incarnation,
                step=self.start_step,
                token=config.serve.token,
            )
        )
        # every rank asks; the first builds under a file lock, the others find it ready
        init_path = prepare_model(config, log=self.rank == 0)
        model_path = checkpoint.model_dir if checkpoint else init_path
        dtype = getattr(torch, config.model.dtype)
        self.dtype = dtype
        lora = config.model.lora
        self.init_path = str(init_path)
        model: torch.nn.Module
        if enabled(lora):  # the base is always the initial model; a checkpoint holds the adapter
            model = self._pretrained(init_path)
            if checkpoint is not None:
                model = resume_lora(model, checkpoint.model_dir, lora)
            else:
                model = apply_lora(model, lora)
        else:
            model = self._pretrained(model_path)
        self.lora = enabled(lora)
        refusal = packing_refusal(model.config, config.model.max_model_len)
        if self.cfg.shared_prefix and refusal is not None:
            raise ConfigError(
                f"learn.shared_prefix packs a group into one row under a 4D attention mask, but "
                f"{refusal}; set learn.shared_prefix = false"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        self.ref: torch.nn.Module | None = None
        if self.cfg.kl_coef > 0:  # KL to the initial policy, also after a resume
            self.ref = self._pretrained(init_path).eval()
            self.ref.requires_grad_(False)
            self.ref.to(self.accelerator.device)
        self.model, self.optimizer, self.raw = self.parallel.prepare(
            model,
            lambda params: torch.optim.AdamW(
                [p for p in params if p.requires_grad],  # with LoRA: the adapters only
                lr=self.cfg.lr,
                weight_decay=self.cfg.weight_decay,
            ),
            checkpoint.path if checkpoint else None,
        )

    def _pretrained(self, path: str | Path) -> torch.nn.Module:
        """A model from `path`; with `learn.shared_prefix`, attending by segments in packed rows
        (`dora.learn.segment_attention`) where its attention is `sdpa`."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        if self.cfg.shared_prefix:
            use_segment_attention(model)
        return model

    # --- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        """Train until `learn.steps` steps are done or serve says `Shutdown`; 0 on success."""
        step = self.start_step
        durable = step - 1
        finished = step >= self.cfg.steps
        try:
            if step > 0:
                # a resumed trainer publishes its starting version again (same weights as the lost
                # run's): serve can then release the versions only the lost run had published
                self._publish(step)
            while not finished:
                metrics = self._train_step(step)
                if metrics is None:
                    break
                if (step + 1) % self.cfg.checkpoint_every == 0 or step + 1 == self.cfg.steps:
                    self._checkpoint(step)
                    durable = step
                step += 1
                finished = step >= self.cfg.steps
            if step - 1 > durable:
                self._checkpoint(step - 1)
            if finished:
                self.receiver.send(Shutdown(reason=f"trained {self.cfg.steps} steps"))
        except BaseException as exc:
            self.receiver.abort(f"trainer failed: {exc}")
            raise
        finally:
            self.receiver.close()
        # the ranks leave their process group here, not in the interpreter's teardown, where a
        # gloo rank can abort ("terminate called without an active exception")
        self.accelerator.end_training()
        return 0

    def _refused(self, refused: Refused) -> ProtocolError:
        """Serve refused this trainer's hello: the error to stop with, after rewinding the run's
        incarnation marker to serve's when this trainer is ahead of it (rank 0)."""
        rewound = self.rank == 0 and rewind_incarnation(
            self.run_dir, mine=self.incarnation, serve=refused.incarnation
        )
        then = (
            f"{checkpoints_dir(self.run_dir) / 'incarnation'} now holds serve's incarnation "
            f"{refused.incarnation}, so `--resume` again continues the run"
            if rewound
            else "check that this trainer belongs to the run serve is running"
        )
        return ProtocolError(
            f"serve refused this trainer (incarnation {self.incarnation}, step "
            f"{self.start_step}): {refused.reason}; {then}"
        )

    def _train_step(self, step: int) -> dict[str, float] | None:
        self._step = step
        started = time.perf_counter()
        state = _Step()
        n_levels = self.config.rollout.staleness + 1
        updates = [
            _Update(levels=torch.zeros(n_levels, WIDTH, dtype=torch.float64))
            for _ in range(self.cfg.updates_per_step)
        ]
        while True:
            t0 = time.perf_counter()
            message = self.receiver.next(waiting_for=f"the groups of step {step}")
            state.wait_s += time.perf_counter() - t0
            if isinstance(message, Shutdown):
                return None
            if isinstance(message, Hello):
                continue
            if isinstance(message, Refused):
                raise self._refused(message)
            if isinstance(message, NcclOpen | NcclBroadcast):
                if self.nccl is not None:  # rank 0; the others have nothing to send
                    self.nccl.handle(message)
                continue
            if message.step < step:
                continue  # a late message for a step already trained (e.g. after a resume)
            if message.step > step:
                raise ProtocolError(
                    f"got {type(message).__name__} for step {message.step} "
                    f"while step {step} is still open"
                )
            if isinstance(message, StepClosed):
                break
            assert isinstance(message, Assigned)
            if message.group.id in self._seen:
                state.duplicates += 1
                continue
            self._seen.add(message.group.id)
            self._add_group(message.group, state, updates)
        closed = time.perf_counter()
        grad_norms = [self._apply_update(u, updates[u]) for u in range(len(updates))]
        after_close_s = time.perf_counter() - closed
        publish_s = self._publish(step + 1)
        metrics = self._metrics(step, state, updates, grad_norms)
        metrics.update(
            step_time_s=time.perf_counter() - started,
            wait_s=state.wait_s,
            train_s=time.perf_counter() - started - state.wait_s - publish_s,
            after_close_s=after_close_s,
            publish_s=publish_s,
        )
        self.receiver.send(StepDone(step=step, incarnation=self.incarnation, metrics=metrics))
        if self.rank == 0:
            record = TrainerStep(step=step, time=time.time(), metrics=metrics)
            write_trainer_step(self.run_dir / "learn-metrics.jsonl", record)
        return metrics

    # --- groups, micro-batches and updates ----------------------------------------------------

    def _plan_group(
        self, group: Group, state: _Step, updates: list[_Update]
    ) -> tuple[int, PreparedGroup, list[list[list[int]]]] | None:
        """Prepare `group` into `state` and give it to its update: (the update's index, the
        prepared group, its micro-batches per rank), or None when it has nothing to train."""
        prepared = prepare_group(
            group,
            loss=self.cfg.loss,
            aggregation=self.cfg.aggregation,
            max_tokens=self.config.rollout.max_tokens,
            filter_zero_variance=self.cfg.filter_zero_variance,
        )
        index = len(state.prepared)
        state.prepared.append(prepared)
        if not prepared.items:
            return None
        u = min(index * len(updates) // self.config.rollout.batch_size, len(updates) - 1)
        updates[u].norm += prepared.norm
        plan = plan_micro_batches(
            [item.length for item in prepared.items],
            world=self.world,
            budget=self.cfg.micro_batch_tokens,
            shared=shared_prefix(prepared.items) if self.cfg.shared_prefix else None,
            row_cap=self.cfg.shared_prefix_tokens,
        )
        return u, prepared, plan

    def _add_group(self, group: Group, state: _Step, updates: list[_Update]) -> None:
        placed = self._plan_group(group, state, updates)
        if placed is None:
            return
        u, prepared, plan = placed
        update = updates[u]
        mine = [[prepared.items[i] for i in mb] for mb in plan[self.rank]]
        if u == 0:
            for items in mine:
                self._backward(items, update, sync=False)
        else:
            update.kept.append([self._with_proximal(items) for items in mine])

    @torch.no_grad()
    def _with_proximal(self, items: list[SequenceItem]) -> list[SequenceItem]:
        from dataclasses import replace

        if self.settings.off_policy == "none":
            return items
        # an empty (padding) micro-batch still runs: under FSDP every forward is a collective
        mb = self._collate(items)
        logprobs = self._logprobs(self.raw, mb)[0].cpu()
        self.parallel.after_forward_only(self.raw)
        return [
            replace(item, proximal=logprobs[row, : item.length - 1].numpy().copy())
            for row, item in enumerate(items)
        ]

    def _logprobs(
        self, model: torch.nn.Module, mb: MicroBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's logprobs of its targets, at the sampling temperature (docs/engine.md),
        and the logits of what the model ran (a packed row, or the padded sequences)."""
        return forward_logprobs(
            model, mb, temperature=self.config.rollout.temperature, dtype=self.dtype
        )

    def _collate(self, items: list[SequenceItem]) -> MicroBatch:
        cap = self.cfg.shared_prefix_tokens if self.cfg.shared_prefix else None
        mb = collate(items, pad_id=self.pad_id, packed=packs(items, cap))
        return mb.to(self.accelerator.device)

    def _backward(self, items: list[SequenceItem], update: _Update, *, sync: bool) -> None:
        mb = self._collate(items)
        context: AbstractContextManager[object] = nullcontext()
        if not sync:
            context = self.parallel.accumulate(self.model)
        with context:
            logprobs, logits = self._logprobs(self.model, mb)
            proximal = mb.proximal if items and items[0].proximal is not None else None
            if proximal is None and self.settings.off_policy != "none":
                proximal = logprobs.detach()  # the weights have not moved yet in this step
            ref = None
            if self.ref is not None:
                with torch.no_grad():
                    ref = self._logprobs(self.ref, mb)[0]
            terms = policy_loss(
                logprobs=logprobs,
                behaviour_logprobs=mb.behaviour,
                proximal_logprobs=proximal,
                ref_logprobs=ref,
                advantages=mb.advantages,
                weights=mb.weights,
                settings=self.settings,
            )
            loss = float(terms.loss_sum.detach())
            if not math.isfinite(loss):
                groups = sorted({item.group_id for item in items})
                raise TrainingError(
                    f"step {self._step}: the loss of a micro-batch of group(s) {groups} is "
                    f"{loss}: {_non_finite_source(mb, logprobs)}; no version is published"
                )
            self.accelerator.backward(terms.loss_sum)
        active = (mb.weights > 0).float()
        update.sums["loss"] += loss
        update.sums["entropy_sum"] += float((mb.unpack(token_entropy(logits)) * active).sum())
        for key in SUMS[1:-1]:
            update.sums[key] += terms.stats[key]
        update.levels += level_sums(
            rho=terms.rho,
            log_ratio=terms.log_ratio,
            capped=terms.capped,
            active=mb.weights > 0,
            levels=torch.tensor([self._step - item.version for item in items] or [0]),
            n_levels=update.levels.shape[0],
        )
        if terms.stats["tokens"]:
            update.ratio_max = max(update.ratio_max, terms.stats["ratio_max"])
            update.ratio_min = min(update.ratio_min, terms.stats["ratio_min"])

    def _apply_update(self, u: int, update: _Update) -> float:
        for group_batches in update.kept:
            for items in group_batches:
                self._backward(items, update, sync=False)
        if self.parallel.sync_micro_batch:  # all-reduce what no_sync accumulated, on every rank
            self._backward([], update, sync=True)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if update.norm == 0:  # every group filtered or masked: nothing to learn from
            self.optimizer.zero_grad(set_to_none=True)
            return 0.0
        scale = (self.world if self.world > 1 else 1) / update.norm
        for p in params:
            assert p.grad is not None
            p.grad.mul_(scale)
        norm = self.parallel.clip_grad_norm(self.model, self.cfg.grad_clip)
        if not math.isfinite(norm):
            raise TrainingError(
                f"step {self._step}: the gradient norm of update {u} is {norm} although "
                "every loss was finite (the gradients overflowed: try a lower learn.lr or "
                "learn.grad_clip); no version is published"
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # --- publishing, checkpoints, metrics ------------------------------------------------------

    def _publish(self, version: int) -> float:
        started = time.perf_counter()
        state = self.parallel.full_state_dict(self.model)
        if self.rank == 0:
            if self.lora:  # a version is its adapter (dora.learn.lora)
                state = adapter_tensors(self.raw, state)
            if self.cfg.weight_transport == "filesystem":
                path = publish_filesystem(
                    self.raw,
                    state,
                    run_dir=self.run_dir,
                    version=version,
                    keep_from=version - self.config.rollout.staleness - 2,
                    adapter_of=self.init_path if self.lora else None,
                )
                ready = WeightsReady(version=version, incarnation=self.incarnation, path=str(path))
            else:
                chunks = inline_chunks(state, version=version)
                for chunk in chunks:
                    self.receiver.send(chunk)
                ready = WeightsReady(
                    version=version, incarnation=self.incarnation, num_chunks=len(chunks)
                )
            self.receiver.send(ready)
            if self.nccl is not None:  # serve asks for its broadcast once it is ready
                self.nccl.keep(version, state)
        return time.perf_counter() - started

    def _checkpoint(self, step: int) -> None:
        state = self.parallel.full_state_dict(self.model)
        tmp = staging_dir(self.run_dir, step=step)  # the same folder on every rank
        if self.rank == 0:
            stage_checkpoint(self.run_dir, step=step)
        self.accelerator.wait_for_everyone()  # it exists (empty) before any rank writes there
        self.parallel.save_optimizer(self.optimizer, self.model, tmp)
        if self.rank == 0:
            commit_checkpoint(
                self.run_dir,
                tmp,
                step=step,
                version=step + 1,
                incarnation=self.incarnation,
                model=self.raw,
                state_dict=state,
                tokenizer=self.tokenizer,
            )
            self.receiver.send(Durable(step=step, incarnation=self.incarnation))
        self.accelerator.wait_for_everyone()

    def _metrics(
        self, step: int, state: _Step, updates: list[_Update], grad_norms: list[float]
    ) -> dict[str, float]:
        sums = torch.tensor([[u.sums[k] for k in SUMS] for u in updates], dtype=torch.float64)
        extremes = torch.tensor(
            [max(u.ratio_max for u in updates), -min(u.ratio_min for u in updates)],
            dtype=torch.float64,
        )
        levels = torch.stack([u.levels for u in updates]).sum(0)
        if self.world > 1:
            dist.all_reduce(sums, group=self._group)
            dist.all_reduce(levels, group=self._group)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self._group)
        trained = [p.group for p in state.prepared if not p.filtered]
        return step_diagnostics(step, trained, levels.numpy()) | step_metrics(
            step=step,
            prepared=state.prepared,
            duplicates=state.duplicates,
            sums=sums.tolist(),
            norms=[u.norm for u in updates],
            ratio_max=float(extremes[0]),
            ratio_min=-float(extremes[1]),
            grad_norms=grad_norms,
            ranks=self.world,
        )

    def _broadcast_int(self, value: int) -> int:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=0, group=self._group)
        return int(t.item())


def _non_finite_source(mb: MicroBatch, logprobs: torch.Tensor) -> str:
    """Which input of a non-finite loss is not finite, as a hint where it came from."""
    loss_tokens = mb.weights > 0
    if not bool(torch.isfinite(mb.advantages).all()):
        return "its advantages are not finite (a reward was NaN or infinite)"
    if not bool(torch.isfinite(mb.behaviour[loss_tokens]).all()):
        return "its behaviour logprobs are not finite (the instance that sampled them)"
    if not bool(torch.isfinite(logprobs.detach()[loss_tokens]).all()):
        return "the policy's own logprobs are not finite (its weights)"
    return "every input is finite: the loss itself overflowed"
