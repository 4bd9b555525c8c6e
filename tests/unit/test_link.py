"""The serve <-> learn link over real ZMQ sockets on loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dora.bench.protocol import make_group
from dora.config import ServeConfig
from dora.errors import ConfigError, ServerTimeout, ServerUnavailable
from dora.link import CurveKeys, LearnLink, ServeLink
from dora.protocol import Assigned, Hello, Refused, StepClosed, StepDone, WeightChunk, encode

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


async def test_wrong_token_is_refused_and_a_restart_takes_over_once_the_first_is_gone() -> None:
    serve = ServeLink(token="right")
    intruder, first, second = (LearnLink(serve.address) for _ in range(3))
    try:
        intruder.send(Hello(role="learn", incarnation=9, step=0, token="wrong"))
        intruder.send(Hello(role="learn", incarnation=9, step=0, token="\u00e9t\u00e9"))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(serve.recv(), 2)
        assert serve.refused == 2
        first.send(Hello(role="learn", incarnation=0, step=0, token="right"))
        hello = await asyncio.wait_for(serve.recv(), 5)
        assert isinstance(hello, Hello) and hello.incarnation == 0
        # A restart's hello may overtake the news of its predecessor's death: it waits for the
        # link, and gets it when the first trainer's connection closes.
        second.send(Hello(role="learn", incarnation=1, step=3, token="right"))
        first.send(StepDone(step=2, incarnation=0))
        assert await asyncio.wait_for(serve.recv(), 5) == StepDone(step=2, incarnation=0)
        first.close()
        hello = await asyncio.wait_for(serve.recv(), 5)
        assert isinstance(hello, Hello) and hello.incarnation == 1
        second.send(StepDone(step=3, incarnation=1))
        assert await asyncio.wait_for(serve.recv(), 5) == StepDone(step=3, incarnation=1)
        # and the restart's first try, unless it came after the first left
        assert serve.refused in (2, 3)
        await serve.send(Assigned(step=4, group=make_group(samples=1, tokens=8)))
        got = await asyncio.to_thread(second.recv, timeout_s=5, waiting_for="a group")
        assert isinstance(got, Assigned) and got.step == 4
        with pytest.raises(ServerTimeout, match="a group"):
            intruder.recv(timeout_s=0.2, waiting_for="a group")
    finally:
        for link in (intruder, first, second):
            link.close()
        serve.close()


async def test_rogue_trainer_second_hello_is_refused_while_the_trainer_is_connected() -> None:
    """A peer with the token and a plausible hello does not take the link from a connected
    trainer: it gets nothing, the trainer keeps getting everything; `admit` refusals too."""
    serve = ServeLink(token="right")
    trainer, rogue, refused = (LearnLink(serve.address) for _ in range(3))

    def admit(hello: Hello) -> str | None:
        return None if hello.incarnation <= 1 else "not an incarnation serve issued"

    try:
        trainer.send(Hello(role="learn", incarnation=0, step=0, token="right"))
        assert isinstance(await asyncio.wait_for(serve.recv(admit=admit), 5), Hello)
        for incarnation in (-1, 0, 1, 1000, 2**62):
            rogue.send(Hello(role="learn", incarnation=incarnation, step=0, token="right"))
        rogue.send(StepDone(step=0, incarnation=0))
        refused.send(Hello(role="learn", incarnation=2**62, step=0, token="right"))
        trainer.send(StepDone(step=0, incarnation=0))
        assert await asyncio.wait_for(serve.recv(admit=admit), 5) == StepDone(step=0, incarnation=0)
        with pytest.raises(TimeoutError):  # the rogue's StepDone is not heard either
            await asyncio.wait_for(serve.recv(admit=admit), 1)
        assert serve.refused == 6
        await serve.send(Assigned(step=1, group=make_group(samples=1, tokens=8)))
        got = await asyncio.to_thread(trainer.recv, timeout_s=5, waiting_for="a group")
        assert isinstance(got, Assigned) and got.step == 1
        for peer in (rogue, refused):
            with pytest.raises(ServerTimeout):
                peer.recv(timeout_s=0.2, waiting_for="a group")
        # The trainer leaves: the newest held hello (2**62) is checked again, and refused.
        trainer.close()
        refused.send(StepDone(step=1, incarnation=0))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(serve.recv(admit=admit), 1)
        with pytest.raises(ServerUnavailable, match="disconnected"):
            await serve.send(Assigned(step=1, group=make_group(samples=1, tokens=8)))
    finally:
        for link in (trainer, rogue, refused):
            link.close()
        serve.close()


async def test_what_a_trainer_sent_before_it_left_is_still_read() -> None:
    """A trainer's last messages (its final `Durable`) may be read after its disconnection is
    seen: they still count; a send to it fails, and a new trainer may say hello."""
    serve = ServeLink()
    first, second = LearnLink(serve.address), LearnLink(serve.address)
    try:
        first.send(Hello(role="learn", incarnation=0, step=0))
        assert isinstance(await asyncio.wait_for(serve.recv(), 5), Hello)
        first.send(StepDone(step=0, incarnation=0))
        first.close()
        await asyncio.sleep(0.5)  # the disconnection is on the monitor before the message is read
        assert await asyncio.wait_for(serve.recv(), 5) == StepDone(step=0, incarnation=0)
        second.send(Hello(role="learn", incarnation=1, step=1))
        hello = await asyncio.wait_for(serve.recv(), 5)
        assert isinstance(hello, Hello) and hello.incarnation == 1
    finally:
        second.close()
        serve.close()


async def test_ipv6_loopback_link() -> None:
    serve = ServeLink(host="::1")
    learn = LearnLink(serve.address)
    try:
        assert serve.address.startswith("tcp://[::1]:")
        learn.send(Hello(role="learn", incarnation=0, step=0))
        assert isinstance(await asyncio.wait_for(serve.recv(), 5), Hello)
    finally:
        learn.close()
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


# -- security and bad input --------------------------------------------------------------------


def _keys(tmp_path: Path) -> tuple[CurveKeys, CurveKeys]:
    """(serve's keys, the trainer's keys), from key files as zmq.auth writes them: each side holds
    its own secret file and the other's public file."""
    import zmq.auth

    server_public, server_secret = zmq.auth.create_certificates(tmp_path, "server")
    client_public, client_secret = zmq.auth.create_certificates(tmp_path, "client")
    serve = ServeConfig(link_server_key=server_secret, link_client_key=client_public)
    learn = ServeConfig(link_server_key=server_public, link_client_key=client_secret)
    serve_keys, learn_keys = CurveKeys.from_config(serve), CurveKeys.from_config(learn)
    assert serve_keys is not None and learn_keys is not None
    return serve_keys, learn_keys


