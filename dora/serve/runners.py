"""Episode runners, serve's side: episodes run in other processes, routing stays here.

With `serve.runners = N` the dispatcher hands each episode (its lease, task and sampling
parameters) to a runner process (`runner_episodes.py`) with its own event loop: the env steps,
tools, rendering, reward and the model calls themselves run there. Serve keeps admission, the
transfer queue, the orchestrator's actions, the journal and the trainer link, and the router:
before each call the runner asks for a route (`NeedRoute`), and serve answers with what
`Router.call_with` decides, the same code that routes serve's own calls: the instance, its
address, the call id, the pinned version and the session. The runner calls the instance itself and
reports the call's end (`CallEnd`: tokens, finish reason, or how it failed); the router's count of
calls in flight per instance, its loads that wait for idle, its moves and interrupts (an abort on
the instance, sent from here as before; the runner's call then returns "abort", serve answers
`CallDone(interrupted)` and the runner asks for the next route with its tokens so far; a call that
ended well gets no answer, the runner has gone on), cuts and
instance failures are exactly those of a call made here. KV migration is off with runners (a
move resubmits): the export would have to cross to the runner.

Failures. A runner whose process exits (serve's own, watched by their handles) or that sends
nothing for `serve.runner_timeout_s` (a heartbeat goes every fifth of it) is lost: the calls it
had in flight are aborted on their instances and end in the router, the sessions its runs held
there are released, and each of its episodes is run again from its start on another runner, on
the same lease, so on the same version (C1); the group waits for it, nothing is dropped (C2), and
the deadline is the group's as before (C3).
Counted as `runner_reruns`, `runners_lost`. Serve's own runner processes that exit are started
again, at most `3 * serve.runners` times in a run. A hello without the token (or with a name
already connected) is refused and logged, never answered, and nothing is sent to or taken from its
sender (`runners_refused`). A result for an episode its sender does not own (never sent to it,
re-run elsewhere, or already reported) is ignored and counted (`runner_results_ignored`); a frame
that does not decode is dropped (`runner_frames_dropped`). Off loopback the port needs the trainer
link's CURVE keys (`dora.link`: the same ZAP check admits only `serve.link_client_key`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import zmq
import zmq.asyncio

from dora.config import ServeConfig
from dora.env import Task
from dora.errors import ProtocolError, RequestError, ServerError, ServerUnavailable
from dora.instance.callcpu import CALL_CPU
from dora.link import CurveKeys, bind_router, check_server_keys, router_socket
from dora.protocol import Completion, Sample, SamplingParams
from dora.records import RunnerLost as RunnerLostRecord
from dora.serve.metrics import MetricsLog
from dora.serve.router import InstanceState, Router
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
    StopEpisode,
    Welcome,
    decode_from_runner,
    encode,
)
from dora.serve.spawn import Spawner
from dora.serve.stats import ServeStats

__all__ = ["RunnerHub", "RunnerLost"]

log = logging.getLogger("dora.serve")


class RunnerLost(Exception):
    """The runner of an episode or a call is gone (exited, or silent past its deadline)."""


@dataclass(eq=False)
class _Runner:
    routing_id: bytes
    name: str
    last_seen: float
    episodes: dict[tuple[str, int], asyncio.Future[Sample]] = field(default_factory=dict)
    calls: dict[tuple[str, int, int], asyncio.Future[CallEnd]] = field(default_factory=dict)
    ran: int = 0
    """Episodes it finished."""


class RunnerHub:
    """Serve's end of the runners' port (see the module docstring)."""

    def __init__(
        self,
        config: ServeConfig,
        *,
        router: Router,
        stats: ServeStats,
        spawn: Spawner,
        metrics: MetricsLog | None = None,
        expected: Sequence[str] = (),
    ) -> None:
        """`expected`: the names of the runners serve starts itself; the first episode waits for
        them all to connect, so that the runner quickest to start does not take every early
        episode."""
        curve = CurveKeys.from_config(config)
        check_server_keys(config.host, curve, what="the runners' port")
        self._router, self._stats, self._spawn = router, stats, spawn
        self._metrics = metrics
        self._token = config.token
        self.timeout_s = config.runner_timeout_s
        self._ctx = zmq.asyncio.Context()
        # No bound on what waits to go out to one runner. A ROUTER with several peers reports
        # itself writable while any one of them can take a message, so a send to a runner whose
        # queue is full fails at once (EAGAIN) instead of waiting, and that runner would be
        # taken for lost when it is only slower to read than serve writes (dora mode sends
        # thousands of episodes at once). What waits is bounded anyway: the episodes admitted,
        # and for each at most one route or verdict.
        self._sock, self._auth = router_socket(
            self._ctx, curve, config.link_max_message_bytes, send_hwm=0
        )
        try:
            self.port, self.address = bind_router(self._sock, config.host, config.runner_port)
        except zmq.ZMQError as exc:
            self.close()
            raise ServerUnavailable(f"cannot bind the runners' port: {exc}") from exc
        self._runners: dict[bytes, _Runner] = {}
        self._lost: set[bytes] = set()
        self._attempts = 0
        self._expected = set(expected)
        self.joined = asyncio.Event()
        """Set by each runner that connects."""
        self.episodes_by_runner: dict[str, int] = {}
        """Episodes each runner finished, by name (the lost ones too)."""

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.term()

    def names(self) -> list[str]:
        """The runners connected now."""
        return sorted(r.name for r in self._runners.values())

    # --- episodes ----------------------------------------------------------------------------

    async def run_episode(self, lease_id: str, task: Task, params: SamplingParams) -> Sample:
        """Run one episode on a runner; again from its start, elsewhere, if that runner is lost."""
        lease = self._router.lease(lease_id)
        assert lease is not None, f"{lease_id} is not open"
        version = lease.version
        while True:
            runner = await self._choose()
            # unique across leases and runs of a lease (a group retried or restarted reuses its
            # lease ids): nothing sent about an earlier attempt is taken for this one
            self._attempts += 1
            attempt = self._attempts
            key = (lease_id, attempt)
            done: asyncio.Future[Sample] = asyncio.get_running_loop().create_future()
            runner.episodes[key] = done
            order = RunEpisode(
                lease=lease_id,
                attempt=attempt,
                version=version,
                prompt_id=task.prompt_id,
                data=dict(task.data),
                params=params,
            )
            try:
                await self._send(runner, order)
                sample = await done
            except RunnerLost:
                if done.done():
                    done.exception()  # lost before it was awaited: seen, not left unretrieved
                self._stats.runner_reruns += 1
                self._router.restart(lease_id, session=_run_session(lease_id, attempt))
                log.warning("episode %s is run again: runner %s was lost", lease_id, runner.name)
                continue
            except asyncio.CancelledError:
                if runner.routing_id in self._runners:
                    with contextlib.suppress(RunnerLost):
                        await self._send(runner, StopEpisode(lease=lease_id, attempt=attempt))
                raise
            finally:
                runner.episodes.pop(key, None)
            return sample

    async def _choose(self) -> _Runner:
        """The connected runner with the fewest episodes (waits for one to connect, and at the
        start for serve's own runners)."""
        while not self._runners or not self._expected <= {r.name for r in self._runners.values()}:
            self.joined.clear()
            await self.joined.wait()
        self._expected = set()
        return min(self._runners.values(), key=lambda r: len(r.episodes))

    async def _send(self, runner: _Runner, message: CoordinatorMessage) -> None:
        try:
            await self._sock.send_multipart([runner.routing_id, encode(message)])
        except zmq.ZMQError as exc:
            self.lose(runner, f"unreachable ({exc})")
            raise RunnerLost(runner.name) from exc

    # --- the port ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Hear the runners and watch their heartbeats, until cancelled."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._watch(), name="runner-heartbeats")
            while True:
                frames = await self._sock.recv_multipart()
                if len(frames) != 2:
                    self._drop(f"{len(frames) - 1} frames in one message, expected 1")
                    continue
                self._heard(frames[0], frames[1])

    def _heard(self, routing_id: bytes, frame: bytes) -> None:
        try:
            message = decode_from_runner(frame)
        except ProtocolError as exc:
            self._drop(str(exc))
            return
        runner = self._runners.get(routing_id)
        if runner is None:
            if isinstance(message, RunnerHello) and routing_id not in self._lost:
                self._hello(routing_id, message)
            elif routing_id in self._lost and isinstance(message, EpisodeDone):
                self._ignore(message, "a runner that was declared lost")
            else:
                self._stats.runner_frames_dropped += 1
            return
        runner.last_seen = time.monotonic()
        if isinstance(message, Beat | EpisodeDone) and message.cpu_s:
            self._stats.runner_cpu_s[routing_id] = message.cpu_s
        match message:
            case NeedRoute():
                self._spawn(self._route(runner, message), name=f"route-{message.lease}")
            case CallEnd():
                call = runner.calls.get((message.lease, message.attempt, message.seq))
                if call is not None and not call.done():
                    call.set_result(message)
            case EpisodeDone():
                self._done(runner, message)
            case EpisodeFailed():
                episode = runner.episodes.get((message.lease, message.attempt))
                if episode is not None and not episode.done():
                    episode.set_exception(ServerError(f"runner {runner.name}: {message.error}"))
            case Beat():
                self._spawn(self._beat(runner), name=f"beat-{runner.name}")
            case RunnerHello():
                pass

    def _hello(self, routing_id: bytes, hello: RunnerHello) -> None:
        token_ok = not self._token or hmac.compare_digest(
            hello.token.encode(), self._token.encode()
        )
        taken = any(r.name == hello.name for r in self._runners.values())
        if not token_ok or taken:
            self._stats.runners_refused += 1
            why = "it does not carry serve.token" if not token_ok else "its name is connected"
            log.warning("refused a runner's hello (%r): %s", hello.name, why)
            return
        # The welcome goes out before anything else can be sent to the runner (an episode as
        # soon as it is known): queued now, without waiting (the socket does not block).
        welcome = Welcome(heartbeat_s=self.timeout_s / 5)
        sent = cast(
            "asyncio.Future[object]",
            self._sock.send_multipart([routing_id, encode(welcome)], flags=zmq.NOBLOCK),
        )
        if sent.done() and sent.exception() is not None:
            log.warning("runner %s left before its welcome: %s", hello.name, sent.exception())
            return
        self._runners[routing_id] = _Runner(routing_id, hello.name, time.monotonic())
        self.episodes_by_runner.setdefault(hello.name, 0)
        log.info("runner %s connected", hello.name)
        self.joined.set()

    async def _beat(self, runner: _Runner) -> None:
        with contextlib.suppress(RunnerLost):
            await self._send(runner, Beat())

    def _done(self, runner: _Runner, message: EpisodeDone) -> None:
        episode = runner.episodes.get((message.lease, message.attempt))
        if episode is None or episode.done():
            self._ignore(message, f"runner {runner.name}, which does not own it (now)")
            return
        runner.ran += 1
        self.episodes_by_runner[runner.name] += 1
        episode.set_result(message.sample)

    def _ignore(self, message: EpisodeDone, sender: str) -> None:
        self._stats.runner_results_ignored += 1
        log.warning(
            "ignored the result of episode %s (attempt %d) from %s",
            *(message.lease, message.attempt, sender),
        )

    def _drop(self, problem: str) -> None:
        self._stats.runner_frames_dropped += 1
        log.warning("runners' port: dropped a malformed message: %s", problem)

    async def _watch(self) -> None:
        """Declare lost every runner silent for `timeout_s`."""
        while True:
            await asyncio.sleep(self.timeout_s / 5)
            now = time.monotonic()
            for runner in list(self._runners.values()):
                if now - runner.last_seen > self.timeout_s:
                    self.lose(runner, f"silent for {now - runner.last_seen:.1f} s")

    def lose(self, runner: _Runner, why: str) -> None:
        """`runner` is gone: its calls end (aborted on their instances), its episodes run again
        elsewhere. Nothing it sends from now on is heard."""
        if self._runners.pop(runner.routing_id, None) is None:
            return
        self._lost.add(runner.routing_id)
        self._stats.runners_lost += 1
        log.warning(
            "runner %s is lost (%s): %d episodes run again", runner.name, why, len(runner.episodes)
        )
        if self._metrics is not None:
            lost = RunnerLostRecord(runner=runner.name, reason=why, episodes=len(runner.episodes))
            self._metrics.write(lost)
        futures: list[asyncio.Future[CallEnd] | asyncio.Future[Sample]] = [
            *runner.calls.values(),
            *runner.episodes.values(),
        ]
        for future in futures:
            if not future.done():
                future.set_exception(RunnerLost(runner.name))

    def lose_named(self, name: str, why: str) -> None:
        """Lose the connected runner called `name`, if any (its process exited)."""
        for runner in list(self._runners.values()):
            if runner.name == name:
                self.lose(runner, why)

    # --- calls -------------------------------------------------------------------------------

    async def _route(self, runner: _Runner, need: NeedRoute) -> None:
        """One call of a runner's episode, through the router (see the module docstring)."""
        key = (need.lease, need.attempt)
        lease = self._router.lease(need.lease)
        if lease is None or key not in runner.episodes:
            return  # an episode stopped, or re-run elsewhere: nothing to route
        done = CallDone(lease=need.lease, attempt=need.attempt, seq=need.seq)

        async def execute(
            inst: InstanceState, call_id: str, version: int | None, session: str | None
        ) -> Completion:
            return await self._remote(runner, need, inst, call_id, version, session)

        try:
            completion, _, done.interrupted = await self._router.call_with(lease, execute)
        except RequestError as exc:
            done.refused = str(exc)
        except ServerError as exc:
            done.error = f"{type(exc).__name__}: {exc}"
        except RunnerLost:
            return
        else:
            if completion.finish_reason != "abort":
                return  # the runner's call ended well and it went on: no verdict to send
        with contextlib.suppress(RunnerLost):
            await self._send(runner, done)

    async def _remote(
        self,
        runner: _Runner,
        need: NeedRoute,
        inst: InstanceState,
        call_id: str,
        version: int | None,
        session: str | None,
    ) -> Completion:
        """The call made by `runner`: route it there, wait for its end. A runner lost meanwhile
        leaves a call that may still run on the instance: it is aborted before the call ends
        here, so that no load finds the instance idle under it."""
        CALL_CPU.calls += 1  # a model call serve handled, though a runner made it
        key = (need.lease, need.attempt, need.seq)
        url = getattr(inst.client, "base_url", None)
        if not isinstance(url, str):
            raise ServerError(f"instance {inst.id} has no address a runner could call")
        ended: asyncio.Future[CallEnd] = asyncio.get_running_loop().create_future()
        runner.calls[key] = ended
        route = Route(
            lease=need.lease,
            attempt=need.attempt,
            seq=need.seq,
            instance=inst.id,
            url=url,
            call_id=call_id,
            version=version,
            session=None if session is None else _run_session(session, need.attempt),
        )
        try:
            await self._send(runner, route)
            end = await ended
        except RunnerLost:
            with contextlib.suppress(ServerError, TimeoutError):
                async with asyncio.timeout(self._router.control_timeout_s):
                    await inst.client.abort(call_id)
            raise
        finally:
            runner.calls.pop(key, None)
        if end.failure == "unavailable":
            raise ServerUnavailable(end.error)
        if end.failure == "request":
            raise RequestError(end.error)
        if end.failure:
            raise ServerError(end.error)
        # The tokens stay on the runner; the router counts them.
        tokens = array("i", bytes(4 * end.tokens))
        return Completion(
            request_id=call_id, token_ids=tokens, logprobs=[], versions=[], finish_reason=end.finish
        )


def _run_session(session: str, attempt: int) -> str:
    """The session a run of an episode names on its instance: one per run (`attempt`), so a run
    from the start never continues the context of a lost one."""
    return f"{session}.{attempt}"
