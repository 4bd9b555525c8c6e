"""Chaos: `dora run` on the math example, made small, while an instance, the trainer and `dora
serve` are each killed once (SIGKILL) at random moments drawn from a seed; and, in one more seed,
with the episodes on two runner processes (`serve.runners = 2`), while an instance is stopped
(SIGSTOP) for longer than `serve.health_timeout_s` (hung, not gone: it must be declared dead and
replaced by serve itself) and one of the runners is killed (its episodes run again from their
start on the other, on the same version, and serve starts a new runner), with no serve restart.

The run must finish on its own (dora run restarts what died, serve restores its journal, the
trainer resumes from its last checkpoint; the checkpoint interval is 3, so every trainer restart
rolls back non-durable steps), and its accounting, read from the run directory, must hold:
admitted = consumed + filtered + rolled back (nothing left unassigned); every step trained on
exactly B groups, no group in two steps, staleness at most K; every fault seen and recovered from
(counted); the final checkpoint loads with transformers; no process is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from dora.emulated.checks import check_accounting as read_accounting
from tests.chaos.processes import children as _children
from tests.commands import start_dora_run

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "math" / "config.toml"
STEPS, B, G, K, EVERY = 12, 2, 4, 2, 3
FAULTS = ("instance", "learn", "serve")
HEALTH_TIMEOUT_S = 5


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return []
    return [part.decode() for part in raw.split(b"\0") if part]


def _side(run_pid: int, name: str) -> int | None:
    """The pid of dora run's `serve` or `learn` child."""
    for pid in _children(run_pid):
        argv = _cmdline(pid)
        if "dora.cli" in argv and name in argv:
            return pid
    return None


def _instances(serve_pid: int) -> list[int]:
    return [pid for pid in _children(serve_pid) if "dora.engine" in _cmdline(pid)]


def _runners(serve_pid: int) -> list[int]:
    """Serve's episode runner processes (`dora runner --connect ...`)."""
    return [pid for pid in _children(serve_pid) if "runner" in _cmdline(pid)[2:4]]


def _trained(run_dir: Path) -> int:
    """Steps trained so far (re-trained steps after a roll-back count again)."""
    path = run_dir / "learn-metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _last_step(run_dir: Path) -> int:
    """The step the trainer trained last (-1 before any)."""
    path = run_dir / "learn-metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    lines = text[: text.rfind("\n") + 1].splitlines()  # whole lines only
    return int(json.loads(lines[-1])["step"]) if lines else -1


def _running_calls(pid: int) -> int:
    """How many calls the engine process `pid` is running now (its /metrics), 0 if it does not
    answer."""
    try:
        ports = [
            c.laddr.port
            for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN
        ]
        for port in ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                return int(json.loads(r.read())["running"])
    except (psutil.Error, OSError, KeyError, ValueError):
        pass
    return 0


def _busy_instance(serve_pid: int, deadline: float) -> int | None:
    """An instance with calls running. A stalled instance stops the run only through the calls
    it holds: one that holds none (idle, or loading a version the other serves) is never
    waited on, and the run may end before its health deadline comes."""
    while time.monotonic() < deadline:
        for pid in _instances(serve_pid):
            if _running_calls(pid) > 0:
                return pid
        time.sleep(0.01)
    return None


def _kill(run_pid: int, fault: str) -> int | None:
    serve = _side(run_pid, "serve")
    if fault == "stall":
        victim = _busy_instance(serve, time.monotonic() + 30) if serve else None
    elif fault == "instance":
        victims = _instances(serve) if serve else []
        victim = victims[0] if victims else None
    elif fault == "runner":
        victims = _runners(serve) if serve else []
        victim = victims[0] if victims else None
    else:
        victim = _side(run_pid, fault)
    if victim is not None:
        os.kill(victim, signal.SIGSTOP if fault == "stall" else signal.SIGKILL)
    return victim


def _resume(pid: int) -> None:
    """End a stall (serve has killed the process by then: nothing to resume)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def _step_time(run_dir: Path) -> float:
    """How long the trainer's last step took (0 before any)."""
    path = run_dir / "learn-metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    lines = text[: text.rfind("\n") + 1].splitlines()
    return float(json.loads(lines[-1])["step_time_s"]) if lines else 0.0


