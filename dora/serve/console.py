"""What a run prints while it learns: one line every `log.console_every` trained steps, and a short
table at the end.

The lines are built from the records `MetricsLog` writes (the same numbers as `rollout.jsonl`), and
go out through the `dora.progress` logger: above the live display when there is a terminal, to
stderr with a timestamp when there is none (a run piped to a file shows them too). A line:

    step 12/200  v13  reward 0.412  loss 0.0312  tokens/s 5,120  staleness 1.8 (max 3)
    trainer wait 2.1 s  held-out reward 0.52, success 48.0% (v10)

`tokens/s` counts the tokens the loss covered since the previous line, over serve's clock between
the two `trained` records; `trainer wait` is how long the trainer waited for groups over the same
interval (the one bubble the staleness gate allows).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

__all__ = ["StepLines", "summary_table"]

log = logging.getLogger("dora.progress")


class StepLines:
    """Reads the run's records as they are written and logs a line every `every` trained steps
    (and at the last step)."""

    def __init__(
        self, *, every: int, total_steps: int, emit: Callable[[str], None] = log.info
    ) -> None:
        self._every = every
        self._total = total_steps
        self._emit = emit
        self._tokens = 0.0
        self._since_s: float | None = None
        self._wait_s = 0.0
        self._wait_at_line_s = 0.0
        self._eval: Mapping[str, object] | None = None

    def observe(self, line: Mapping[str, object]) -> None:
        """One record as `rollout.jsonl` holds it (`kind`, `time_s`, fields)."""
        kind = line.get("kind")
        if kind == "tick":
            self._wait_s = _number(line.get("trainer_wait_s"))
            if self._since_s is None:
                self._since_s = _number(line.get("time_s"))
        elif kind == "eval":
            self._eval = line
        elif kind == "trained":
            metrics = line.get("metrics")
            if isinstance(metrics, Mapping):
                self._trained(_int(line.get("step")), _number(line.get("time_s")), metrics)

    def _trained(self, step: int, now_s: float, m: Mapping[str, object]) -> None:
        self._tokens += _number(m.get("tokens"))
        done = step + 1
        if done % self._every and done != self._total:
            return
        elapsed = now_s - self._since_s if self._since_s is not None else 0.0
        rate = f"{self._tokens / elapsed:,.0f}" if elapsed > 0 else "-"
        parts = [
            f"step {done}/{self._total}",
            f"v{_int(m.get('version'))}",
            f"reward {_number(m.get('reward_mean')):.3f}",
            f"loss {_number(m.get('loss')):.4g}",
            f"tokens/s {rate}",
            f"staleness {_number(m.get('staleness_mean')):.1f} "
            f"(max {_int(m.get('staleness_max'))})",
            f"trainer wait {self._wait_s - self._wait_at_line_s:.1f} s",
        ]
        if self._eval is not None:
            parts.append(_held_out(self._eval))
            self._eval = None
        self._emit("  ".join(parts))
        self._tokens, self._since_s, self._wait_at_line_s = 0.0, now_s, self._wait_s


def _held_out(e: Mapping[str, object]) -> str:
    return (
        f"held-out reward {_number(e.get('reward_mean')):.3f}, "
        f"success {100 * _number(e.get('accuracy')):.1f}% (v{_int(e.get('version'))})"
    )


def summary_table(report: Mapping[str, object]) -> str:
    """The end of a run in a few readable lines (the whole report is `summary.json`)."""
    extra = report.get("extra")
    extra = extra if isinstance(extra, Mapping) else {}
    rows = [
        ("mode", str(report.get("mode", ""))),
        ("steps trained", f"{_int(report.get('steps_trained'))} of {_int(report.get('steps'))}"),
        ("wall time", f"{_number(report.get('wall_s')):,.1f} s"),
        (
            "groups",
            f"{_int(extra.get('admitted')):,} admitted = {_int(extra.get('consumed')):,} trained"
            f" + {_int(extra.get('filtered')):,} filtered"
            f" + {_int(extra.get('rolled_back')):,} rolled back"
            f" + {_int(extra.get('unassigned')):,} left",
        ),
        ("samples masked", f"{_int(extra.get('masked_samples')):,}"),
        ("trainer wait", f"{_number(report.get('trainer_wait_s')):,.1f} s"),
        ("most versions at once", str(_int(report.get("max_versions_serving")))),
    ]
    if "eval_last_accuracy" in extra:
        rows.append(
            (
                "held-out success",
                f"{100 * _number(extra.get('eval_first_accuracy')):.1f}% "
                f"(v{_int(extra.get('eval_first_version'))}) -> "
                f"{100 * _number(extra.get('eval_last_accuracy')):.1f}% "
                f"(v{_int(extra.get('eval_last_version'))})",
            )
        )
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"  {label:<{width}}  {value}" for label, value in rows)


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def _int(value: object) -> int:
    return int(value) if isinstance(value, int | float) else 0
