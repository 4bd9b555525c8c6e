"""tau2's domains, tasks and reward, reached without importing litellm.

`tau2.registry` (through the agents) and `tau2.evaluator.evaluator` (through the NL-assertion
judge) import litellm at import time; litellm has shipped malicious releases, so dora never imports
it. This module imports each domain's `environment` module and the three offline evaluators (DB and
env assertions, actions, communicate) directly, and combines them exactly as tau2's
`evaluate_simulation` does for `EvaluationType.ALL`: the task reward is the **product** of the
components in the task's `reward_basis`. NL assertions are judged by `envs.tau2.judge` (our own
async client) when a judge endpoint is configured; otherwise they are left out of the product and
`Tau2Score.nl_skipped` says so.

Partial credit: `Tau2Score.partial` is the fraction of the individual checks in the reward basis
that passed (the DB match, each env assertion, each reference action, each piece of information to
communicate, each NL assertion when judged). The env can add it to the reward with a weight; tau2's
own reward is all-or-nothing.

Scoring builds two or three tau2 environments (airline: about 0.4 s each), so callers run it in a
worker thread, not on the event loop.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

from dora import ConfigError

if TYPE_CHECKING:
    from tau2.data_model.message import Message as Tau2Message
    from tau2.data_model.tasks import Task as Tau2Task
    from tau2.environment.environment import Environment

DOMAINS = ("mock", "airline", "retail", "telecom")
# tau2's registry registers the telecom domain with its manual policy.
_ENV_FACTORY = {
    "mock": "get_environment",
    "airline": "get_environment",
    "retail": "get_environment",
    "telecom": "get_environment_manual_policy",
}


@functools.cache
def _domain_module(domain: str) -> ModuleType:
    # tau2 logs through loguru at DEBUG (every tool response) and warns about a missing .env file
    # on import; silence its namespace before the first import (`logger.enable("tau2")` undoes it).
    from loguru import logger

    logger.disable("tau2")
    return importlib.import_module(f"tau2.domains.{domain}.environment")


def environment_factory(domain: str) -> Callable[..., Environment]:
    """tau2's constructor of a fresh environment (tools, database, policy) of `domain`."""
    module = _domain_module(domain)
    factory: Callable[..., Environment] = getattr(module, _ENV_FACTORY[domain])
    return factory


@functools.cache
def domain_tasks(domain: str, split: str | None = None) -> tuple[Tau2Task, ...]:
    """The tasks of `domain` (all of them, or one split: `train`, `test`, `base`; telecom also has
    `small` and `full`), cached: they are read-only."""
    module = _domain_module(domain)
    if domain == "telecom" and split in ("small", "full"):
        return tuple(getattr(module, f"get_tasks_{split}")())
    try:
        return tuple(module.get_tasks(split))
    except ValueError as exc:  # tau2's message lists the valid splits
        raise ConfigError(f"tau2 {domain}: {exc}") from exc


@functools.cache
def task_by_id(domain: str, task_id: str) -> Tau2Task:
    for task in domain_tasks(domain, None) + (
        domain_tasks(domain, "full") if domain == "telecom" else ()
    ):
        if task.id == task_id:
            return task
    raise KeyError(f"tau2 domain {domain!r} has no task {task_id!r}")


@dataclass(frozen=True)
class Tau2Score:
    """tau2's verdict on one trajectory."""

    reward: float
    """tau2's task reward: the product of the reward-basis components (0 or 1)."""
    partial: float
    """Fraction of the individual checks that passed (1.0 when there are none)."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """Reward of each component in the basis, e.g. {"DB": 1.0, "COMMUNICATE": 0.0}."""
    nl_skipped: bool = False
    """The basis has NL_ASSERTION but no judge was configured, so it was left out."""


def nl_assertions(task: Tau2Task) -> list[str]:
    """The task's NL assertions that count toward its reward (empty if NL is not in the basis)."""
    from tau2.data_model.tasks import RewardType

    criteria = task.evaluation_criteria
    if criteria is None or RewardType.NL_ASSERTION not in criteria.reward_basis:
        return []
    return list(criteria.nl_assertions or [])


def score(
    *,
    domain: str,
    task: Tau2Task,
    trajectory: Sequence[Tau2Message],
    nl_met: Sequence[bool] | None = None,
) -> Tau2Score:
    """Score a finished trajectory (which must include the task's message history) as tau2 does.

    `nl_met` holds the judge's verdict on each of `nl_assertions(task)`, or None if there is no
    judge.
    """
    from tau2.data_model.tasks import RewardType
    from tau2.evaluator.evaluator_action import ActionEvaluator
    from tau2.evaluator.evaluator_communicate import CommunicateEvaluator
    from tau2.evaluator.evaluator_env import EnvironmentEvaluator

    criteria = task.evaluation_criteria
    if criteria is None:
        return Tau2Score(reward=1.0, partial=1.0)
    messages = list(trajectory)
    env_info = EnvironmentEvaluator.calculate_reward(
        environment_constructor=environment_factory(domain), task=task, full_trajectory=messages
    )
    action_info = ActionEvaluator.calculate_reward(task=task, full_trajectory=messages)
    comm_info = CommunicateEvaluator.calculate_reward(task=task, full_trajectory=messages)

    basis = set(criteria.reward_basis)
    reward = 1.0
    breakdown: dict[str, float] = {}
    checks: list[bool] = []
    if basis & {RewardType.DB, RewardType.ENV_ASSERTION}:
        reward *= env_info.reward
        breakdown.update({str(k.value): v for k, v in (env_info.reward_breakdown or {}).items()})
        if RewardType.DB in basis and env_info.db_check is not None:
            checks.append(env_info.db_check.db_match)
        if RewardType.ENV_ASSERTION in basis:
            checks += [c.met for c in env_info.env_assertions or []]
    if RewardType.ACTION in basis:
        reward *= action_info.reward
        breakdown[RewardType.ACTION.value] = action_info.reward
        checks += [c.action_match for c in action_info.action_checks or []]
    if RewardType.COMMUNICATE in basis:
        reward *= comm_info.reward
        breakdown[RewardType.COMMUNICATE.value] = comm_info.reward
        checks += [c.met for c in comm_info.communicate_checks or []]
    nl_skipped = False
    if RewardType.NL_ASSERTION in basis:
        if nl_met is None:
            nl_skipped = bool(criteria.nl_assertions)
        else:
            nl_reward = 1.0 if all(nl_met) else 0.0
            reward *= nl_reward
            breakdown[RewardType.NL_ASSERTION.value] = nl_reward
            checks += list(nl_met)
    partial = sum(checks) / len(checks) if checks else 1.0
    return Tau2Score(reward=reward, partial=partial, breakdown=breakdown, nl_skipped=nl_skipped)
