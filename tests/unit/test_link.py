"""The serve <-> learn link over real ZMQ sockets on loopback."""

from __future__ import annotations

import asyncio

import pytest

from dora.bench.protocol import make_group
from dora.errors import ServerTimeout
from dora.link import LearnLink, ServeLink
from dora.protocol import Assigned, Hello, StepDone

pytestmark = pytest.mark.timeout(30)


async def test_hello_then_groups_then_acks() -> None:
    serve = ServeLink(token="t0k")
    learn = LearnLink(serve.address)
    try:
        learn.send(Hello(role="learn", incarnation=0, step=0, token="t0k"))
        hello = await asyncio.wait_for(serve.recv(), 5)
        assert isinstance(hello, Hello) and hello.incarnation == 0
        group = make_group(samples=2, tokens=32)
        await serve.send(Assigned(step=0, group=group))
        got = await asyncio.to_thread(learn.recv, timeout_s=5, waiting_for="a group")
        assert isinstance(got, Assigned) and got.group == group
        learn.send(StepDone(step=0, incarnation=0, metrics={"loss": 1.0}))
        ack = await asyncio.wait_for(serve.recv(), 5)
        assert ack == StepDone(step=0, incarnation=0, metrics={"loss": 1.0})
    finally:
        learn.close()
        serve.close()


async def test_wrong_token_is_ignored_and_restart_takes_over() -> None:
    serve = ServeLink(token="right")
    intruder, first, second = (LearnLink(serve.address) for _ in range(3))
    try:
        intruder.send(Hello(role="learn", incarnation=9, step=0, token="wrong"))
        first.send(Hello(role="learn", incarnation=0, step=0, token="right"))
        hello = await asyncio.wait_for(serve.recv(), 5)
        assert isinstance(hello, Hello) and hello.incarnation == 0
        second.send(Hello(role="learn", incarnation=1, step=3, token="right"))
        hello = await asyncio.wait_for(serve.recv(), 5)
        assert isinstance(hello, Hello) and hello.incarnation == 1
        first.send(StepDone(step=2, incarnation=0))  # the old incarnation is no longer heard
        second.send(StepDone(step=3, incarnation=1))
        assert await asyncio.wait_for(serve.recv(), 5) == StepDone(step=3, incarnation=1)
        await serve.send(Assigned(step=4, group=make_group(samples=1, tokens=8)))
        got = await asyncio.to_thread(second.recv, timeout_s=5, waiting_for="a group")
        assert isinstance(got, Assigned) and got.step == 4
        with pytest.raises(ServerTimeout, match="a group"):
            first.recv(timeout_s=0.2, waiting_for="a group")
    finally:
        for link in (intruder, first, second):
            link.close()
        serve.close()


async def test_send_without_trainer_times_out_with_the_address() -> None:
    serve = ServeLink()
    try:
        with pytest.raises(ServerTimeout, match=serve.address):
            await serve.send(Assigned(step=0, group=make_group(samples=1, tokens=8)), timeout_s=0.2)
    finally:
        serve.close()


def test_learn_send_fails_instead_of_hanging_when_serve_is_gone() -> None:
    import zmq

    ctx = zmq.Context()
    port = ctx.socket(zmq.ROUTER)
    number = port.bind_to_random_port("tcp://127.0.0.1")
    port.close(linger=0)  # nobody listens there any more
    ctx.term()
    learn = LearnLink(f"tcp://127.0.0.1:{number}", send_timeout_s=0.2)
    try:
        with pytest.raises(ServerTimeout, match="StepDone"):
            for _ in range(5000):  # more than the send queue holds
                learn.send(StepDone(step=0, incarnation=0))
    finally:
        learn.close()
