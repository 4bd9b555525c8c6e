"""Every counter of one `dora serve`, in one place: the parts add to it, the metrics read it.

The parts that count (the router, the dispatcher, the instance lifecycle, the trainer link) share
one `ServeStats`; `metrics.Snapshots` reads it into `tick` records and the final summary. A field
here is named as it appears in those records (`rollout.jsonl`, `summary.json`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dora.core.transfer_queue import RefusalReason

__all__ = ["ServeStats"]


def _no_waits() -> dict[str, float]:
    return {r.value: 0.0 for r in RefusalReason}


@dataclass(kw_only=True)
class ServeStats:
    """Counters of a running serve (this process only; `history.History` holds earlier ones)."""

    completed: int = 0
    """Groups completed (or masked) in this serve, restored ones included."""
    admission_wait_s: dict[str, float] = field(default_factory=_no_waits)
    """Seconds the dispatcher waited, by the reason admission was refused."""
    trainer_wait_s: float = 0.0
    """Seconds the trainer waited for a step's last group (from the end of the previous step)."""
    weight_loads: int = 0
    weight_load_s: float = 0.0
    weight_load_retries: int = 0
    nccl_loads: int = 0
    """Instance loads done by an NCCL broadcast (`learn.weight_transport = "nccl"`)."""
    nccl_fallbacks: int = 0
    """Instance loads that were to come by broadcast and came from the weight store instead."""
    instance_restarts: int = 0
    instances_failed: set[str] = field(default_factory=set)
    """Instances found dead (unreachable, or past their health deadline)."""
    masked_samples: int = 0
    masked_reasons: dict[str, int] = field(default_factory=dict)
    prompts_skipped: int = 0
    """Training tasks left out at load because their prompt does not fit the context."""
    eval_prompts_skipped: int = 0
    # the router's
    migrations: int = 0
    kv_migrations: int = 0
    resubmissions: int = 0
    parks: int = 0
    missed_interrupts: int = 0
    """Interrupts that found nothing to stop (the call had ended) or failed on the instance:
    the call then finished where it was, which is safe (same version, or a drained load)."""
    failed_calls: int = 0
    """Calls lost because their instance became unreachable."""
    max_versions_serving: int = 0
    """Most distinct versions with calls in flight at the same moment (exact, from the router)."""
    # the episode runners' (`runners.py`)
    runner_reruns: int = 0
    """Episodes run again from their start because their runner was lost."""
    runners_lost: int = 0
    runners_refused: int = 0
    """Hellos refused: without the token, or naming a runner already connected."""
    runner_results_ignored: int = 0
    """Episode results from a runner that did not own the episode (any more), or sent twice."""
    runner_frames_dropped: int = 0
    """Frames that did not decode, or came from a peer that is not an admitted runner."""
    runner_cpu_s: dict[bytes, float] = field(default_factory=dict)
    """CPU seconds each runner process (by connection, the lost ones too) last reported."""

    def runner_counts(self) -> dict[str, int]:
        """The runners' counters, as the summary names them."""
        return {
            "runner_reruns": self.runner_reruns,
            "runners_lost": self.runners_lost,
            "runners_refused": self.runners_refused,
            "runner_results_ignored": self.runner_results_ignored,
            "runner_frames_dropped": self.runner_frames_dropped,
        }

    def router_counts(self) -> dict[str, int]:
        """The router's counters, as the `tick` records and the summary name them."""
        return {
            "migrations": self.migrations,
            "kv_migrations": self.kv_migrations,
            "resubmissions": self.resubmissions,
            "parks": self.parks,
            "missed_interrupts": self.missed_interrupts,
            "failed_calls": self.failed_calls,
        }

    def add_masked(self, reasons: dict[str, int]) -> int:
        """Count the masked samples of one group, by reason; their number."""
        n = sum(reasons.values())
        self.masked_samples += n
        for reason, k in reasons.items():
            self.masked_reasons[reason] = self.masked_reasons.get(reason, 0) + k
        return n