async def test_curve_link_works_end_to_end(tmp_path: Path) -> None:
    serve_keys, learn_keys = _keys(tmp_path)
    serve = ServeLink(curve=serve_keys)
    learn = LearnLink(serve.address, curve=learn_keys)
    try:
        learn.send(Hello(role="learn", incarnation=0, step=0))
        assert isinstance(await asyncio.wait_for(serve.recv(), 5), Hello)
        group = make_group(samples=2, tokens=16)
        await serve.send(Assigned(step=0, group=group))
        got = await asyncio.to_thread(learn.recv, timeout_s=5, waiting_for="a group")
        assert isinstance(got, Assigned) and got.group == group
    finally:
        learn.close()
        serve.close()


async def test_curve_link_refuses_a_trainer_with_another_key(tmp_path: Path) -> None:
    import zmq

    serve_keys, learn_keys = _keys(tmp_path)
    stranger_public, stranger_secret = zmq.curve_keypair()
    stranger_keys = CurveKeys(
        server_public=learn_keys.server_public,
        server_secret=None,
        client_public=stranger_public,
        client_secret=stranger_secret,
    )
    plain = CurveKeys(  # right client key, but it trusts another server
        server_public=stranger_public,
        server_secret=None,
        client_public=learn_keys.client_public,
        client_secret=learn_keys.client_secret,
    )
    serve = ServeLink(curve=serve_keys)
    stranger = LearnLink(serve.address, curve=stranger_keys)
    fooled = LearnLink(serve.address, curve=plain)
    unencrypted = LearnLink(serve.address)
    try:
        for link in (stranger, fooled, unencrypted):
            link.send(Hello(role="learn", incarnation=7, step=0))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(serve.recv(), 1.5)
        assert serve.hello is None
    finally:
        for link in (stranger, fooled, unencrypted):
            link.close()
        serve.close()


def test_off_loopback_bind_needs_curve_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"serve\.link_server_key and serve\.link_client_key"):
        ServeLink(host="0.0.0.0")
    with pytest.raises(ConfigError, match=r"set serve\.link_client_key"):
        ServeLink.from_config(ServeConfig(link_server_key="x" * 40))
    with pytest.raises(ConfigError, match=r"serve\.link_client_key = 'nope'"):
        CurveKeys.from_config(ServeConfig(link_server_key="x" * 40, link_client_key="nope"))
    serve_keys, learn_keys = _keys(tmp_path)
    with pytest.raises(ConfigError, match="secret key"):
        ServeLink(curve=learn_keys)  # serve was given the server's public file only
    with pytest.raises(ConfigError, match="secret key"):
        LearnLink("tcp://127.0.0.1:9", curve=serve_keys)


async def test_malformed_frames_are_dropped_not_fatal() -> None:
    import zmq

    serve = ServeLink()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(serve.address)
    try:
        raw.send(b"\xc1 not msgpack")
        raw.send_multipart([b"two", b"frames"])
        raw.send(encode(Assigned(step=0, group=make_group(samples=1, tokens=4))))  # wrong way
        raw.send(encode(Hello(role="learn", incarnation=5, step=0)))  # same pipe: arrives last
        hello = await asyncio.wait_for(serve.recv(), 5)
        assert isinstance(hello, Hello) and hello.incarnation == 5
        assert serve.dropped == 3
    finally:
        raw.close()
        ctx.term()
        serve.close()


