"""`OpenEnvEnv`: a dora environment over an OpenEnv environment server, one session per episode.

An episode, over OpenEnv's WebSocket client (`GenericEnvClient`, observations and actions as JSON
objects):

1. `reset(task)` opens a session and resets it with the task's `seed` (and the keyword arguments
   in the task's `reset` mapping, which the server passes on to its `Environment.reset` where that
   accepts them). The observation becomes the user message (or the plain-text prompt).
2. Each model turn becomes an action and goes to `step`: by default `{field: reply}`, `field`
   being `action_field` or else the action schema's only text field (from the server's `/schema`,
   or from `action_cls`); `action` names a function `(reply, observation) -> action` instead. The
   observation that comes back is the next user message; its `done` ends the episode.
3. The reward is the sum of the steps' rewards (`reward_mode = "sum"`), or the last step's
   (`"last"`): observations report one per step, and reset's reward is not counted. A reward the
   server leaves out (None) counts 0. An episode cut short by dora (`rollout.max_turns`, a token
   budget) keeps what its steps earned: a turn that never reached `step` earns nothing.
4. `close()` ends the session.

Everything that goes wrong with the server inside an episode (it refuses the action, raises in
its `step`, is at capacity, goes away, does not answer within `timeout_s`) is an `EnvError` naming
the call and the server: dora masks that episode's sample with the reason. Start-up problems (no
server at `url`, an `app` or hook that does not import, an action with no text field to fill) are
`ConfigError`s naming the key, raised when the environment is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import zlib
from collections.abc import Callable, Mapping
from typing import Any, Literal

from dora import ConfigError, Env, EnvError, Episode, Message, Reply, Task, load_object
from envs.openenv.server import JSON, OpenEnvServer, SessionLimit, check_one_source, text_field

CLOSE_WAIT_S = 10.0
"""How long `close` waits for the server to close a session's connection (well inside the runner's
deadline for `close`) before closing it from this side."""
HELD_OUT_SEED_OFFSET = 1_000_000
"""The reset seeds of one split of one `data.seed`: "train" of seed s starts at 2 s times this,
the other splits at 2 s + 1 times this, so held-out episodes never repeat training ones."""


class OpenEnvEnv(Env):
    """One OpenEnv session per episode. Keyword arguments are the `[env.kwargs]`."""

    def __init__(
        self,
        *,
        url: str = "",
        app: str = "",
        action_field: str = "",
        action: str = "",
        action_cls: str = "",
        observation_field: str = "",
        prompt: str = "",
        system_prompt: str = "",
        chat: bool = True,
        reward_mode: Literal["sum", "last"] = "sum",
        max_sessions: int = 0,
        timeout_s: float = 60.0,
        server: OpenEnvServer | None = None,
    ) -> None:
        if reward_mode not in ("sum", "last"):
            raise ConfigError(f"env.kwargs.reward_mode={reward_mode!r}: use 'sum' or 'last'")
        if max_sessions < 0:
            raise ConfigError(f"env.kwargs.max_sessions={max_sessions}: use 0 (no limit) or more")
        if timeout_s <= 0:
            raise ConfigError(f"env.kwargs.timeout_s={timeout_s}: use a positive number of seconds")
        check_one_source(url=url, app=app)
        self.url, self.app = url, app
        self.observation_field = observation_field
        self.system_prompt = system_prompt
        self.chat = chat
        self.reward_mode = reward_mode
        self.max_sessions = max_sessions
        self.timeout_s = timeout_s
        self._build_action = _hook("action", action) if action else None
        self._render = _hook("prompt", prompt) if prompt else None
        self._action_cls = _action_class(action_cls) if action_cls else None
        self._action_field = action_field
        self._server = server
        self._field: str | None = None
        self._owns_server = False  # resolved here (built without `setup`): close() closes it
        self._client: Any = None
        self._session: object = None
        self._observation: JSON = {}
        self._rewards: list[float | None] = []
        if server is not None:
            self._field = self._text_field(server)

    @classmethod
    def setup(cls, **kwargs: object) -> Mapping[str, object]:
        """The server every episode of this process uses, found (or started) and probed once."""
        if kwargs.get("server") is not None:
            return {}
        max_sessions, timeout_s = kwargs.get("max_sessions", 0), kwargs.get("timeout_s", 60.0)
        if not isinstance(max_sessions, int) or not isinstance(timeout_s, int | float):
            raise ConfigError("env.kwargs.max_sessions and env.kwargs.timeout_s must be numbers")
        server = OpenEnvServer.resolve(
            url=str(kwargs.get("url", "")),
            app=str(kwargs.get("app", "")),
            max_sessions=max_sessions,
            timeout_s=float(timeout_s),
        )
        return {"server": server}

    def tasks(self, split: str, n: int = 256, *, seed: int = 0) -> list[Task]:  # type: ignore[override]
        """`n` episodes of `split`, each its reset seed. Each `data.seed` has a block of
        `HELD_OUT_SEED_OFFSET` reset seeds for "train" and the next block for the other splits
        (seed 0: "train" 0.., held out 1,000,000..), so neither another seed's episodes nor
        held-out ones repeat training ones. An OpenEnv environment draws its own episode from the
        reset seed. (At start, serve measures each task's prompt: one session per task.)"""
        block = 2 * seed + (0 if split == "train" else 1)
        base = block * HELD_OUT_SEED_OFFSET
        if seed < 0 or n > HELD_OUT_SEED_OFFSET or (2 * seed + 2) * HELD_OUT_SEED_OFFSET > 2**31:
            last_seed = 2**31 // (2 * HELD_OUT_SEED_OFFSET) - 1
            raise ConfigError(
                f"data.seed = {seed} with {n} tasks: OpenEnv reset seeds stay under 2**31 (32-bit "
                f"generators) and a split holds at most {HELD_OUT_SEED_OFFSET:,} tasks "
                f"(data.seed 0 to {last_seed})"
            )
        return [Task(f"{split}-{i}", {"seed": base + i}) for i in range(n)]

    # --- the episode ------------------------------------------------------------------------

    async def reset(self, task: Task) -> list[Message] | str:
        server = await self._ready_server()
        self._session = await server.sessions.acquire()
        self._client = server.client_cls(
            base_url=server.url, connect_timeout_s=self.timeout_s, message_timeout_s=self.timeout_s
        )
        result = await self._call("reset", self._client.reset(**reset_kwargs(task)))
        if result.done:
            raise EnvError(f"OpenEnv reset at {server.url} returned an observation that is done")
        self._observation = result.observation
        text = await self._text(result.observation)
        if not self.chat:
            return f"{self.system_prompt}\n\n{text}" if self.system_prompt else text
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": text})
        return messages

    async def step(self, messages: list[Message] | str) -> Reply:
        if self._client is None:
            raise EnvError("step() before reset()")
        reply = messages if isinstance(messages, str) else str(messages[-1].get("content", ""))
        action = await self._action(reply)
        result = await self._call("step", self._client.step(action))
        self._rewards.append(_reward_value(result.reward))
        self._observation = result.observation
        text = await self._text(result.observation)
        if not self.chat:
            return f"\n{text}\n", bool(result.done)
        return [{"role": "user", "content": text}], bool(result.done)

    def reward(self, episode: Episode) -> float:
        if self.reward_mode == "last":
            last = self._rewards[-1] if self._rewards else None
            return 0.0 if last is None else last
        return float(sum(r for r in self._rewards if r is not None))

    async def close(self) -> None:
        """End the session (the server drops its Environment) and give the slot back."""
        client, self._client = self._client, None
        session, self._session = self._session, None
        try:
            if client is not None:
                await self._end_session(client)
        finally:
            SessionLimit.release(session)  # type: ignore[arg-type]
            if self._owns_server and self._server is not None:
                self._server.close()

    # --- pieces -----------------------------------------------------------------------------

    async def _end_session(self, client: Any) -> None:
        """Ask the server to end the session and let it close the connection, then close ours.

        `GenericEnvClient.close()` sends "close" and closes its side at once; OpenEnv's server
        (0.3) then closes a connection that is gone, and logs a traceback for most sessions.
        Waiting for the server's close first (its connection attribute is `_ws`) ends cleanly.
        """
        from websockets.exceptions import ConnectionClosed

        ws = getattr(client, "_ws", None)
        if ws is not None:
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                await ws.send(json.dumps({"type": "close"}))
                async with asyncio.timeout(min(self.timeout_s, CLOSE_WAIT_S)):
                    await ws.wait_closed()
        await client.close()

    async def _ready_server(self) -> OpenEnvServer:
        if self._server is None:  # built directly, not by load_env: resolve it for this episode
            self._server = await asyncio.to_thread(
                OpenEnvServer.resolve,
                url=self.url,
                app=self.app,
                max_sessions=self.max_sessions,
                timeout_s=self.timeout_s,
            )
            self._owns_server = True
            self._field = self._text_field(self._server)
        return self._server

    def _text_field(self, server: OpenEnvServer) -> str | None:
        """The action field the reply fills (None when the `action` hook builds actions)."""
        if self._build_action is not None:
            return None
        schema = (
            self._action_cls.model_json_schema()
            if self._action_cls is not None
            else server.action_schema
        )
        where = f"env.kwargs.action_cls={self._action_cls!r}" if self._action_cls else "the server"
        if self._action_field:
            if self._action_field not in (schema.get("properties") or {}):
                fields = ", ".join(schema.get("properties") or {}) or "none"
                raise ConfigError(
                    f"env.kwargs.action_field={self._action_field!r}: the action of {where} has "
                    f"no such field (its fields: {fields})"
                )
            return self._action_field
        return text_field(schema, key=f"the action of {where}")

    async def _action(self, reply: str) -> object:
        """The action for the model's `reply`: the `action` hook's, or the text field filled."""
        if self._build_action is not None:
            action = self._build_action(reply, dict(self._observation))
            if inspect.isawaitable(action):
                action = await action
        elif self._field is None:  # only with the hook, which the branch above took
            raise EnvError("no action field and no action hook")
        elif self._action_cls is not None:
            action = self._action_cls(**{self._field: reply})
        else:
            action = {self._field: reply}
        if hasattr(action, "model_dump"):
            return action.model_dump()
        if not isinstance(action, dict):
            raise EnvError(
                f"the action hook returned {type(action).__name__}, not a dict or Action"
            )
        return action

    async def _text(self, observation: JSON) -> str:
        """The observation as the text the model reads (see `observation_text`, or the hook)."""
        if self._render is not None:
            text = self._render(dict(observation))
            if inspect.isawaitable(text):
                text = await text
            if not isinstance(text, str):
                raise EnvError(f"the prompt hook returned {type(text).__name__}, not a str")
            return text
        return observation_text(observation, field=self.observation_field)

    async def _call(self, what: str, call: Any) -> Any:
        """Await an OpenEnv client call; any failure is an EnvError naming it and the server."""
        from websockets.exceptions import ConnectionClosed

        url = self._server.url if self._server is not None else self.url
        try:
            return await call
        except ConnectionClosed as exc:
            said = await self._last_word()
            raise EnvError(
                f"OpenEnv {what} at {url}: the server closed the session"
                f"{f': {said}' if said else ''} ({type(exc).__name__}: {exc})"
            ) from exc
        except Exception as exc:
            raise EnvError(f"OpenEnv {what} at {url}: {type(exc).__name__}: {exc}") from exc

    async def _last_word(self) -> str:
        """The error the server sent before it closed the session, if one is still unread.

        A server at capacity (or whose environment factory fails) sends its error and closes the
        connection as soon as it opens; the client's next send then fails on the closed connection
        before it reads that error. The error is the reason worth reporting.
        """
        from websockets.exceptions import ConnectionClosed

        ws = getattr(self._client, "_ws", None)
        if ws is None:
            return ""
        try:
            async with asyncio.timeout(1.0):
                message = json.loads(await ws.recv())
        except (ConnectionClosed, TimeoutError, ValueError):
            return ""
        data = message.get("data") if isinstance(message, dict) else None
        if not isinstance(data, dict) or message.get("type") != "error":
            return ""
        return f"{data.get('message', '')} (code: {data.get('code', 'UNKNOWN')})"


def reset_kwargs(task: Task) -> JSON:
    """What `reset` sends: the task's `seed` (else one derived from its id), and its `reset`
    mapping's items."""
    seed = task.data.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        seed = zlib.crc32(task.prompt_id.encode())
    extra = task.data.get("reset") or {}
    if not isinstance(extra, Mapping):
        raise EnvError(f"task {task.prompt_id!r}: its 'reset' field is not a mapping")
    return {"seed": seed, **extra}


def observation_text(observation: JSON, *, field: str = "") -> str:
    """The text of an observation: its `field` when set; else its only string field; else all its
    fields as JSON (OpenEnv leaves `reward`, `done` and `metadata` out of the observation)."""
    if field:
        if field not in observation:
            raise EnvError(
                f"the observation has no field {field!r} (env.kwargs.observation_field); "
                f"its fields: {', '.join(observation) or 'none'}"
            )
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    strings = [v for v in observation.values() if isinstance(v, str)]
    if len(strings) == 1:
        return strings[0]
    return json.dumps(observation, ensure_ascii=False, sort_keys=True, default=str)


def _reward_value(raw: object) -> float | None:
    """An observation's reward as a float (a bool counts 0 or 1); anything but a number is an
    EnvError (dora masks a NaN reward itself)."""
    if raw is None:
        return None
    if isinstance(raw, bool | int | float):
        return float(raw)
    raise EnvError(f"the observation's reward is {raw!r}, not a number")


def _hook(name: str, spec: str) -> Callable[..., Any]:
    try:
        fn = load_object(spec)
    except ConfigError as exc:
        raise ConfigError(f"env.kwargs.{name}={spec!r}: {exc}") from exc
    if not callable(fn):
        raise ConfigError(f"env.kwargs.{name}={spec!r} is {fn!r}, not a function")
    return fn


def _action_class(spec: str) -> Any:
    try:
        cls = load_object(spec)
    except ConfigError as exc:
        raise ConfigError(f"env.kwargs.action_cls={spec!r}: {exc}") from exc
    if not (isinstance(cls, type) and hasattr(cls, "model_json_schema")):
        raise ConfigError(
            f"env.kwargs.action_cls={spec!r} is {cls!r}, not an OpenEnv Action class "
            "(a pydantic model, subclass of openenv.core.env_server.Action)"
        )
    return cls
