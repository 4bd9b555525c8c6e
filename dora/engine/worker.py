"""The engine thread: owns one Batcher, steps it, and runs every command against it in between
steps.

Nothing else touches the Batcher. Other threads (the aiohttp event loop) hand it closures with
`call`, which returns a `concurrent.futures.Future`; the loop awaits it with `asyncio.wrap_future`.
So engine compute never blocks the event loop, and batcher state needs no locks.

Weight loads have three modes:
- "drain": admission stops, running sequences finish under the old weights, then the load happens;
- "abort": running and waiting sequences end now with finish_reason "abort" (tokens so far), then
  load;
- "keep": load between two steps; running sequences go on under the new weights (partial rollout),
  and each token's version says which weights sampled it.

A LoRA adapter is a version beside the others (the base model is held once): loading one never
waits for running sequences, which keep the version they run under.

Pausing stops stepping (commands still run), so a paused engine can still export or abort requests.

Two threads take turns at the Batcher, one at a time: "dora-engine" under the normal scheduling
policy and "dora-engine-idle", which moves itself under `SCHED_IDLE` (Linux) when it starts and
so runs only on CPU that nothing else on the machine wants. `set_background` says which one steps
next. Any process may lower a thread to `SCHED_IDLE` but only a privileged one may lift it again;
handing the Batcher to the other thread instead lets an unprivileged engine move in both
directions (serve's CPU priority by deadline, docs/serve.md).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Literal, TypeVar

import torch

from dora.engine.batcher import Batcher
from dora.engine.lora import is_adapter

T = TypeVar("T")
LoadMode = Literal["drain", "abort", "keep"]
log = logging.getLogger(__name__)


def _wake() -> None:
    """A command that does nothing: it ends a thread's wait for commands when the turn passes."""


