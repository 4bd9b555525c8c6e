"""One emulated instance: vLLM-like continuous batching on a scaled clock, with no model.

Time is the cost model (`dora.costs.Setup`) that the simulator spends too, one source of truth:
a decode step of `b` running sequences holding `S` context tokens takes `t0 + c * b + k * S`
modelled seconds; a prefill of `n` tokens after `m` cached ones takes `Setup.prefill_s(m, n)` and
pauses decoding (as in the simulator); a weight load takes `weight_sync_s`; an imported request's
KV cache arrives at `kv_transfer_gbps`. A modelled second lasts `time_scale` real seconds
(`ScaledClock`).

The instance is event-driven, like the simulator's: between two events `b` is constant and `S`
grows by `b` per step, so the tokens decoded in `dt` solve a quadratic, and the next event (the
next sequence to finish, or a full KV cache) is one timer on the event loop. Progress is computed
from the clock when an event runs, so a late timer costs the instance nothing. At most `max_seqs`
sequences run; a waiting one starts when its context fits the KV capacity (less vLLM's watermark);
when the cache is full the most recently started sequence is preempted and later re-prefilled
(recompute preemption). The first request with a given prompt pays its prefill; the next ones hit
the prefix cache (the `G` samples of a group), which a weight load clears.

Invariant: a sequence's sampled tokens never exceed its target, and everything it sampled is
returned (complete, aborted or exported).
"""

from __future__ import annotations

import asyncio
import heapq
import time
import zlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from dora.costs import Setup, decode_seconds, decode_steps
from dora.emulated.model import EmulatedModel, Plan
from dora.protocol import Completion, FinishReason, as_array

__all__ = ["EmulatedInstance", "ScaledClock", "Sequence"]

_EPS = 1e-6


class ScaledClock:
    """Modelled seconds since the start; one lasts `scale` real seconds of the event loop."""

    def __init__(self, scale: float, loop: asyncio.AbstractEventLoop) -> None:
        self.scale = scale
        self.loop = loop
        self.origin = loop.time()

    def now(self) -> float:
        return (self.loop.time() - self.origin) / self.scale

    def real_at(self, modelled: float) -> float:
        return self.origin + modelled * self.scale


@dataclass(eq=False, slots=True)
class Sequence:
    """One request on an instance."""

    id: str
    prompt_ids: list[int]
    plan: Plan
    target: int
    """Tokens this call samples in all (exported ones included)."""
    finish: FinishReason
    version: int
    done: float = 0.0
    """Tokens sampled before the current run segment."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Tokens carried in by an import (their values, already sampled elsewhere)."""
    sampled_by: list[tuple[int, int]] = field(default_factory=list)
    """`(n, v)` for each version loaded under it: its tokens before position `n` not yet given
    a version were sampled by `v` (`load(keep=True)`); the rest by `version`."""
    future: asyncio.Future[Completion] | None = None
    prefill_from: int = 0
    """Context tokens already in the KV cache when it starts (-1: look up the prefix cache)."""
    p0: float = 0.0
    mark: float = 0.0
    running: bool = False

    @property
    def context(self) -> int:
        return len(self.prompt_ids) + int(self.done)


class EmulatedInstance:
    """One instance's scheduler; every method runs on the event loop."""

    def __init__(
        self, *, name: str, setup: Setup, clock: ScaledClock, model: EmulatedModel, version: int
    ) -> None:
        self.name = name
        self.s = setup
        self.clock = clock
        self.model = model
        self.version = version
        self.co = setup.decode_coefficients()
        self.kv_capacity = setup.kv_capacity_tokens
        self.kv_limit = self.kv_capacity * (1.0 - setup.kv_watermark)
        self.running: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.heap: list[tuple[float, int, Sequence]] = []
        self.prefix: OrderedDict[int, None] = OrderedDict()
        self.prog = 0.0
        self.kv = 0.0
        self.stall = 0.0
        self.t = clock.now()
        self.paused = False
        self.loading = False
        self.idle = asyncio.Event()
        self.idle.set()
        self._handle: asyncio.TimerHandle | None = None
        self._seq = 0
        self.generated = 0
        self.preemptions = 0
        self.busy_s = 0.0

    # --- requests --------------------------------------------------------------------------------

    def submit(self, seq: Sequence, *, stall_s: float = 0.0) -> asyncio.Future[Completion]:
        """Queue `seq` (after `stall_s` modelled seconds of transfer); the future resolves with
        its completion (or its tokens so far)."""
        self._sync()
        self.stall += stall_s
        seq.future = asyncio.get_running_loop().create_future()
        self.waiting.append(seq)
        self.idle.clear()
        self._kick()
        return seq.future

    def find(self, request_id: str) -> Sequence | None:
        seq = self.running.get(request_id)
        if seq is not None:
            return seq
        return next((s for s in self.waiting if s.id == request_id), None)

    def take(self, seq: Sequence) -> Completion:
        """Stop `seq` now (abort or export); return what it sampled so far."""
        self._sync()
        self._stop(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        out = self._completion(seq, int(seq.done + _EPS), "abort")
        self._resolve(seq, out)
        self._kick()
        return out

    def abort_all(self) -> list[Completion]:
        return [self.take(s) for s in [*self.running.values(), *self.waiting]]

    # --- control ---------------------------------------------------------------------------------

    def set_paused(self, paused: bool) -> None:
        self._sync()
        self.paused = paused
        self._kick()

    async def load(self, version: int, *, keep: bool = False) -> float:
        """Load `version` (modelled `weight_sync_s`); every request waits meanwhile. With `keep`
        the requests it holds go on afterwards with the KV cache they have, their next tokens
        sampled by `version` (mode inflight)."""
        self._sync()
        self.loading = True
        self._kick()
        started = time.perf_counter()
        try:
            await asyncio.sleep(self.s.weight_sync_s * self.clock.scale)
        finally:
            self._sync()
            self.loading = False
            if keep:
                for seq in [*self.running.values(), *self.waiting]:
                    done = seq.done + (self.prog - seq.p0 if seq.running else 0.0)
                    seq.sampled_by.append((int(done + _EPS), seq.version))
                    seq.version = version
            self.version = version
            self.prefix.clear()  # the prefix cache is salted by version (docs/engine.md)
            self._kick()
        return time.perf_counter() - started

    def stats(self) -> dict[str, object]:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_tokens": round(self.kv),
            "kv_capacity_tokens": round(self.kv_capacity),
            "kv_use": self.kv / self.kv_capacity,
            "generated_tokens": self.generated,
            "preemptions": self.preemptions,
            "loading": self.loading,
        }

    # --- the timing model ------------------------------------------------------------------------

    def _active(self) -> bool:
        return not self.paused and not self.loading

    def _sync(self) -> None:
        """Advance progress to now (no event happened in between)."""
        now = self.clock.now()
        dt, self.t = now - self.t, now
        if dt <= 0 or not self._active() or not (self.running or self.stall > 0):
            return
        self.busy_s += dt
        if self.stall > 0:
            use = min(self.stall, dt)
            self.stall -= use
            dt -= use
        b = len(self.running)
        if b == 0 or dt <= 0:
            return
        dp = decode_steps(self.co, b, self.kv, dt)
        self.prog += dp
        self.kv += b * dp

    def _kick(self) -> None:
        """Finish, preempt and start what is due, then set the timer of the next event."""
        heap = self.heap
        while heap and heap[0][0] <= self.prog + _EPS:
            _, _, seq = heapq.heappop(heap)
            if seq.running and self.running.get(seq.id) is seq:
                self._stop(seq)
                self._resolve(seq, self._completion(seq, seq.target, seq.finish))
        while self.running and self.kv >= self.kv_capacity - _EPS:
            seq = self.running[next(reversed(self.running))]
            self._stop(seq)
            seq.prefill_from = 0  # recompute preemption: its KV cache is freed
            self.waiting.appendleft(seq)
            self.preemptions += 1
        if self._active():
            self._start_waiting()
        if not self.running and not self.waiting:
            self.idle.set()
        self._schedule()

    def _start_waiting(self) -> None:
        while self.waiting and len(self.running) < self.s.max_seqs:
            seq = self.waiting[0]
            ctx = seq.context
            if self.running and self.kv + ctx > self.kv_limit:
                break
            self.waiting.popleft()
            start = seq.prefill_from
            if start < 0:
                key = zlib.crc32(np.asarray(seq.prompt_ids, dtype=np.int32).tobytes())
                start = len(seq.prompt_ids) if key in self.prefix else 0
                self.prefix[key] = None
                while len(self.prefix) > 4096:
                    self.prefix.popitem(last=False)
            self.stall += self.s.prefill_s(float(start), float(ctx - start))
            seq.prefill_from = ctx
            seq.running = True
            seq.p0 = self.prog
            seq.mark = self.prog + (seq.target - seq.done)
            self.running[seq.id] = seq
            self._seq += 1
            heapq.heappush(self.heap, (seq.mark, self._seq, seq))
            self.kv += ctx

    def _stop(self, seq: Sequence) -> None:
        """Take a running `seq` off the batch (synced); its progress is kept."""
        if not seq.running:
            return
        seq.running = False
        del self.running[seq.id]
        seq.done = min(float(seq.target), seq.done + (self.prog - seq.p0))
        self.kv -= len(seq.prompt_ids) + seq.done
        seq.prefill_from = seq.context  # its KV cache is kept until preemption drops it
        if not self.running:
            self.kv = 0.0  # no float drift carried into the next batch

    def _schedule(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if not self._active() or not (self.running or self.stall > 0):
            return
        b = len(self.running)
        dt = self.stall
        if b:
            heap = self.heap
            while heap and not (heap[0][2].running and self.running.get(heap[0][2].id)):
                heapq.heappop(heap)
            dp = max(0.0, heap[0][0] - self.prog) if heap else 0.0
            dp = min(dp, max(0.0, (self.kv_capacity - self.kv) / b))
            dt += decode_seconds(self.co, b, self.kv, dp)
        when = self.clock.real_at(self.t + dt)
        self._handle = self.clock.loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._handle = None
        self._sync()
        self._kick()

    # --- results ---------------------------------------------------------------------------------

    def _completion(self, seq: Sequence, count: int, finish: FinishReason) -> Completion:
        carried = len(seq.token_ids)
        ids, logprobs = self.model.tokens(seq.plan, seq.plan.offset + carried, count - carried)
        self.generated += count - carried
        return Completion(
            request_id=seq.id,
            token_ids=as_array("i", seq.token_ids) + ids,
            logprobs=as_array("f", seq.logprobs) + logprobs,
            versions=as_array("i", seq.versions) + _versions(seq, carried, count),
            finish_reason=finish,
            prompt_tokens=len(seq.prompt_ids),
        )

    @staticmethod
    def _resolve(seq: Sequence, out: Completion) -> None:
        if seq.future is not None and not seq.future.done():
            seq.future.set_result(out)


def _versions(seq: Sequence, start: int, end: int) -> array[int]:
    """The versions that sampled `seq`'s tokens in positions `[start, end)`."""
    out = array("i")
    for n, version in seq.sampled_by:
        upto = min(max(n, start), end)
        out += array("i", [version]) * (upto - start)
        start = upto
    return out + array("i", [seq.version]) * (end - start)
