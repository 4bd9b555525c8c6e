"""`dora bench trl CONFIG`: TRL's GRPOTrainer against `dora run` on the same workload.

What a user would otherwise pick on one machine: TRL's `GRPOTrainer` (the optional extra `pip
install torch==2.13.0 -e '.[trl]'` in dora's checkout), on the same initial model (the config's,
built and warmed up once by `prepare_model`), the same tasks and prompts (the environment's `reset`:
messages rendered by the model's chat template, or plain text as `tokenizer(prompt)`, which TRL and
dora both tokenize with the special tokens), the same environment factory for the rewards (its
shared resources made once), prompts per step (`rollout.batch_size`), group size, max
tokens, temperature, top-p, learning rate, weight decay, gradient clip, updates per step, and loss
settings: GRPO advantages scaled by the group's std, token-level aggregation over the step (TRL's
`dapo` loss), the clip range `[1 - learn.clip_low, 1 + learn.clip_high]`, `kl_coef` as TRL's `beta`.
TRL generates with `model.generate` in the trainer's process, synchronously (on-policy), and has no
counterpart of dora's off-policy correction, which an on-policy run does not need.

Both runs are evaluated the same way, on the config's held-out tasks (greedily, or at
`data.eval_temperature` with `data.eval_samples` episodes per task, each episode seeded alike),
scored by the environment: dora by its own evaluation (`eval` records), TRL by a callback at the
same versions (the initial model, every `data.eval_every` steps, the last step) that decodes with
dora's engine in process (its time is left out of TRL's clock). Wall-clock seconds are counted from
the start of training: for TRL from `train()`, for dora from the start of serve's rollout (its
records' clock, which starts once its instances are up); the version w point is where step w-1
trained (dora: its `trained` record). Printed: steps/s and accuracy against seconds for each, and
`dora/trl steps/s ratio: X.XX`; written: `OUT/bench-trl.json` and the curves drawn in
`OUT/bench-trl.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dora.bench import dora_run, summary
from dora.config import DoraConfig, load_config
from dora.errors import ConfigError
from dora.records import Eval, Trained, read_records
from dora.report import eval_label, plot_accuracy_vs_time

if TYPE_CHECKING:
    from dora.env import Env

__all__ = ["dora_curve", "grpo_args", "main", "summary_lines", "trl_prompt_ids"]


def grpo_args(config: DoraConfig, out_dir: Path) -> dict[str, object]:
    """GRPOConfig's arguments for the settings of `config` (pure)."""
    learn, rollout = config.learn, config.rollout
    return dict(
        output_dir=str(out_dir),
        learning_rate=learn.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=learn.weight_decay,
        max_grad_norm=learn.grad_clip,
        adam_beta1=0.9,  # torch.optim.AdamW's defaults, which dora's trainer uses
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        per_device_train_batch_size=rollout.batch_size * rollout.group_size,
        gradient_accumulation_steps=1,
        num_generations=rollout.group_size,
        num_iterations=learn.updates_per_step,
        max_completion_length=rollout.max_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=0,
        beta=learn.kl_coef,
        epsilon=learn.clip_low,
        epsilon_high=learn.clip_high,
        loss_type="dapo" if learn.aggregation == "token" else "grpo",
        scale_rewards="group" if learn.loss == "grpo" else "none",
        max_steps=learn.steps,
        seed=learn.seed,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_dropout=True,
        dataloader_num_workers=0,
    )


def _rows(
    config: DoraConfig, env_factory: Callable[[], Env], *, held_out: bool
) -> tuple[list[dict[str, Any]], list[Any]]:
    """The tasks as TRL rows: the environment's prompt (messages or text), and the task for the
    reward."""
    from dora.data import config_tasks

    tasks = config_tasks(config.data, env_factory, held_out=held_out)
    env = env_factory()
    return [{"prompt": env.reset(t), "task_index": i} for i, t in enumerate(tasks)], tasks