class EngineWorker:
    """Runs a Batcher on one of two dedicated threads at a time (the module docstring)."""

    def __init__(self, batcher: Batcher, *, threads: int | None = None) -> None:
        self.batcher = batcher
        self.paused = False
        self.background = False
        """Whether the idle-policy thread steps the Batcher (`set_background`)."""
        self._threads = threads
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._stepping = [
            threading.Thread(target=self._run, args=(False,), name="dora-engine", daemon=True),
            threading.Thread(target=self._run, args=(True,), name="dora-engine-idle", daemon=True),
        ]
        self._turn = {False: threading.Event(), True: threading.Event()}
        self._turn[False].set()
        self._baton = threading.Lock()
        self._stopped = False
        self._pending_loads: list[tuple[Callable[[], None], Future[dict[str, object]]]] = []
        self._rate: deque[tuple[float, int]] = deque()
        self.loading = False
        """Whether the engine thread is loading weights now."""
        self._busy_since: float | None = None
        self._foreground_since = 0.0

    def start(self) -> None:
        for thread in self._stepping:
            thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort what is in flight and stop the threads."""
        if any(thread.is_alive() for thread in self._stepping):
            self.call(lambda b: b.abort_all())
            self._commands.put(None)
            for thread in self._stepping:
                thread.join(timeout_s)

    def set_background(self, background: bool) -> None:
        """Step the Batcher on the idle-policy thread (True) or the normal one (False), from the
        next turn on; callable from any thread, returns at once."""
        if background == self.background:
            return
        self.background = background
        if not background:
            self._foreground_since = time.monotonic()
        self._turn[background].set()
        self._turn[not background].clear()
        self._commands.put(_wake)  # the thread whose turn ends may be waiting for a command

    def call(self, fn: Callable[[Batcher], T]) -> Future[T]:
        """Run `fn(batcher)` between two steps, on whichever thread's turn it is."""
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self.batcher))
            except BaseException as exc:  # handed to the caller, who decides
                future.set_exception(exc)

        self._commands.put(run)
        return future

    def set_paused(self, paused: bool) -> Future[bool]:
        def apply(_: Batcher) -> bool:
            self.paused = paused
            return paused

        return self.call(apply)

    def load_weights(
        self, tensors: Callable[[], dict[str, torch.Tensor]], *, version: int, mode: LoadMode
    ) -> Future[dict[str, object]]:
        """Load the weights `tensors()` returns as `version`, with the given in-flight semantics.
        A LoRA adapter (lora.py) is added beside the versions held: running sequences keep
        theirs, so "drain" need not wait (and "keep" moves them all to `version`)."""
        result: Future[dict[str, object]] = Future()
        aborted: list[str] = []

        def answer(started: float, previous: int, *, unchanged: bool) -> None:
            result.set_result(
                {
                    "version": version,
                    "previous_version": previous,
                    "aborted": aborted,
                    "load_s": time.perf_counter() - started,
                    "versions": self.batcher.held_versions(),
                    "unchanged": unchanged,
                }
            )

        def do_load(loaded: dict[str, torch.Tensor], started: float) -> None:
            previous = self.batcher.version
            try:
                if is_adapter(loaded):
                    self.batcher.load_adapter(version, loaded, keep=mode == "keep")
                else:
                    _copy_weights(self.batcher.model, loaded)
                    self.batcher.load_base(version)
            except BaseException as exc:
                self.batcher.admission_paused = bool(self._pending_loads)
                result.set_exception(exc)
                return
            self.batcher.admission_paused = bool(self._pending_loads)
            answer(started, previous, unchanged=False)

        def begin() -> None:
            started = time.perf_counter()
            try:
                loaded = tensors()
                _check_finite(loaded)
                if self._holds(version, loaded):  # a retry of a load that happened: no change
                    answer(started, self.batcher.version, unchanged=True)
                    return
            except BaseException as exc:
                result.set_exception(exc)
                return
            if mode == "abort":
                aborted.extend(c.request_id for c in self.batcher.abort_all())
            if mode == "drain" and self.batcher.running and not is_adapter(loaded):
                self.batcher.admission_paused = True
                self._pending_loads.append((lambda: do_load(loaded, started), result))
            else:
                do_load(loaded, started)

        self._commands.put(lambda: self._loading_while(begin))
        return result

    def _holds(self, version: int, loaded: dict[str, torch.Tensor]) -> bool:
        """Whether the engine already serves `version` with exactly `loaded` (as it would hold
        them); False if it does not serve `version`. New weights under a version it serves are
        refused (WeightsConflict): requests pinned to a version rely on its weights."""
        b = self.batcher
        if version not in b.held_versions():
            return False
        if is_adapter(loaded):
            same = b.adapters.holds(version, loaded)
        else:
            same = version == b.base_version and version not in b.adapters.slot_of
            same = same and _holds_weights(b.model, loaded)
        if not same:
            raise WeightsConflict(
                f"version {version} is served with other weights: weights never change under a "
                "version the engine serves (load them as a new version)"
            )
        return True

    def _loading_while(self, work: Callable[[], None]) -> None:
        self.loading = True
        try:
            work()
        finally:
            self.loading = False

    def stalled_s(self) -> float:
        """How long the engine thread has been inside one step or command, in the foreground and
        not loading weights (a load has its own deadline, and the idle-policy thread waits for
        CPU that nothing else wants by design); 0 while it waits for work."""
        since = self._busy_since
        if since is None or self.loading or self.background:
            return 0.0
        return max(0.0, time.monotonic() - max(since, self._foreground_since))

    def unload_weights(self, version: int) -> Future[dict[str, object]]:
        """Drop adapter `version` (refused while it is the newest or still used)."""

        def unload(b: Batcher) -> dict[str, object]:
            b.unload_adapter(version)
            return {"version": b.version, "unloaded": version, "versions": b.held_versions()}

        return self.call(unload)

    def rate(self) -> float:
        """Generated tokens per second over the last ~10 s."""
        if len(self._rate) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._rate[0], self._rate[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def _run(self, background: bool) -> None:
        if self._threads is not None:
            torch.set_num_threads(self._threads)
        if background:
            _lower_to_idle()
        while True:
            self._turn[background].wait()
            with self._baton:
                if self._stopped:
                    return
                if self.background != background:
                    continue
                if not self._turn_once(background):
                    self._stopped = True
                    self._turn[not background].set()  # the other thread sees the stop and ends
                    return

    def _turn_once(self, background: bool) -> bool:
        """Run the commands waiting (wait for one when there is nothing to step), then one step,
        unless the turn passes meanwhile (the other thread then runs what follows); False once
        asked to stop."""
        busy = self.batcher.has_work() and not self.paused
        try:
            command = self._commands.get(block=not busy)
            while True:
                if command is None:
                    return False
                self._busy(command)
                if self.background != background:
                    return True
                command = self._commands.get_nowait()
        except queue.Empty:
            pass
        if self._pending_loads and not self.batcher.running:
            load = self._pending_loads.pop(0)[0]
            self._busy(lambda: self._loading_while(load))
        if self.batcher.has_work() and not self.paused:
            self._busy(self._step)
        return True

    def _busy(self, work: Callable[[], None]) -> None:
        """Run `work`, timed for `stalled_s`."""
        self._busy_since = time.monotonic()
        try:
            work()
        finally:
            self._busy_since = None

    def _step(self) -> None:
        try:
            self.batcher.step()
        except Exception:
            log.exception("engine step failed; ending every request in flight")
            for seq in [*self.batcher.running, *self.batcher.waiting]:
                seq.error = "engine step failed (see the engine log)"
            self.batcher.abort_all()
        self._record_rate()

    def _record_rate(self) -> None:
        now = time.monotonic()
        self._rate.append((now, self.batcher.generated_tokens))
        while len(self._rate) > 2 and now - self._rate[0][0] > 10.0:
            self._rate.popleft()


def _lower_to_idle() -> None:
    """Move the calling thread under `SCHED_IDLE` (any process may); elsewhere than Linux it keeps
    the normal policy and the background turn is only a turn."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError as exc:
            log.warning("the engine's background thread keeps the normal policy: %s", exc)


class WeightsConflict(ValueError):
    """A load would change the weights under a version the engine serves."""


def _check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """Refuse (ValueError) weights that hold NaN or inf: they would make every logprob NaN."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"{name}: {bad} values are not finite (NaN or inf)")


def _holds_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether copying `tensors` into `model` (`_copy_weights`) would change nothing."""
    state = _checked_state(model, tensors)
    return all(
        torch.equal(state[name], tensor.to(state[name].device, state[name].dtype))
        for name, tensor in tensors.items()
    )


def _copy_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy every parameter in place; names must cover all parameters (tied copies optional)."""
    state = _checked_state(model, tensors)
    with torch.no_grad():
        for name, tensor in tensors.items():
            state[name].copy_(tensor)


def _checked_state(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The model's state, once `tensors` are known to match it (ValueError naming what not)."""
    state = model.state_dict()
    unknown = sorted(set(tensors) - set(state))
    required = {name for name, _ in model.named_parameters()}
    missing = sorted(required - set(tensors))
    if unknown or missing:
        raise ValueError(
            f"weights do not match the model: unknown {unknown[:5]}, missing {missing[:5]}"
        )
    for name, tensor in tensors.items():
        target = state[name]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)}, model has {tuple(target.shape)}"
            )
    return state


def read_safetensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `folder`."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors
