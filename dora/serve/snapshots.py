"""Snapshots: a running serve's parts, read into `tick` records and the final report
(`metrics.py` says what the records hold)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from dora.core.orchestrator import Orchestrator
from dora.gc_settings import peak_rss_mb
from dora.instance.callcpu import CALL_CPU
from dora.instance.session import SESSION_COUNTS
from dora.link import ServeLink
from dora.records import InstanceTick, LinkCounts, Tick, TickEval
from dora.serve.coretime import CoreClock
from dora.serve.history import History, masked_by_source
from dora.serve.journal import JournaledQueue
from dora.serve.metrics import RolloutReport
from dora.serve.router import Router
from dora.serve.stats import ServeStats
from dora.serve.trainer_link import TrainerLink
from dora.serve.weights import WeightStore

__all__ = ["Snapshots"]


class Snapshots:
    """Reads a running serve's parts into `tick` records and the final report."""

    def __init__(
        self,
        *,
        mode: str,
        queue: JournaledQueue,
        orchestrator: Orchestrator,
        router: Router,
        trainer: TrainerLink,
        store: WeightStore,
        stats: ServeStats,
        core: CoreClock,
        link: ServeLink,
        evals: Callable[[], list[tuple[int, float]]],
        history: History,
    ) -> None:
        self._mode = mode
        self._queue = queue
        self._orchestrator = orchestrator
        self._router = router
        self._trainer = trainer
        self._store = store
        self._stats = stats
        self._core = core
        self._link = link
        self._evals = evals
        self._history = history
        self._last_busy: dict[str, tuple[float, float]] = {}
        self._tick_versions_serving = 0

    def take(self, lag_ms: float, stall_ms: float) -> Tick:
        q, st = self._queue, self._stats
        now = time.monotonic()
        instances = []
        usage = self._router.usage(now)
        for view in self._orchestrator.instances():
            state = usage[view.id]
            busy = state.busy_s
            last_t, last_busy = self._last_busy.get(view.id, (self._trainer.started_at, 0.0))
            util = (busy - last_busy) / (now - last_t) if now > last_t else 0.0
            self._last_busy[view.id] = (now, busy)
            instances.append(
                InstanceTick(
                    id=view.id,
                    version=view.version,
                    ready=view.ready,
                    draining=view.draining,
                    leases=view.load,
                    capacity=view.capacity,
                    inflight=state.inflight,
                    util=round(min(1.0, util), 4),
                    tokens=state.tokens,
                )
            )
        serving = self._router.versions_serving()
        self._tick_versions_serving = max(self._tick_versions_serving, len(serving))
        acct = q.accounting()
        evals = self._evals()
        link = self._link
        return Tick(
            step=q.step,
            trained=self._trainer.trained_step,
            newest=q.newest_version,
            published=q.published_version,
            instances=instances,
            live_per_version=self._orchestrator.live(),
            serving_versions=serving,
            episodes_per_version=self._router.episodes_per_version(),
            queue_per_version={w: dataclasses.asdict(c) for w, c in q.version_counts().items()},
            staleness_histogram=q.staleness_histogram(),
            admitted=acct.admitted,
            completed=st.completed,
            assigned=acct.consumed,
            masked=acct.masked,
            retried=acct.retried,
            rolled_back=acct.rolled_back,
            **st.router_counts(),
            instances_failed=sorted(st.instances_failed),
            weight_loads=st.weight_loads,
            weight_load_s=round(st.weight_load_s, 4),
            weights_held=self._store.versions(),
            admission_wait_s={k: round(v, 4) for k, v in st.admission_wait_s.items() if v},
            trainer_wait_s=round(st.trainer_wait_s, 4),
            loop_lag_ms=round(lag_ms, 3),
            loop_stall_ms=round(stall_ms, 3),
            cpu_s=round(time.process_time(), 3),
            runner_cpu_s=round(sum(st.runner_cpu_s.values()), 3),
            peak_rss_mb=round(peak_rss_mb(), 1),
            core_s=round(self._core.seconds, 6),
            core_calls=self._core.calls,
            journal_writes=q.journal_writes()[0],
            journal_bytes=q.journal_writes()[1],
            link=LinkCounts(
                sent_messages=getattr(link, "sent_messages", 0),
                sent_bytes=getattr(link, "sent_bytes", 0),
                received_messages=getattr(link, "received_messages", 0),
                received_bytes=getattr(link, "received_bytes", 0),
            ),
            eval=TickEval(version=evals[-1][0], accuracy=evals[-1][1]) if evals else None,
        )

    def report(
        self, *, restored_starts: int, max_lag_ms: float, max_stall_ms: float = 0.0
    ) -> RolloutReport:
        """The whole run's report: this serve's counters, and what earlier serves of the run
        recorded (`history`) added to them (`restored_starts`: serves before this one;
        `max_lag_ms`, `max_stall_ms`: the ticker's)."""
        q, st, h = self._queue, self._stats, self._history
        now = time.monotonic()
        wall = now - self._trainer.started_at
        util = {
            i: round(u.busy_s / wall, 4) if wall > 0 else 0.0
            for i, u in self._router.usage(now).items()
        }
        evals = self._evals()
        extra: dict[str, float] = {}
        if evals:
            (first_v, first_a), (last_v, last_a) = evals[0], evals[-1]
            extra = {
                "eval_first_version": first_v,
                "eval_first_accuracy": first_a,
                "eval_last_version": last_v,
                "eval_last_accuracy": last_a,
            }
        if h.first_eval is not None:
            extra["eval_first_version"], extra["eval_first_accuracy"] = h.first_eval
        acct = q.accounting()
        extra.update(
            admitted=acct.admitted,
            consumed=acct.consumed,
            filtered=acct.filtered,
            rolled_back=acct.rolled_back,
            unassigned=acct.unassigned,
            masked=acct.masked,
            groups_restarted=acct.restarted,
            serve_restarts=restored_starts,
            instance_restarts=st.instance_restarts + h.instance_restarts,
            masked_samples=st.masked_samples + h.masked_samples,
            weight_load_retries=st.weight_load_retries,
            nccl_loads=st.nccl_loads,
            nccl_fallbacks=st.nccl_fallbacks,
            prompts_skipped=st.prompts_skipped,
            eval_prompts_skipped=st.eval_prompts_skipped,
            # the orchestrator's own counters: loads it ignored or held back, requests it failed
            stale_loads=self._orchestrator.stale_loads,
            held_back_loads=self._orchestrator.held_back_loads,
            **{f"requests_failed_{r.value}": n for r, n in self._orchestrator.failures().items()},
            **SESSION_COUNTS.summary(),  # calls that sent only what is new, and the fallbacks
            **st.runner_counts(),
        )
        reasons = dict(h.masked_reasons)
        for reason, n in st.masked_reasons.items():
            reasons[reason] = reasons.get(reason, 0) + n
        for source, n in masked_by_source(reasons).items():
            extra[f"masked_samples_{source}"] = n
        return RolloutReport(
            mode=self._mode,
            steps=q.step,
            groups_sent=sum(self._trainer.sent_per_step.values()),
            wall_s=round(wall if h.started_unix is None else time.time() - h.started_unix, 3),
            max_versions_serving=st.max_versions_serving,
            utilisation=util,
            staleness_histogram=q.staleness_histogram(),
            **st.router_counts(),
            instances_failed=h.instances_failed + sorted(st.instances_failed),
            weight_loads=st.weight_loads,
            weight_load_s=round(st.weight_load_s, 4),
            admission_wait_s={k: round(v, 4) for k, v in st.admission_wait_s.items()},
            trainer_wait_s=round(st.trainer_wait_s, 4),
            max_loop_lag_ms=round(max_lag_ms, 3),
            max_loop_stall_ms=round(max_stall_ms, 3),
            steps_trained=self._trainer.trained_step + 1,
            tick_versions_serving=self._tick_versions_serving,
            masked_reasons=reasons,
            extra=extra,
            core_s_by_call={
                k: round(v, 4) for k, v in sorted(self._core.by_call.items(), key=lambda kv: -kv[1])
            },
            model_calls=CALL_CPU.calls,
            call_cpu_s={k: round(v, 6) for k, v in CALL_CPU.seconds.items()},
        )
