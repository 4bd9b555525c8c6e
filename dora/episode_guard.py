"""The episode runner's guard around the environment: its hooks off the event loop under their
deadlines (`Hooks`), the tokenizer on its text (`guarded`), and the checks of what its hooks return
(`check_reply`, `reward_total`). Every failure is an `EnvFailure`, which masks the episode's sample
with a message whose head names the hook and what went wrong: the reason serve counts.

The rule for rewards, one for every shape: a reward is a real number (Python's or numpy's, not a
bool) or a mapping of names to such numbers, all finite; anything else (text such as "0.5", a list,
None) is refused, never parsed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
from collections.abc import Callable, Mapping
from typing import TypeVar, cast

from dora.env import Env, Message
from dora.errors import ChatTemplateMissing
from dora.hooks import HookTimeout, OffLoop, call_hook
from dora.protocol import FinishReason

__all__ = ["SAMPLER_ENDED", "EnvFailure", "Hooks", "check_reply", "guarded", "reward_total"]

SAMPLER_ENDED = "the sampler ended the request"
"""The head of the error of an episode whose LLM call the instance refused or abandoned."""

log = logging.getLogger("dora.env")


class EnvFailure(Exception):
    """Internal: an environment hook raised; carries the finish reason for the masked sample."""

    def __init__(self, message: str, finish_reason: FinishReason = "error") -> None:
        super().__init__(message)
        self.finish_reason = finish_reason


_INLINE_DEFAULTS = frozenset({Env.tools, Env.step})
"""The base class's own trivial hooks: they run on the loop (no thread hop per episode)."""


class Hooks:
    """The environment hooks of one episode: each under its deadline, synchronous ones in a
    worker thread lent for the call (`dora.hooks`); any failure is an `EnvFailure` naming the
    hook."""

    def __init__(self) -> None:
        self.threads = OffLoop(1, name="dora-env")

    async def call(
        self, what: str, fn: Callable[..., object], *args: object, timeout_s: float
    ) -> object:
        inline = getattr(fn, "__func__", None) in _INLINE_DEFAULTS
        try:
            return await call_hook(None if inline else self.threads, fn, *args, timeout_s=timeout_s)
        except HookTimeout as exc:
            raise EnvFailure(f"{what} {exc}") from exc
        except (asyncio.CancelledError, ChatTemplateMissing):
            raise  # a model that cannot render chat messages is the config's error, not the env's
        except Exception as exc:
            log.warning("environment %s raised", what, exc_info=True)
            raise EnvFailure(f"{what} raised {type(exc).__name__}: {exc}") from exc


T = TypeVar("T")


def guarded(what: str, fn: Callable[..., T], *args: object) -> T:
    """The tokenizer (or the chat template) on the environment's text, on the loop: text it
    refuses (a lone surrogate, a message it cannot render) fails the episode, not serve."""
    try:
        return fn(*args)
    except ChatTemplateMissing:
        raise
    except Exception as exc:
        log.warning("%s raised", what, exc_info=True)
        raise EnvFailure(f"{what} raised {type(exc).__name__}: {exc}") from exc


R = TypeVar("R", list[Message], str)


def check_reply(raw: object, kind: type[R]) -> tuple[R, bool]:
    """`step`'s return value, checked: a (reply, done) pair whose reply has the episode's kind.
    An empty reply (`[]` or `""`, the default `step`'s) is no reply in either kind."""
    if (
        isinstance(raw, tuple)
        and len(raw) == 2
        and isinstance(raw[0], (list, str))
        and not raw[0]
        and isinstance(raw[1], bool)
    ):
        return kind(), raw[1]
    if (
        not isinstance(raw, tuple)
        or len(raw) != 2
        or not isinstance(raw[0], kind)
        or not isinstance(raw[1], bool)
    ):
        what = "a list of messages" if kind is list else "text"
        raise EnvFailure(f"step() must return ({what}, done: bool), got {raw!r:.200}")
    if kind is list and not all(isinstance(m, dict) and "role" in m for m in raw[0]):
        raise EnvFailure(f"step() returned a reply that is not a list of messages: {raw[0]!r:.200}")
    return raw[0], raw[1]


def _is_number(value: object) -> bool:
    """A real number (Python's or numpy's), not a bool and not text: one rule for a reward and
    for each of its components."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def reward_total(reward: object) -> tuple[float, dict[str, float]]:
    """The reward and its components. A ValueError or TypeError otherwise, whose message follows
    "reward returned": text, a list, a bool are refused (never parsed), and so is a NaN or an
    infinity (it would poison the group's advantages and then every weight the trainer
    touches)."""
    if isinstance(reward, Mapping):
        bad = {k: v for k, v in reward.items() if not _is_number(v)}
        if bad:
            raise TypeError(f"components that are not numbers: {bad!r:.200}")
        components = {str(k): float(v) for k, v in reward.items()}
        nonfinite = {k: v for k, v in components.items() if not math.isfinite(v)}
        if nonfinite:
            raise ValueError(f"components that are not finite: {nonfinite}")
        total = sum(components.values())
        if not math.isfinite(total):
            raise ValueError(f"components whose sum is not finite: {components}")
        return total, components
    if _is_number(reward):
        value = float(cast(float, reward))
        if not math.isfinite(value):
            raise ValueError(f"a value that is not finite: {value}")
        return value, {}
    raise TypeError(
        f"a {type(reward).__name__}, not a number or a dict of numbers: {reward!r:.100}"
    )