def _score(env_factory: Callable[[], Env], tasks: list[Any], index: int, text: str) -> float:
    """The environment's score of `text` for task `index`, on a fresh episode object from the
    run's one factory: what the environment shares between episodes (`Env.setup`: a dataset, a
    scorer pool) is made once, as in dora's serve."""
    from dora.env import call_maybe_async

    env: Any = env_factory()  # a SingleTurnEnv: score(text)
    reward = call_maybe_async(env.score, text, tasks[index])
    if asyncio.iscoroutine(reward):
        reward = asyncio.run(reward)
    return float(reward)  # type: ignore[arg-type]


def _held_out_accuracy(
    model: Any,
    tok: Any,
    config: DoraConfig,
    env_factory: Callable[[], Env],
    rows: list,
    tasks: list,
) -> float:
    """Held-out accuracy of `model` as it is now, decoded by dora's engine as dora's own
    evaluation decodes: `data.eval_samples` episodes per task at `data.eval_temperature`, each
    seeded as there (`held_out_seed`; greedy at temperature 0)."""
    import torch

    from dora.engine.batcher import Batcher, BatcherConfig
    from dora.protocol import SamplingParams
    from dora.serve.evaluate import held_out_seed

    was_training = model.training
    model.eval()
    batcher = Batcher(
        model,
        eos_token_ids=[tok.eos_token_id],
        decode=tok.decode,
        config=BatcherConfig(max_running=64, max_model_len=config.model.max_model_len),
    )
    k, temperature = config.data.eval_samples, config.data.eval_temperature
    seqs = []
    for i, row in enumerate(rows):
        ids = trl_prompt_ids(tok, row["prompt"])
        for rep in range(k):
            params = SamplingParams(
                max_tokens=config.rollout.max_tokens,
                temperature=temperature,
                seed=held_out_seed(i, rep, k) if temperature > 0 else None,
            )
            seq = batcher.new_sequence(f"e{row['task_index']}-{rep}", ids, params)
            batcher.add(seq)
            seqs.append((row["task_index"], seq))
    with torch.inference_mode():
        while batcher.has_work():
            batcher.step()
    model.train(was_training)
    eos = {tok.eos_token_id}
    correct = 0
    for index, seq in seqs:
        text = tok.decode([t for t in seq.token_ids if t not in eos])
        correct += _score(env_factory, tasks, index, text) >= config.data.eval_success_at
    return correct / len(seqs)


