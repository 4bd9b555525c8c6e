"""Serve's end of the episode runners (`dora.serve.runners`) against fake runners: raw ZeroMQ
DEALER sockets speaking the runner messages, on a real loopback port. Bad input at the runners'
port: a wrong token, a result for an episode the sender does not own or sent twice, a malformed
frame, a runner that goes silent; and the accounting of a call a runner makes (in flight on its
instance while it runs, aborted there when the runner is lost)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from dora.config import ServeConfig
from dora.env import Task
from dora.errors import ConfigError
from dora.protocol import Sample, SamplingParams
from dora.serve.router import Router
from dora.serve.runner_wire import (
    Beat,
    CallDone,
    CallEnd,
    CoordinatorMessage,
    EpisodeDone,
    NeedRoute,
    Route,
    RunEpisode,
    RunnerHello,
    RunnerMessage,
    Welcome,
    decode_from_coordinator,
    encode,
)
from dora.serve.runners import RunnerHub
from dora.serve.spawn import Spawner
from dora.serve.stats import ServeStats

pytestmark = pytest.mark.timeout(20)

TOKEN = "the-run-secret"
PARAMS = SamplingParams(max_tokens=8)


class FakeClient:
    """What the hub needs of an instance's client: its address, and `abort`."""

    base_url = "http://127.0.0.1:9"

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.released: list[str] = []

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def release_session(self, session: str) -> None:
        self.released.append(session)


