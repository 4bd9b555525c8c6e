"""A small OpenEnv environment for the OpenEnv adapter's tests, written as an OpenEnv user writes
one: an `Environment` with its own `Action` and `Observation` (pydantic, OpenEnv's base classes),
served by OpenEnv's `create_fastapi_app` (its `/health`, `/schema` and `/ws` session protocol).

The game: say a word. `reset(seed)` draws the word from the seed; each `step` rewards
`STEP_REWARD` for speaking plus 1.0 when the message holds the word, and the episode is done when
it does or after `TURNS` steps. Every session's Environment object is kept in the `log` of the app
that served it, with the seed, the messages it got and the rewards it gave, so a test can compare
what the server computed with what dora trained on. `step` raises on a message containing "boom".
"""

from __future__ import annotations

from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

WORDS = ["go", "yes", "ok", "hi"]
TURNS = 3
STEP_REWARD = 0.25


class WordAction(Action):
    message: str


class WordObservation(Observation):
    prompt: str = ""
    turn: int = 0


class TwoTextAction(Action):
    """An action with two text fields: the adapter cannot guess which one the reply fills."""

    message: str
    note: str


class WordEnvironment(Environment):  # type: ignore[type-arg]
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, log: list[WordEnvironment] | None = None) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self.seed: int | None = None
        self.word = ""
        self.messages: list[str] = []
        self.rewards: list[float] = []
        self.closed = False
        if log is not None:
            log.append(self)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Any:
        self.seed = seed
        self.word = WORDS[(seed or 0) % len(WORDS)]
        self._state = State(step_count=0)
        return WordObservation(prompt=f"Say {self.word}.", turn=0)

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        if "boom" in action.message:
            raise ValueError("the word environment blew up")
        self._state.step_count += 1
        hit = self.word in action.message
        reward = STEP_REWARD + (1.0 if hit else 0.0)
        self.messages.append(action.message)
        self.rewards.append(reward)
        done = hit or self._state.step_count >= TURNS
        return WordObservation(
            prompt="Right." if hit else f"No. Say {self.word}.",
            turn=self._state.step_count,
            reward=reward,
            done=done,
        )

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        self.closed = True


def make_app(
    *, max_sessions: int = 64, action_cls: type[Action] = WordAction
) -> tuple[Any, list[WordEnvironment]]:
    """An OpenEnv app of the word game and the log of its sessions' environments."""
    log: list[WordEnvironment] = []
    app = create_fastapi_app(
        lambda: WordEnvironment(log),
        action_cls,
        WordObservation,
        max_concurrent_envs=max_sessions,
    )
    return app, log


app, sessions = make_app()
"""What `env.kwargs.app = "openenv_words:app"` serves."""


def shout(reply: str, observation: dict[str, Any]) -> WordAction:
    """An `action` hook: the reply in capitals, as the environment's own Action."""
    return WordAction(message=reply.upper())


def with_turn(observation: dict[str, Any]) -> str:
    """A `prompt` hook: the observation's prompt and its turn."""
    return f"[turn {observation['turn']}] {observation['prompt']}"