def trl_prompt_ids(tok: Any, prompt: list[dict[str, Any]] | str) -> list[int]:
    """The ids TRL's GRPOTrainer makes of a prompt: chat messages rendered by the chat template
    (whose text carries its own special tokens), plain text as `tok(prompt)`, special tokens
    included, which is how dora tokenizes a plain-text prompt by default."""
    if isinstance(prompt, str):
        return list(tok(prompt)["input_ids"])
    text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def run_trl(config: DoraConfig, out: Path) -> dict[str, object]:
    """Train with TRL's GRPOTrainer; the accuracy curve against training seconds."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        raise ConfigError(
            "dora bench trl needs TRL: pip install torch==2.13.0 -e '.[trl]' in dora's checkout "
            "(or pip install 'trl>=1.16')"
        ) from None

    from dora.env import load_env
    from dora.models.prepare import prepare_model

    if not config.env.prompt_special_tokens:
        raise ConfigError(
            "dora bench trl: env.prompt_special_tokens = false, but TRL tokenizes plain-text "
            "prompts with the tokenizer's special tokens; the two runs would see different prompts"
        )

    model_dir = prepare_model(config)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    env_factory = load_env(config.env.cls, **config.env.kwargs)
    train_rows, train_tasks = _rows(config, env_factory, held_out=False)
    eval_rows, eval_tasks = _rows(config, env_factory, held_out=True)

    def reward(completions: list[Any], task_index: list[int], **_: object) -> list[float | None]:
        texts = [c[0]["content"] if isinstance(c, list) else str(c) for c in completions]
        return [
            _score(env_factory, train_tasks, i, text)
            for i, text in zip(task_index, texts, strict=True)
        ]

    curve: list[dict[str, float]] = []
    clock = {"start": 0.0, "excluded": 0.0}
    every = config.data.eval_every or config.learn.steps

    def evaluate(step: int) -> None:
        started = time.monotonic()
        seconds = started - clock["start"] - clock["excluded"]
        acc = _held_out_accuracy(model, tok, config, env_factory, eval_rows, eval_tasks)
        clock["excluded"] += time.monotonic() - started
        curve.append({"version": step, "seconds": round(seconds, 2), "accuracy": acc})
        print(f"trl: v{step} accuracy {acc:.3f} at {seconds:.0f} s", flush=True)

    class Eval(TrainerCallback):
        def on_train_begin(self, *args: object, **kwargs: object) -> None:
            clock["start"] = time.monotonic()
            evaluate(0)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: object) -> None:
            if state.global_step % every == 0 or state.global_step == config.learn.steps:
                evaluate(state.global_step)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=GRPOConfig(**grpo_args(config, out / "trl")),  # type: ignore[arg-type, unused-ignore]
        train_dataset=Dataset.from_list(train_rows),
        processing_class=tok,
        callbacks=[Eval()],
    )
    trainer.train()
    seconds = time.monotonic() - clock["start"] - clock["excluded"]
    return {"steps": config.learn.steps, "seconds": seconds, "curve": curve}


def dora_curve(run_dir: Path, steps: int) -> dict[str, object]:
    """`dora run`'s accuracy curve from its records: version w at the time step w-1 trained."""
    records = read_records(run_dir / "rollout.jsonl", kinds={"trained", "eval"})
    trained = {r.step: r.time_s for r in records if isinstance(r, Trained)}
    curve = [
        {
            "version": r.version,
            "seconds": trained.get(r.version - 1, 0.0),
            "accuracy": r.accuracy,
        }
        for r in records
        if isinstance(r, Eval)
    ]
    return {"steps": steps, "seconds": trained.get(steps - 1, 0.0), "curve": curve}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dora bench trl", description=summary(__doc__))
    p.add_argument("config", help="config file, e.g. examples/math/config.toml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.add_argument("--steps", type=int, default=None, help="learn.steps (default: the config's)")
    p.add_argument("--out", default=None, help="output folder (default runs/bench-trl-<time>)")
    p.add_argument("--skip-dora", action="store_true", help="only the TRL run")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    overrides = list(args.overrides) + ([f"learn.steps={args.steps}"] if args.steps else [])
    config = load_config(args.config, overrides)
    out = Path(args.out or f"runs/bench-trl-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    if not args.skip_dora:
        run_dir = out / "dora"
        code = dora_run(args.config, overrides, run_dir, out / "dora.log")
        if code:
            print(f"dora bench trl: dora run failed ({code}); see {out / 'dora.log'}")
            return 1
        results["dora"] = dora_curve(run_dir, config.learn.steps)
    results["trl"] = run_trl(config, out)
    (out / "bench-trl.json").write_text(json.dumps(results, indent=2))
    for line in summary_lines(results):
        print(line)
    plot_accuracy_vs_time(
        {name: [(p["seconds"], p["accuracy"]) for p in r["curve"]] for name, r in results.items()},
        out / "bench-trl.png",
        title=f"{Path(args.config).parent.name}: {config.learn.steps} steps",
        how=eval_label(config.data.eval_temperature, config.data.eval_samples),
    )
    print(f"accuracy against seconds: {out / 'bench-trl.png'}")
    return 0


def summary_lines(results: dict[str, Any]) -> list[str]:
    """Each trainer's steps/s and accuracy curve, then `dora/trl steps/s ratio` if both ran."""
    rates = {
        name: (r["steps"] / r["seconds"] if r["seconds"] else 0.0) for name, r in results.items()
    }
    lines = []
    for name, r in results.items():
        points = ", ".join(
            f"v{p['version']} {p['accuracy']:.3f} @ {p['seconds']:.0f} s" for p in r["curve"]
        )
        lines.append(f"{name}: {rates[name]:.3f} steps/s; held-out accuracy {points}")
    if rates.get("dora") and rates.get("trl"):
        lines.append(f"dora/trl steps/s ratio: {rates['dora'] / rates['trl']:.2f}")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