class FakeRunner:
    """A DEALER that speaks as a runner."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str) -> None:
        """Connected to `address` (not yet with "": the caller sets its keys first)."""
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if address:
            self.sock.connect(address)

    async def send(self, message: RunnerMessage) -> None:
        await self.sock.send(encode(message))

    async def recv(self, timeout_s: float = 5.0) -> CoordinatorMessage:
        async with asyncio.timeout(timeout_s):
            return decode_from_coordinator(await self.sock.recv())

    async def hears_nothing(self, within_s: float) -> bool:
        return not await self.sock.poll(timeout=int(within_s * 1000))

    async def hello(self, name: str, token: str = TOKEN) -> None:
        await self.send(RunnerHello(token=token, name=name))
        assert isinstance(await self.recv(), Welcome)


def sample(reward: float) -> Sample:
    return Sample(
        token_ids=b"",
        loss_mask=b"",
        logprobs=b"",
        versions=b"",
        prompt_len=0,
        reward=reward,
    )


@contextlib.asynccontextmanager
async def hub_running(
    timeout_s: float = 30.0, *, sessions: bool = False
) -> AsyncIterator[tuple[RunnerHub, Router]]:
    stats = ServeStats()
    router = Router(kv_migration=False, stats=stats, sessions=sessions)
    router.add_instance("i0", FakeClient())  # type: ignore[arg-type]
    router.open("g0/0", version=3, instance="i0")
    spawn = Spawner()
    config = ServeConfig(token=TOKEN, runner_timeout_s=timeout_s)
    hub = RunnerHub(config, router=router, stats=stats, spawn=spawn)
    try:
        async with asyncio.TaskGroup() as tg:
            spawn.open(tg)
            task = tg.create_task(hub.run())
            yield hub, router
            task.cancel()
    finally:
        hub.close()


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def episode_order(runner: FakeRunner) -> RunEpisode:
    order = await runner.recv()
    assert isinstance(order, RunEpisode), order
    return order


async def test_runner_with_a_wrong_token_is_refused_and_given_nothing(
    ctx: zmq.asyncio.Context,
) -> None:
    async with hub_running() as (hub, _):
        bad = FakeRunner(ctx, hub.address)
        await bad.send(RunnerHello(token="guessed", name="bad"))
        await bad.send(EpisodeDone(lease="g0/0", attempt=1, sample=sample(1.0)))
        episode = asyncio.ensure_future(hub.run_episode("g0/0", Task("t0"), PARAMS))
        assert await bad.hears_nothing(within_s=0.5)  # no welcome, no episode
        assert hub.names() == [] and not episode.done()
        assert hub._stats.runners_refused == 1
        assert hub._stats.runner_frames_dropped == 1  # its result was not taken
        good = FakeRunner(ctx, hub.address)
        await good.hello("good")
        order = await episode_order(good)
        assert (order.lease, order.attempt, order.version, order.prompt_id) == ("g0/0", 1, 3, "t0")
        await good.send(EpisodeDone(lease="g0/0", attempt=1, sample=sample(0.5)))
        assert (await episode).reward == 0.5


async def test_runner_result_it_does_not_own_or_sends_twice_is_ignored(
    ctx: zmq.asyncio.Context,
) -> None:
    async with hub_running() as (hub, _):
        a, b = FakeRunner(ctx, hub.address), FakeRunner(ctx, hub.address)
        await a.hello("a")
        episode = asyncio.ensure_future(hub.run_episode("g0/0", Task("t0"), PARAMS))
        await episode_order(a)
        await b.hello("b")
        await b.send(EpisodeDone(lease="g0/0", attempt=1, sample=sample(9.0)))  # not b's
        await b.send(Beat())
        assert isinstance(await b.recv(), Beat)  # heard before a reports: a's and b's are 2 streams
        await a.send(EpisodeDone(lease="g0/0", attempt=1, sample=sample(0.25)))
        assert (await episode).reward == 0.25
        await a.send(EpisodeDone(lease="g0/0", attempt=1, sample=sample(0.25)))  # twice
        await a.send(Beat())
        assert isinstance(await a.recv(), Beat)  # heard after the duplicate: it was counted
        assert hub._stats.runner_results_ignored == 2
        # the group is retried on the same lease: a new attempt, and the old one's result again
        # (a runner that finished it late) is not taken for the new one
        again = asyncio.ensure_future(hub.run_episode("g0/0", Task("t0"), PARAMS))
        order = await episode_order(a)  # a and b run none now: the first connected wins
        assert order.lease == "g0/0" and order.attempt != 1
        await a.send(EpisodeDone(lease="g0/0", attempt=1, sample=sample(9.0)))
        await a.send(EpisodeDone(lease="g0/0", attempt=order.attempt, sample=sample(0.75)))
        assert (await again).reward == 0.75
        assert hub._stats.runner_results_ignored == 3
        assert hub.episodes_by_runner == {"a": 2, "b": 0}


async def test_runner_malformed_frame_is_dropped_and_a_taken_name_refused(
    ctx: zmq.asyncio.Context,
) -> None:
    async with hub_running() as (hub, _):
        a = FakeRunner(ctx, hub.address)
        await a.hello("a")
        await a.sock.send(b"\xc1 not msgpack")
        await a.sock.send(msgspec.msgpack.encode({"type": "episode_done", "lease": 3}))
        twin = FakeRunner(ctx, hub.address)
        await twin.send(RunnerHello(token=TOKEN, name="a"))
        assert await twin.hears_nothing(within_s=0.3)
        await a.send(Beat())
        assert isinstance(await a.recv(), Beat)  # the port goes on
        assert hub._stats.runner_frames_dropped == 2
        assert hub._stats.runners_refused == 1 and hub.names() == ["a"]


async def test_runner_silent_past_its_deadline_is_lost_and_its_episode_runs_again(
    ctx: zmq.asyncio.Context,
) -> None:
    async with hub_running(timeout_s=0.5, sessions=True) as (hub, router):
        a, b = FakeRunner(ctx, hub.address), FakeRunner(ctx, hub.address)
        await a.hello("a")
        episode = asyncio.ensure_future(hub.run_episode("g0/0", Task("t0"), PARAMS))
        await episode_order(a)
        # a asks for a route and starts its call, then hangs: the call is in flight on i0
        await a.send(NeedRoute(lease="g0/0", attempt=1, seq=1))
        route = await a.recv()
        assert isinstance(route, Route) and route.instance == "i0" and route.version == 3
        assert router.calls_in_flight("i0") == 1
        await b.hello("b")

        async def beat() -> None:
            while True:
                await b.send(Beat())
                await asyncio.sleep(0.1)

        beating = asyncio.ensure_future(beat())
        try:
            order = await b.recv()  # the same episode, from its start, on b
            while True:  # b's beats are answered; the order may come between them
                if isinstance(order, RunEpisode):
                    break
                order = await b.recv()
            assert (order.lease, order.attempt, order.version) == ("g0/0", 2, 3)
            client = router.client("i0")
            assert client.aborted == [route.call_id]  # type: ignore[attr-defined]
            # the context a's run kept on i0 is of no use to the run from the start
            assert route.session == "g0/0.1"
            assert client.released == [route.session]  # type: ignore[attr-defined]
            assert router.calls_in_flight("i0") == 0
            await a.send(EpisodeDone(lease="g0/0", attempt=1, sample=sample(7.0)))  # too late
            # a's and b's sockets are two streams: b reports only once a's result was heard (a,
            # lost, gets no answer to wait on: the counter is polled)
            async with asyncio.timeout(5):
                while hub._stats.runner_results_ignored == 0:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            await b.send(EpisodeDone(lease="g0/0", attempt=2, sample=sample(1.0)))
            assert (await episode).reward == 1.0
        finally:
            beating.cancel()
        assert hub._stats.runners_lost == 1 and hub._stats.runner_reruns == 1
        assert hub._stats.runner_results_ignored == 1


async def test_runner_call_is_counted_in_flight_until_it_ends(ctx: zmq.asyncio.Context) -> None:
    async with hub_running() as (hub, router):
        a = FakeRunner(ctx, hub.address)
        await a.hello("a")
        episode = asyncio.ensure_future(hub.run_episode("g0/0", Task("t0"), PARAMS))
        await episode_order(a)
        await a.send(NeedRoute(lease="g0/0", attempt=1, seq=1))
        route = await a.recv()
        assert isinstance(route, Route)
        assert route.url == FakeClient.base_url and route.call_id == "g0/0#1"
        assert router.calls_in_flight("i0") == 1
        idle = asyncio.ensure_future(router.wait_idle("i0"))
        await asyncio.sleep(0.05)
        assert not idle.done()  # a load waits for the runner's call
        await a.send(CallEnd(lease="g0/0", attempt=1, seq=1, tokens=5, finish="length"))
        await idle
        assert router.usage(0.0)["i0"].tokens == 5
        # a call that ended well gets no verdict (the runner went on): what serve sends next is
        # the answer to this beat
        await a.send(Beat(cpu_s=1.5))
        assert isinstance(await a.recv(), Beat)
        assert list(hub._stats.runner_cpu_s.values()) == [1.5]  # the runner's process CPU
        await a.send(EpisodeDone(lease="g0/0", attempt=1, sample=sample(0.0), cpu_s=2.25))
        await episode
        assert list(hub._stats.runner_cpu_s.values()) == [2.25]


async def test_runner_off_loopback_needs_curve_and_a_stranger_key_is_refused(
    ctx: zmq.asyncio.Context,
) -> None:
    router = Router(kv_migration=False)
    with pytest.raises(ConfigError, match="the runners' port needs CURVE keys"):
        RunnerHub(ServeConfig(host="0.0.0.0"), router=router, stats=ServeStats(), spawn=Spawner())
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    config = ServeConfig(
        token=TOKEN, link_server_key=server_secret.decode(), link_client_key=client_secret.decode()
    )
    spawn = Spawner()
    hub = RunnerHub(config, router=router, stats=ServeStats(), spawn=spawn)
    try:
        async with asyncio.TaskGroup() as tg:
            spawn.open(tg)
            task = tg.create_task(hub.run())
            stranger, member = FakeRunner(ctx, ""), FakeRunner(ctx, "")
            for runner, (public, secret) in (
                (stranger, zmq.curve_keypair()),
                (member, (client_public, client_secret)),
            ):
                runner.sock.curve_secretkey, runner.sock.curve_publickey = secret, public
                runner.sock.curve_serverkey = server_public
                runner.sock.connect(hub.address)
            await stranger.send(RunnerHello(token=TOKEN, name="stranger"))
            assert await stranger.hears_nothing(within_s=1.0)  # its handshake was refused
            await member.hello("member")
            assert hub.names() == ["member"]
            task.cancel()
    finally:
        hub.close()


async def test_runner_call_moved_by_the_orchestrator_is_aborted_and_routed_anew(
    ctx: zmq.asyncio.Context,
) -> None:
    async with hub_running() as (hub, router):
        router.add_instance("i1", FakeClient())  # type: ignore[arg-type]
        a = FakeRunner(ctx, hub.address)
        await a.hello("a")
        episode = asyncio.ensure_future(hub.run_episode("g0/0", Task("t0"), PARAMS))
        await episode_order(a)
        await a.send(NeedRoute(lease="g0/0", attempt=1, seq=1))
        first = await a.recv()
        assert isinstance(first, Route) and first.instance == "i0"
        # the orchestrator migrates the lease (same version): serve aborts the call on i0
        assert router.move("g0/0", "i1")
        await router.interrupt("g0/0", export=True)
        assert router.client("i0").aborted == [first.call_id]  # type: ignore[attr-defined]
        # the runner's call returns "abort" with the tokens so far; serve's verdict: interrupted
        await a.send(CallEnd(lease="g0/0", attempt=1, seq=1, tokens=2, finish="abort"))
        done = await a.recv()
        assert isinstance(done, CallDone) and done.interrupted
        await a.send(NeedRoute(lease="g0/0", attempt=1, seq=2))
        second = await a.recv()
        assert isinstance(second, Route) and second.instance == "i1" and second.version == 3
        assert second.call_id != first.call_id
        assert router.calls_in_flight("i0") == 0 and router.calls_in_flight("i1") == 1
        await a.send(CallEnd(lease="g0/0", attempt=1, seq=2, tokens=4, finish="stop"))
        await router.wait_idle("i1")  # it ended well: no verdict follows
        await a.send(EpisodeDone(lease="g0/0", attempt=1, sample=sample(0.0)))
        await episode
        assert await a.hears_nothing(within_s=0.2)
        assert router.stats.migrations == 1


async def test_runner_slower_to_read_than_serve_sends_is_slow_not_lost(
    ctx: zmq.asyncio.Context,
) -> None:
    """dora mode admits several batches at once, thousands of episodes: a runner that reads its
    orders more slowly than serve sends them has a long queue, which is not a lost runner, also
    while another runner keeps up (the port can then take a message, just not for this one)."""
    n = 20_000
    prompt = {"question": "x" * 4_000}  # 80 MB of orders: more than the sockets' buffers hold
    async with hub_running() as (hub, router):
        slow, quick = FakeRunner(ctx, hub.address), FakeRunner(ctx, hub.address)
        await slow.hello("slow")
        await quick.hello("quick")
        for k in range(1, n):
            router.open(f"g{k}/0", version=3, instance="i0")
        episodes = [
            asyncio.ensure_future(hub.run_episode(f"g{k}/0", Task(f"t{k}", prompt), PARAMS))
            for k in range(n)
        ]

        async def run_all(runner: FakeRunner, after_s: float) -> int:
            await asyncio.sleep(after_s)
            for _ in range(n // 2):
                order = await episode_order(runner)
                done = EpisodeDone(lease=order.lease, attempt=order.attempt, sample=sample(1.0))
                await runner.send(done)
            return n // 2

        # the slow runner reads nothing for a second, the quick one all the time
        ran = await asyncio.gather(run_all(slow, 1.0), run_all(quick, 0.0))
        assert ran == [n // 2, n // 2]
        assert [s.reward for s in await asyncio.gather(*episodes)] == [1.0] * n
        assert hub.names() == ["quick", "slow"] and hub._stats.runners_lost == 0
