"""Workloads: what each group asks of the instances.

A group is `G` episodes of one prompt. An episode is one or more turns; each turn decodes some
tokens, then (except after the last) waits for a tool and appends the tool's tokens to the context.
Single-turn math is one turn.

Response lengths are log-normal and truncated at the maximum (the DAPO-Math shape: a median about
1/28 of the maximum, p99 more than 10x the median), or drawn from a file of real lengths
(`lengths_file`). Samples of one prompt share part of their log-length (`group_share`): hard
prompts give long answers to all their samples, which is what makes a group's last sample so late.
A lengths file keeps that in its own form: a file with one length per line is one pool (every
length drawn independently), and a file whose lines each hold the lengths of one measured group
is drawn a line per group, so a hard prompt's long answers arrive together as measured (a group
of another size takes that many of the line's lengths, without repeats while the line has enough;
`#` starts a comment, commas may separate). Draws
come from one seeded numpy generator in admission order, so a run is reproducible and every mode
sees the same stream of groups.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dora.costs import Setup, decode_seconds
from dora.errors import ConfigError

__all__ = ["Episode", "Workload", "chain_s", "read_lengths"]


@dataclass(slots=True)
class Episode:
    """One sample: the prompt, the decode length of every turn, tool latencies between them."""

    prompt: int
    turns: list[int]
    tool_s: list[float]

    @property
    def tokens(self) -> int:
        """Tokens the trainer sees: the prompt, every decoded token and every tool token."""
        return self.prompt + sum(self.turns) + self.tool_tokens

    tool_tokens: int = 0


def chain_s(setup: Setup, episode: Episode) -> float:
    """The least time `episode` can take from its first token to its last: each turn decoded alone
    on an instance (a batch of one, the fastest a sequence advances, over the context it has by
    then), and every tool's latency between turns. Prefill is left out, so this bounds any
    schedule from below."""
    co = setup.decode_coefficients()
    total = sum(episode.tool_s)
    ctx = float(episode.prompt)
    for j, n in enumerate(episode.turns):
        total += decode_seconds(co, 1, ctx, n)
        ctx += n + (setup.tool_tokens if j < len(episode.turns) - 1 else 0)
    return total


class Workload:
    """Draws groups of episodes for a `Setup`."""

    def __init__(self, setup: Setup, *, seed: int) -> None:
        self._s = setup
        self._rng = np.random.default_rng(seed)
        self._pool: np.ndarray | None = None
        self._groups: list[np.ndarray] = []
        if setup.lengths_file:
            lines = read_lengths(setup.lengths_file)
            if all(len(line) == 1 for line in lines):
                self._pool = np.concatenate(lines)
            else:
                self._groups = lines

    def group(self) -> list[Episode]:
        s, rng = self._s, self._rng
        g = s.group_size
        prompt = int(
            min(s.prompt_max, max(1, rng.lognormal(math.log(s.prompt_median), s.prompt_sigma)))
        )
        n_turns = np.ones(g, dtype=np.int64)
        if s.turns > 1:
            n_turns += rng.geometric(1.0 / s.turns, size=g) - 1
        total = int(n_turns.sum())
        if self._pool is not None:
            lengths = rng.choice(self._pool, size=total)
        elif self._groups:
            line = self._groups[int(rng.integers(len(self._groups)))]
            # a group of another size (or a multi-turn episode) draws from the measured line,
            # repeating answers only when it needs more than the line holds
            lengths = line if len(line) == total else rng.choice(line, total, total > len(line))
        else:
            # per-turn lengths share the prompt's part of the log-variance
            shared = rng.normal(0.0, s.response_sigma * math.sqrt(s.group_share))
            own = rng.normal(0.0, s.response_sigma * math.sqrt(1 - s.group_share), size=total)
            lengths = np.exp(math.log(s.response_median) + shared + own)
        lengths = np.clip(np.rint(lengths), 1, s.response_max).astype(np.int64)
        tools = rng.exponential(s.tool_latency_s, size=total) if s.tool_latency_s > 0 else None
        out: list[Episode] = []
        i = 0
        for n in n_turns.tolist():
            turns = lengths[i : i + n].tolist()
            tool_s = [0.0] * (n - 1) if tools is None else tools[i : i + n - 1].tolist()
            i += n
            ctx = prompt
            for j, m in enumerate(turns):  # the episode ends at the context limit
                ctx += m
                if ctx + s.tool_tokens >= s.context_max or j == n - 1:
                    turns = turns[: j + 1]
                    tool_s = tool_s[:j]
                    break
                ctx += s.tool_tokens
            out.append(Episode(prompt, turns, tool_s, s.tool_tokens * (len(turns) - 1)))
        return out


def read_lengths(path: str) -> list[np.ndarray]:
    """The lines of a lengths file: one length each, or each the lengths of one group."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"lengths_file {path!r}: {exc.strerror}") from None
    lines: list[np.ndarray] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            values = [int(float(v)) for v in line.replace(",", " ").split()]
        except (ValueError, OverflowError):
            values = []
        if not values:
            raise ConfigError(f"lengths_file {path!r} line {n}: not a number: {line!r}")
        if min(values) < 1:
            raise ConfigError(f"lengths_file {path!r} line {n}: lengths must be >= 1")
        lines.append(np.asarray(values, dtype=np.int64))
    if not lines:
        raise ConfigError(f"lengths_file {path!r} holds no lengths")
    if len({len(line) == 1 for line in lines}) > 1:
        raise ConfigError(
            f"lengths_file {path!r} mixes lines of one length with lines of a group's lengths"
        )
    return lines


@functools.lru_cache(maxsize=32)
def mean_stats(
    setup: Setup, *, seed: int = 12345, groups: int = 2000
) -> tuple[float, float, float]:
    """Monte-Carlo `(mean tokens per episode, mean decoded tokens per episode, time-averaged
    context of a decoding sequence)`, for the physical bound."""
    w = Workload(setup, seed=seed)
    tokens = decoded = weighted = 0.0
    for _ in range(groups):
        for e in w.group():
            tokens += e.tokens
            ctx = e.prompt
            for j, n in enumerate(e.turns):
                decoded += n
                weighted += n * (ctx + n / 2.0)
                ctx += n + (setup.tool_tokens if j < len(e.turns) - 1 else 0)
    n_ep = groups * setup.group_size
    return tokens / n_ep, decoded / n_ep, weighted / max(decoded, 1.0)
