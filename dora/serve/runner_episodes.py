"""An episode runner: runs the episodes serve sends it, in its own process and event loop.

`dora runner --connect ADDRESS CONFIG [key=value ...]` (serve starts `serve.runners` of them
itself). The runner builds what an episode needs from the run's config, as serve would: the
environment (`env.cls`), the renderer (the initial model's tokenizer, `dora.models.prepare`),
the episode limits. It says hello with the run's token (`serve.token`, the run's secret in
`log.run_dir`, or `DORA_RUNNER_TOKEN` from the serve that started it) over the trainer link's
CURVE keys when the config names them, and runs each `RunEpisode` with `run_fresh_episode`, the
code serve runs in-process. Its sampler asks serve for a route before each call and makes the
call itself to the instance named (one client per instance address, with sessions: serve names
each episode's session, and the runner releases it where the episode left or ended); the loop
that continues an interrupted call is serve's (`resubmit.complete_calls`). A call serve ends
first (the instance was declared dead) is cut here too. The runner has no other state: it can be
killed at any moment, and serve runs its episodes again.

A runner never admits anything: serve decides what runs; a runner without serve's `Welcome`
within `serve.request_timeout_s` stops (a refused hello is never answered).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio

from dora.config import DoraConfig
from dora.env import Env, Task
from dora.episode import ChatRenderer, EpisodeLimits, run_fresh_episode
from dora.errors import (
    DoraError,
    ProtocolError,
    RequestError,
    ServerError,
    ServerTimeout,
    ServerUnavailable,
)
from dora.instance import EngineClient, ExportedRequest
from dora.link import CurveKeys, check_client_keys, curve_client
from dora.protocol import Completion, SamplingParams
from dora.serve.resubmit import complete_calls, generate
from dora.serve.runner_wire import (
    Beat,
    CallDone,
    CallEnd,
    CoordinatorMessage,
    EpisodeDone,
    EpisodeFailed,
    NeedRoute,
    Route,
    RunEpisode,
    RunnerHello,
    RunnerMessage,
    StopEpisode,
    Welcome,
    decode_from_coordinator,
    encode,
)
from dora.serve.stats import ServeStats
from dora.serve.turns import Turns

__all__ = ["EpisodeRunner"]

log = logging.getLogger("dora.runner")

_Key = tuple[str, int, int]


class EpisodeRunner:
    """One runner's connection to serve and its episodes (see the module docstring)."""

    def __init__(
        self,
        *,
        address: str,
        name: str,
        token: str,
        config: DoraConfig,
        env_factory: Callable[[], Env],
        renderer: ChatRenderer,
        limits: EpisodeLimits,
    ) -> None:
        self.name = name
        self._token = token
        self._config = config
        self._env_factory, self._renderer, self._limits = env_factory, renderer, limits
        curve = CurveKeys.from_config(config.serve)
        check_client_keys(curve)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, config.serve.link_max_message_bytes)
        curve_client(self._sock, curve)
        self._sock.connect(address)
        self.address = address
        self._clients: dict[str, EngineClient] = {}
        self._cpu_at_start = 0.0
        """The process's CPU when serve welcomed it: start-up (imports, the tokenizer) is not
        work done for the run's episodes, as serve's own start-up is not."""
        self._answers: dict[_Key, asyncio.Future[Route | CallDone]] = {}
        self._cuts: dict[_Key, asyncio.Timeout] = {}
        self._episodes: dict[tuple[str, int], asyncio.Task[None]] = {}
        self.turns = Turns()
        self.stats = ServeStats()
        """What the resubmission loop counts (this runner's own)."""
        self.episodes_run = 0

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    async def run(self) -> None:
        """Say hello, then run what serve sends until serve goes away or this task is
        cancelled."""
        await self._send(RunnerHello(token=self._token, name=self.name))
        timeout_s = self._config.serve.request_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                welcome = await self._recv()
        except TimeoutError:
            raise ServerTimeout(
                f"runner {self.name}: no answer from dora serve on {self.address} within "
                f"{timeout_s:g} s (wrong serve.token or CURVE key, or serve is not up)"
            ) from None
        if not isinstance(welcome, Welcome):
            raise ProtocolError(f"runner {self.name}: expected serve's welcome, got {welcome!r}")
        log.info("runner %s: connected to %s", self.name, self.address)
        self._cpu_at_start = time.process_time()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._beat(welcome.heartbeat_s), name="runner-beat")
                await self._serve(tg, silent_s=4 * self._config.serve.runner_timeout_s)
        finally:
            for client in self._clients.values():
                await client.close()

    async def _serve(self, tg: asyncio.TaskGroup, *, silent_s: float) -> None:
        """Hear serve until it is silent for `silent_s` (it is gone: this runner stops)."""
        while True:
            try:
                async with asyncio.timeout(silent_s):
                    message = await self._recv()
            except TimeoutError:
                raise ServerUnavailable(
                    f"runner {self.name}: nothing from dora serve for {silent_s:g} s"
                ) from None
            match message:
                case RunEpisode():
                    key = (message.lease, message.attempt)
                    self._episodes[key] = tg.create_task(self._episode(message))
                case Route() | CallDone():
                    self._answer(message)
                case StopEpisode():
                    task = self._episodes.get((message.lease, message.attempt))
                    if task is not None:
                        task.cancel()
                case Welcome() | Beat():
                    pass

    async def _beat(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            await self._send(Beat(cpu_s=self.cpu_s()))

    async def _send(self, message: RunnerMessage) -> None:
        await self._sock.send(encode(message))

    async def _recv(self) -> CoordinatorMessage:
        while True:
            frame = await self._sock.recv()
            try:
                return decode_from_coordinator(frame)
            except ProtocolError as exc:
                log.warning("runner %s: dropped a malformed message: %s", self.name, exc)

    def _answer(self, message: Route | CallDone) -> None:
        key = (message.lease, message.attempt, message.seq)
        waiting = self._answers.get(key)
        if waiting is not None and not waiting.done():
            waiting.set_result(message)
        if isinstance(message, CallDone) and key in self._cuts:
            # serve ended the call before the instance answered (it declared the instance dead):
            # stop waiting for it
            self._cuts[key].reschedule(asyncio.get_running_loop().time())

    # --- episodes ----------------------------------------------------------------------------

    async def _episode(self, order: RunEpisode) -> None:
        key = (order.lease, order.attempt)
        sampler = _RemoteSampler(self, order.lease, order.attempt)
        try:
            sample = await run_fresh_episode(
                sampler=sampler,
                task=Task(order.prompt_id, order.data),
                env_factory=self._env_factory,
                renderer=self._renderer,
                params=order.params,
                limits=self._limits,
            )
        except DoraError as exc:
            # serve raises it where the episode would have raised it in-process
            await self._send(
                EpisodeFailed(lease=order.lease, attempt=order.attempt, error=repr(exc))
            )
            return
        finally:
            self._episodes.pop(key, None)
            sampler.release()
        self.episodes_run += 1
        await self._send(
            EpisodeDone(lease=order.lease, attempt=order.attempt, sample=sample, cpu_s=self.cpu_s())
        )

    def cpu_s(self) -> float:
        """CPU seconds of this process (all its threads) since serve welcomed it."""
        return time.process_time() - self._cpu_at_start

    def client(self, url: str) -> EngineClient:
        client = self._clients.get(url)
        if client is None:
            serve = self._config.serve
            client = EngineClient(url, timeout_s=serve.request_timeout_s, token=serve.token or None)
            self._clients[url] = client
        return client

    async def call(
        self, lease: str, attempt: int, seq: int, prompt: Sequence[int], params: SamplingParams
    ) -> tuple[Route | None, Completion | None, CallDone]:
        """One call of an episode: its route from serve, the call, serve's verdict."""
        key = (lease, attempt, seq)
        loop = asyncio.get_running_loop()
        self._answers[key] = loop.create_future()
        try:
            await self._send(NeedRoute(lease=lease, attempt=attempt, seq=seq))
            answer = await self._answers[key]
            if isinstance(answer, CallDone):
                return None, None, answer
            self._answers[key] = loop.create_future()
            completion, end = await self._call(answer, prompt, params)
            if end is not None:
                await self._send(end)
                if end.ended_well:  # serve sends no verdict on it (`runner_wire`)
                    return answer, completion, CallDone(lease=lease, attempt=attempt, seq=seq)
            done = await self._answers[key]
            assert isinstance(done, CallDone)
            return answer, completion, done
        finally:
            self._answers.pop(key, None)

    async def _call(
        self, route: Route, prompt: Sequence[int], params: SamplingParams
    ) -> tuple[Completion | None, CallEnd | None]:
        """The call to the instance, and the end to report (None: serve cut it first)."""
        key = (route.lease, route.attempt, route.seq)
        end = CallEnd(lease=route.lease, attempt=route.attempt, seq=route.seq)
        client = self.client(route.url)
        cut = asyncio.timeout(None)
        self._cuts[key] = cut
        try:
            async with cut:
                completion = await generate(
                    client,
                    prompt,
                    params,
                    request_id=route.call_id,
                    version=route.version,
                    session=route.session,
                )
        except TimeoutError:
            if not cut.expired():
                raise
            return None, None
        except ServerUnavailable as exc:
            end.failure, end.error = "unavailable", str(exc)
            return None, end
        except RequestError as exc:
            end.failure, end.error = "request", str(exc)
            return None, end
        except (ServerError, ProtocolError) as exc:
            end.failure, end.error = "error", f"{type(exc).__name__}: {exc}"
            return None, end
        finally:
            self._cuts.pop(key, None)
        end.tokens, end.finish = len(completion.token_ids), completion.finish_reason
        return completion, end


class _RemoteSampler:
    """The `Sampler` of an episode on a runner: serve routes each call, the runner makes it."""

    def __init__(self, runner: EpisodeRunner, lease: str, attempt: int) -> None:
        self._runner, self._lease, self._attempt = runner, lease, attempt
        self._seq = 0
        self._session: tuple[EngineClient, str] | None = None
        """Where the episode's session is, and its name."""

    def release(self) -> None:
        if self._session is not None:
            client, session = self._session
            client.release_session(session)
            self._session = None

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        async def call_once(
            prompt: Sequence[int], left: SamplingParams, imported: ExportedRequest | None
        ) -> tuple[Completion, ExportedRequest | None, bool]:
            self._seq += 1
            route, completion, done = await self._runner.call(
                self._lease, self._attempt, self._seq, prompt, left
            )
            if route is not None:
                self._follow(route)
            if done.refused:
                raise RequestError(done.refused)
            if done.error:
                raise ServerError(done.error)
            if completion is None:
                completion = Completion(
                    request_id=self._lease,
                    token_ids=[],
                    logprobs=[],
                    versions=[],
                    finish_reason="abort",
                )
            return completion, None, done.interrupted

        return await complete_calls(
            call_once,
            prompt_ids,
            params,
            name=self._lease,
            version=lambda: -1,  # never compared: no exports cross to a runner
            turns=self._runner.turns,
            stats=self._runner.stats,
        )

    def _follow(self, route: Route) -> None:
        """The session moves with the episode: released where it was, when the route changed."""
        client = self._runner.client(route.url)
        if self._session is not None and (
            route.session is None or self._session != (client, route.session)
        ):
            self.release()
        if route.session is not None:
            self._session = (client, route.session)