def _records(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


RECOVERED = {
    "instance": "instance_failed",
    "serve": "restore",
    "learn": "rollback",
    "stall": "instance_unresponsive",
    "runner": "runner_lost",
}
"""The rollout record that shows the run saw (instance: its requests moved on, a replacement is
starting; stall: it missed its health deadline) or recovered from each fault (a new serve
restored its journal; serve rolled back for the resumed trainer) before the next fault is
injected."""


def _count(run_dir: Path, kind: str) -> int:
    path = run_dir / "rollout.jsonl"
    return path.read_text().count(f'"kind":"{kind}"') if path.exists() else 0


@pytest.mark.parametrize(
    ("seed", "faults", "mode"),
    [
        pytest.param(1, FAULTS, "dora", id="seed1-kills"),
        pytest.param(2, FAULTS, "dora", id="seed2-kills"),
        pytest.param(3, FAULTS, "inflight", id="seed3-inflight-kills"),
        pytest.param(4, ("stall", "runner"), "dora", id="seed4-stall-runner-kill"),
    ],
)
def test_chaos(tmp_path: Path, seed: int, faults: tuple[str, ...], mode: str) -> None:
    rng = random.Random(seed)
    order = rng.sample(faults, len(faults))
    # The trained-step counts that trigger each fault, then a random moment inside the step.
    triggers = sorted(rng.sample(range(1, STEPS - 3), len(faults)))
    run_dir = tmp_path / "run"
    overrides = [
        f"learn.steps={STEPS}",
        f"learn.checkpoint_every={EVERY}",
        "learn.recv_timeout_s=90",
        f"rollout.batch_size={B}",
        f"rollout.group_size={G}",
        f"rollout.staleness={K}",
        f"rollout.mode={mode}",
        "log.samples_every=1",
        "rollout.max_tokens=48",
        "serve.instances=2",
        "serve.max_running=16",
        "serve.request_timeout_s=90",
        "serve.weight_load_timeout_s=60",
        f"serve.health_timeout_s={HEALTH_TIMEOUT_S}",
        "model.warmup_steps=10",
        "data.eval_source=",
        "log.progress=false",
        "log.metrics_every_s=0.5",
        f"log.run_dir={run_dir}",
    ]
    if "runner" in faults:
        overrides.append("serve.runners=2")
    run = start_dora_run(EXAMPLE, overrides, log=tmp_path / "dora-run.log", cwd=tmp_path)
    seen: set[int] = {run.pid}
    killed: list[tuple[str, int]] = []
    try:
        deadline = time.monotonic() + 200
        for fault, trigger in zip(order, triggers, strict=True):
            # each fault after the run has recovered from the previous one and trained on
            while _trained(run_dir) < trigger + len(killed) and run.poll() is None:
                assert time.monotonic() < deadline, f"no progress to {trigger} before {fault}"
                _remember(run.pid, seen)
                time.sleep(0.1)
            # the trainer dies two steps past a checkpoint, so the versions it published since
            # are ghosts whose groups the roll-back removes
            while fault == "learn" and run.poll() is None:
                last = _last_step(run_dir)
                if last % EVERY == 1 or last >= STEPS - 2:
                    break
                assert time.monotonic() < deadline, "no step two past a checkpoint"
                time.sleep(0.02)
            # a random moment inside the next step: steps take 0.1 s on a quiet machine and over
            # 1 s on a loaded one, so a fixed delay could outlast the rest of the run
            limit = 0.5 if fault == "learn" else 1.0
            time.sleep(rng.uniform(0.0, min(limit, _step_time(run_dir))))
            _remember(run.pid, seen)
            before = _count(run_dir, RECOVERED[fault])
            victim = _kill(run.pid, fault)
            if victim is None:
                continue
            killed.append((fault, victim))
            while _count(run_dir, RECOVERED[fault]) == before and run.poll() is None:
                assert time.monotonic() < deadline, f"no recovery from the {fault} fault"
                _remember(run.pid, seen)
                time.sleep(0.1)
            if fault == "stall":  # stopped for longer than the health deadline, by construction
                _resume(victim)
        while run.poll() is None and time.monotonic() < deadline:
            _remember(run.pid, seen)
            time.sleep(0.2)
        code = run.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for fault, victim in killed:
            if fault == "stall":
                _resume(victim)
        _stop(run)
    log = (tmp_path / "dora-run.log").read_text(errors="replace")
    assert code == 0, log[-4000:]
    assert [f for f, _ in killed] == list(order), f"every fault was injected: {killed}"

    # --- the run's accounting, from the run directory -------------------------------------------
    extra = check_accounting(run_dir, steps=STEPS, batch_size=B, staleness=K)
    assert extra["serve_restarts"] == int("serve" in faults), extra

    restarts = [r for r in _records(run_dir / "supervisor.jsonl") if r["kind"] == "exit"]
    sides = sorted(f for f in faults if f in ("learn", "serve"))
    assert sorted(r["component"] for r in restarts) == sides, restarts
    for fault in faults:
        assert _count(run_dir, RECOVERED[fault]) >= 1, fault
    if "stall" in faults:  # serve itself replaced the hung instance
        assert _count(run_dir, "instance_failed") >= 1
        assert extra["instance_restarts"] >= 1, extra
    if "runner" in faults:  # serve itself started a new runner; the episodes went on elsewhere
        assert extra["runners_lost"] == 1 and extra["runner_restarts"] == 1, extra
        assert extra["runner_results_ignored"] == 0, extra
        assert extra["runner_episodes_local-0"] > 0 and extra["runner_episodes_local-1"] > 0

    check_final_checkpoint(run_dir, steps=STEPS)
    check_nothing_left(seen)
    check_token_versions(run_dir, spans_versions=mode == "inflight")


def check_token_versions(run_dir: Path, *, spans_versions: bool) -> None:
    """Which version sampled each token (samples.jsonl): the group's version alone (C1), or, in
    mode inflight, versions in order from the group's on, never an older one (a request that got
    its first token after a load starts on the newer version), so the staleness counted from the
    group's version bounds that of every token."""
    groups = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert groups, "samples.jsonl is empty"
    for group in groups:
        for sample in group["samples"]:
            versions = [v for _, _, v in sample["version_spans"]]
            if not versions:
                continue  # masked: nothing sampled
            if spans_versions:
                assert versions[0] >= group["version"], (group["group"], versions)
                assert versions == sorted(versions), (group["group"], versions)
            else:
                assert versions == [group["version"]], (group["group"], versions)


def _remember(run_pid: int, seen: set[int]) -> None:
    """Every process of the run (sides, instances, ranks), to check none is left at the end."""
    frontier = [run_pid]
    while frontier:
        pid = frontier.pop()
        for child in _children(pid):
            if child not in seen:
                seen.add(child)
                frontier.append(child)


def _stop(run: subprocess.Popen[bytes]) -> None:
    """Stop what is left of `dora run` (its process group), gracefully first."""
    if run.poll() is None:
        os.killpg(run.pid, signal.SIGINT)
        try:
            run.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()


def check_accounting(
    run_dir: Path, *, steps: int, batch_size: int, staleness: int
) -> dict[str, int]:
    """Nothing lost, nothing trained twice, staleness within K; serve's summary's `extra`."""
    check = read_accounting(run_dir, steps=steps, batch_size=batch_size, staleness=staleness)
    assert check.ok, check.problems
    return check.extra


def check_final_checkpoint(run_dir: Path, *, steps: int) -> Path:
    """The last step's checkpoint loads with transformers; its folder."""
    from transformers import AutoModelForCausalLM

    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((latest / "trainer.json").read_text())
    assert meta["step"] == steps - 1 and meta["version"] == steps
    model = AutoModelForCausalLM.from_pretrained(latest / "model")
    assert sum(p.numel() for p in model.parameters()) > 0
    return latest


def check_nothing_left(seen: set[int]) -> None:
    time.sleep(0.5)
    alive = [pid for pid in seen if Path(f"/proc/{pid}").exists() and _cmdline(pid)]
    assert not alive, f"processes left behind: {[(p, _cmdline(p)) for p in alive]}"
