"""verifiers environments as dora environments (verifiers >= 0.3.1, < 0.4), by either of its APIs.

The classic API, which the Environments Hub and `vf-eval` use: an installed environment, and as the
other keys the keyword arguments of its `load_environment` (`envs.verifiers.classic`).

```toml fragment
[env]
cls = "envs.verifiers:VerifiersEnv"
kwargs = { environment = "my-env", max_turns = 3 }
```

A `verifiers.v1` taskset (`envs.verifiers.tasksets`), with an optional held-out one:

```toml fragment
[env]
cls = "envs.verifiers:VerifiersEnv"
kwargs = { taskset = "my_taskset", eval_taskset = "my_taskset_eval", max_turns = 8 }
```

Either way the tasks are the training tasks (`data.source = "env"`), every model call of an
episode goes to the episode's endpoint (token-exact, one version; `dora.endpoint`), and each
weighted reward function is a reward component. A reward that is NaN or not a number masks the
sample with the reason; an environment that is not installed, whose loading raises, or that dora
cannot train on is a start-up error naming its key.

Not supported, each refused at start or masked with its reason: classic environments whose
rollouts run in a remote sandbox (`SandboxEnv`, `PythonEnv`, `CliAgentEnv` and their kin), that
roll out or score whole groups (group reward functions, `EnvGroup`s of those), judges (a
`JudgeRubric` calls its own judge model, not the policy); verifiers.v1 harnesses and runtimes
(dora runs the chat loop itself), multi-agent `Env`s, judges, toolsets with shared state and the
`@vf.metric`/`@vf.stop`/`@vf.intercept` hooks (not run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dora import AgentEnv, ConfigError, Task
from envs.verifiers.classic import Classic
from envs.verifiers.tasksets import Tasksets

__all__ = ["VerifiersEnv"]

TASKSET_KEYS = {"taskset", "config", "eval_taskset", "eval_config", "max_turns"}


class VerifiersEnv(AgentEnv):
    """A verifiers environment (`environment`) or taskset (`taskset`): see the module docstring."""

    def __init__(self, *, loaded: Classic | Tasksets | None = None, **kwargs: object) -> None:
        assert loaded is not None, "VerifiersEnv is built by load_env, after setup()"
        self.loaded = loaded

    @classmethod
    def setup(cls, **kwargs: object) -> Mapping[str, object]:
        """Load the environment or tasksets once per process: a start-up error names the key."""
        if bool(kwargs.get("environment")) == bool(kwargs.get("taskset")):
            raise ConfigError(
                "env.kwargs: name either environment (a verifiers environment) or taskset "
                "(a verifiers.v1 taskset), not both or neither"
            )
        if kwargs.get("environment"):
            return {"loaded": Classic.load(kwargs)}
        stray = sorted(set(kwargs) - TASKSET_KEYS)
        if stray:
            raise ConfigError(
                f"env.kwargs {stray}: a verifiers taskset takes {sorted(TASKSET_KEYS)}"
            )
        return {"loaded": Tasksets.load(kwargs)}

    def tasks(self, split: str, **kwargs: object) -> Sequence[Task] | None:
        """`train`: the training tasks; `test`: the held-out ones (None without them)."""
        return self.loaded.tasks(split)

    async def agent(self, base_url: str, model: str, task: Task) -> dict[str, float]:
        return await self.loaded.agent(base_url, model, task)
