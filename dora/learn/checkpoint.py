"""Checkpoints of `dora learn`: what `Durable(t)` promises is on disk.

Layout, under `{run_dir}/checkpoints/`:

    step-000009/
        model/          Hugging Face folder: config.json, model.safetensors, tokenizer files
                        (loadable by transformers and vLLM as it is)
        optimizer.pt    learn.strategy = "ddp": the optimizer's state dict (torch.save; read back
                        with weights_only=True)
        optimizer/      learn.strategy = "fsdp": every rank's share of the optimizer state
                        (torch.distributed.checkpoint; see dora.learn.parallel)
        trainer.json    {"step": 9, "version": 10, "incarnation": 0}
    latest              the name of the newest complete checkpoint ("step-000009")
    incarnation         the incarnation of the trainer that last started in this run directory

A checkpoint is written under a temporary name (`stage_checkpoint`; every rank may write its share
of the optimizer there) and renamed (`commit_checkpoint`, rank 0); only then does `latest` move
(also by an atomic rename). So `latest` always names a complete checkpoint, and `Durable(t)` is
sent after it moved. The newest `KEEP_CHECKPOINTS` are kept.

Incarnation: 0 for a fresh run; every `--resume` takes the last started incarnation + 1, even when
the previous trainer died before its first checkpoint, so a ghost version of a lost trainer can
never be mistaken for a real one (docs/reliability.md). A trainer that serve refuses is told
serve's incarnation (`Refused`) and, if it is ahead (an earlier resume was refused, or died before
serve heard it), rewinds the marker to it (`rewind_incarnation`): the next `--resume` is the one
serve admits.

A resume needs a trainer to have started in the run directory (`incarnation`) and, once one wrote
a checkpoint, `latest`: without it the trainer would start again from step 0, under steps serve's
journal holds durable. Either missing is a `RunDirError` (a restart would meet the same folder).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from dora.errors import ConfigError, RunDirError

KEEP_CHECKPOINTS = 2


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    step: int
    version: int
    incarnation: int
    path: Path

    @property
    def model_dir(self) -> Path:
        return self.path / "model"


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def start_incarnation(run_dir: Path, *, resume: bool) -> int:
    """Record and return this trainer's incarnation (0 fresh, last + 1 on resume)."""
    root = checkpoints_dir(run_dir)
    marker = root / "incarnation"
    if not resume:
        if (root / "latest").exists():
            raise ConfigError(
                f"{run_dir} already holds checkpoints: pass --resume to continue that run, or "
                "set log.run_dir to a new directory"
            )
        incarnation = 0
    else:
        _check_resumable(run_dir)
        incarnation = int(marker.read_text()) + 1
    root.mkdir(parents=True, exist_ok=True)
    _write_atomic(marker, str(incarnation))
    return incarnation


def rewind_incarnation(run_dir: Path, *, mine: int, serve: int) -> bool:
    """Serve refused the trainer of incarnation `mine` and is at `serve`: record `serve` as the last
    started one, so the next `--resume` takes `serve + 1`, the one serve admits. Only a trainer
    ahead of serve rewinds (a refused trainer, or one that died before serve heard it, never
    reached serve, so none of its versions can be mistaken for a real one), and only while the
    marker is still its own. True if the marker moved."""
    marker = checkpoints_dir(run_dir) / "incarnation"
    if serve >= mine or not marker.exists() or int(marker.read_text()) != mine:
        return False
    _write_atomic(marker, str(serve))
    return True


def _check_resumable(run_dir: Path) -> None:
    """A resume continues a trainer that started here, from its newest checkpoint if it wrote
    one: without `latest` next to checkpoints, it would start again from step 0 instead."""
    root = checkpoints_dir(run_dir)
    if not (root / "incarnation").exists():
        raise RunDirError(
            f"--resume: no trainer started in {run_dir} ({root / 'incarnation'} is missing), so "
            "there is nothing to resume: check log.run_dir, or start without --resume"
        )
    written = sorted(p.name for p in root.glob("step-*") if p.is_dir())
    if written and not (root / "latest").exists():
        raise RunDirError(
            f"--resume: {root / 'latest'} is missing, but the run wrote checkpoints "
            f"({', '.join(written)}): resuming would start the trainer again from step 0 under "
            f"the run's durable steps. Point it at the newest complete one (echo {written[-1]} > "
            f"{root / 'latest'}) and resume again"
        )
    latest_checkpoint(run_dir)  # `latest` names a complete checkpoint


def staging_dir(run_dir: Path, *, step: int) -> Path:
    """The temporary folder that step `step`'s checkpoint is written to, before its rename."""
    return checkpoints_dir(run_dir) / f".{_name(step)}.tmp"


def stage_checkpoint(run_dir: Path, *, step: int) -> Path:
    """Create `staging_dir` empty (rank 0, before any rank writes its share there)."""
    tmp = staging_dir(run_dir, step=step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_checkpoint(
    run_dir: Path,
    tmp: Path,
    *,
    step: int,
    version: int,
    incarnation: int,
    model: torch.nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    tokenizer: object,
) -> CheckpointInfo:
    """Add the model and the trainer's state to the staged `tmp`, rename it, then move `latest`
    to it; prune old ones. The optimizer state is already in `tmp`."""
    root = checkpoints_dir(run_dir)
    name = _name(step)
    final = root / name
    model.save_pretrained(tmp / "model", state_dict=dict(state_dict))  # type: ignore[operator]
    tokenizer.save_pretrained(tmp / "model")  # type: ignore[attr-defined]
    meta = {"step": step, "version": version, "incarnation": incarnation}
    (tmp / "trainer.json").write_text(json.dumps(meta) + "\n")
    if final.exists():  # a resumed run passing a step again: the new checkpoint wins
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(root / "latest", name)
    done = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in done[:-KEEP_CHECKPOINTS]:
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return CheckpointInfo(step=step, version=version, incarnation=incarnation, path=final)


def _name(step: int) -> str:
    return f"step-{step:06d}"


def latest_checkpoint(run_dir: Path) -> CheckpointInfo | None:
    """The newest complete checkpoint, or None."""
    root = checkpoints_dir(run_dir)
    latest = root / "latest"
    if not latest.exists():
        return None
    path = root / latest.read_text().strip()
    try:
        meta = json.loads((path / "trainer.json").read_text())
    except (OSError, ValueError) as exc:
        raise RunDirError(
            f"{latest} names {path.name}, which is not a complete checkpoint ({exc}): point it "
            "at the newest complete step-* folder and resume again"
        ) from None
    return CheckpointInfo(
        step=int(meta["step"]),
        version=int(meta["version"]),
        incarnation=int(meta["incarnation"]),
        path=path,
    )


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