def test_trainer_drops_a_malformed_frame_and_keeps_waiting() -> None:
    import zmq

    ctx = zmq.Context()
    fake_serve = ctx.socket(zmq.ROUTER)
    fake_serve.setsockopt(zmq.LINGER, 0)
    port = fake_serve.bind_to_random_port("tcp://127.0.0.1")
    learn = LearnLink(f"tcp://127.0.0.1:{port}")
    try:
        learn.send(Hello(role="learn", incarnation=0, step=0))
        peer, _ = fake_serve.recv_multipart()
        fake_serve.send_multipart([peer, b"\x92garbage"])
        fake_serve.send_multipart([peer, encode(StepClosed(step=0, num_groups=1))])
        assert learn.recv(timeout_s=5, waiting_for="step 0") == StepClosed(step=0, num_groups=1)
        assert learn.dropped == 1
        fake_serve.send_multipart([peer, b"\xff"])
        with pytest.raises(ServerTimeout, match="step 1"):
            learn.recv(timeout_s=0.3, waiting_for="step 1")
    finally:
        learn.close()
        fake_serve.close()
        ctx.term()


async def test_a_message_over_the_size_limit_never_arrives() -> None:
    serve = ServeLink(max_message_bytes=1 << 16)
    learn = LearnLink(serve.address)
    try:
        learn.send(Hello(role="learn", incarnation=0, step=0))
        assert isinstance(await asyncio.wait_for(serve.recv(), 5), Hello)
        big = WeightChunk(
            version=1,
            index=0,
            names=["w"],
            dtypes=["float32"],
            shapes=[[1 << 15]],
            data=[bytes(1 << 17)],
        )
        learn.send(big)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(serve.recv(), 1.0)
        # The trainer's socket reconnects, says hello again, and the link carries on.
        learn.send(Hello(role="learn", incarnation=0, step=0))
        learn.send(StepDone(step=0, incarnation=0))
        assert isinstance(await asyncio.wait_for(serve.recv(), 5), Hello)
        assert await asyncio.wait_for(serve.recv(), 5) == StepDone(step=0, incarnation=0)
    finally:
        learn.close()
        serve.close()


async def test_a_refused_hello_with_the_token_is_answered_with_the_reason() -> None:
    """A trainer of this run that serve's check refuses learns why and serve's incarnation
    (`Refused`) instead of waiting for groups that never come; a hello without the token is
    still never answered."""
    serve = ServeLink(token="right")
    ours, stranger = LearnLink(serve.address), LearnLink(serve.address)

    def admit(hello: Hello) -> str | None:
        return None if hello.incarnation == 1 else "serve is at incarnation 0"

    def answer(hello: Hello, why: str) -> Refused:
        return Refused(reason=why, incarnation=0)

    try:
        ours.send(Hello(role="learn", incarnation=3, step=2, token="right"))
        stranger.send(Hello(role="learn", incarnation=3, step=2, token="wrong"))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(serve.recv(admit=admit, answer=answer), 1)
        got = await asyncio.to_thread(ours.recv, timeout_s=5, waiting_for="serve's answer")
        assert got == Refused(reason="serve is at incarnation 0", incarnation=0)
        with pytest.raises(ServerTimeout):
            stranger.recv(timeout_s=0.5, waiting_for="anything")
        assert serve.refused == 2
    finally:
        for link in (ours, stranger):
            link.close()
        serve.close()


async def test_inline_weights_are_decoded_off_the_loop(monkeypatch) -> None:
    """A frame of weights (at least DECODE_OFF_LOOP_BYTES) is decoded in a worker thread, so the
    loop goes on meanwhile; a small message is decoded on the loop, without a thread hop."""
    import threading

    import dora.link

    decoded_in: list[int] = []
    decode = dora.link.decode_from_learn

    def recording(frame: bytes | memoryview) -> object:
        decoded_in.append(threading.get_ident())
        return decode(frame)

    monkeypatch.setattr(dora.link, "decode_from_learn", recording)
    serve = ServeLink()
    learn = LearnLink(serve.address)
    data = bytes(range(256)) * (dora.link.DECODE_OFF_LOOP_BYTES // 256 + 1)
    chunk = WeightChunk(
        version=1, index=0, names=["w"], dtypes=["uint8"], shapes=[[len(data)]], data=[data]
    )
    try:
        learn.send(Hello(role="learn", incarnation=0, step=0))
        assert isinstance(await asyncio.wait_for(serve.recv(), 5), Hello)
        learn.send(chunk)
        assert await asyncio.wait_for(serve.recv(), 5) == chunk
    finally:
        learn.close()
        serve.close()
    loop_thread = threading.get_ident()
    assert decoded_in[0] == loop_thread and decoded_in[1] != loop_thread
