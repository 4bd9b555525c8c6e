"""The emulated model: what an emulated instance samples, as a pure function of the request.

There are no weights. A response's length and its tokens are a deterministic function of (the
episode's prompt, its sample index, the turn, the seed), drawn from the simulator's workload
(`dora.costs.Setup`: log-normal lengths truncated at `response_max`, with `group_share` of the
log-variance common to a prompt's samples), so every mode generates exactly the same work and the
same token ids, whatever the order, the instance or the interruptions. Token ids are drawn from
the vocabulary (above the special tokens), behaviour logprobs from an exponential distribution:
downstream, everything is the real data path.

Which sample: the episode id is the request id without its call suffix (`{group}/{index}#{call}`,
what `dora.serve.router` sends); the index is the part after the last `/` (0 when there is none).
The prompt is the context of the episode's first call. One `EmulatedModel` is shared by every
instance of the process (they hold the same weights): it remembers, per episode, where the
current turn started, so that a resubmitted continuation (partial rollout's abort and resume, a
migration without the KV cache, an import) continues the same response, and a longer context
(the environment appended its reply) starts the next turn. The memory is bounded (least recently
used episodes are forgotten first).
"""

from __future__ import annotations

import math
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dora.costs import Setup
from dora.errors import ConfigError

__all__ = ["EmulatedModel", "Plan"]

_MEMORY = 200_000
"""Episodes remembered: several steps of the paper's 8,192 episodes."""


@dataclass(slots=True)
class _Episode:
    key: int
    index: int
    turn: int
    turn_start: int
    length: int
    prefix: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    """What one call continues: the episode's turn, the tokens of it already sampled (`offset`)
    and the turn's whole length."""

    key: int
    index: int
    turn: int
    offset: int
    length: int
    prefix: int = 0
    """Context tokens whose KV cache the episode kept from its previous turn (held in host
    memory while the tool ran, as the simulator assumes): only the rest is prefilled."""


class EmulatedModel:
    """Response lengths and tokens of the workload of `setup`, keyed by `seed`."""

    def __init__(self, setup: Setup, *, seed: int, vocab_size: int, first_token: int = 0) -> None:
        if setup.lengths_file:
            raise ConfigError(
                "emulated instances draw the preset's log-normal lengths; lengths_file is not "
                f"supported (preset {setup.name!r})"
            )
        if not 0 <= first_token < vocab_size:
            raise ConfigError(f"first_token {first_token} outside the vocabulary of {vocab_size}")
        self.setup = setup
        self.seed = seed
        self.vocab_size = vocab_size
        self.first_token = first_token
        self._episodes: OrderedDict[str, _Episode] = OrderedDict()

    def length(self, key: int, index: int, turn: int) -> int:
        """Tokens of turn `turn` of sample `index` of the prompt `key`."""
        s = self.setup
        shared = np.random.default_rng([self.seed, key]).normal(
            0.0, s.response_sigma * math.sqrt(s.group_share)
        )
        own = np.random.default_rng([self.seed, key, index, turn]).normal(
            0.0, s.response_sigma * math.sqrt(1.0 - s.group_share)
        )
        value = math.exp(math.log(s.response_median) + float(shared) + float(own))
        return int(min(s.response_max, max(1, round(value))))

    def plan(self, request_id: str, prompt_ids: Sequence[int]) -> Plan:
        """Where a call with this context stands in its episode (see the module docstring)."""
        episode = request_id.rsplit("#", 1)[0]
        ep = self._episodes.get(episode)
        n = len(prompt_ids)
        if ep is not None:
            self._episodes.move_to_end(episode)
            done = n - ep.turn_start
            if done < 0:  # a shorter context: the episode started again (a restarted group)
                ep = None
            elif done >= ep.length:  # the environment answered: the next turn
                ep.prefix = ep.turn_start + ep.length
                ep.turn += 1
                ep.turn_start = n
                ep.length = self.length(ep.key, ep.index, ep.turn)
                done = 0
        if ep is None:
            tail = episode.rsplit("/", 1)
            index = int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else 0
            key = zlib.crc32(np.asarray(prompt_ids, dtype=np.int32).tobytes())
            ep = _Episode(key, index, 0, n, self.length(key, index, 0))
            self._episodes[episode] = ep
            while len(self._episodes) > _MEMORY:
                self._episodes.popitem(last=False)
            done = 0
        return Plan(ep.key, ep.index, ep.turn, done, ep.length, ep.prefix if done == 0 else 0)

    def tokens(self, plan: Plan, start: int, count: int) -> tuple[array[int], array[float]]:
        """Token ids and behaviour logprobs of positions `start .. start + count` of the turn, as
        typed arrays (int32, float32)."""
        rng = np.random.default_rng([self.seed, plan.key, plan.index, plan.turn, 1])
        end = start + count
        ids = rng.integers(self.first_token, self.vocab_size, size=end)[start:]
        logprobs = -rng.exponential(1.0, size=end)[start:]
        return (
            array("i", ids.astype(np.int32).tobytes()),
            array("f", logprobs.astype(np.float32).tobytes()),
        )
