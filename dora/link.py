"""The ZeroMQ link between `dora serve` and `dora learn`.

One TCP port, bound by serve: a ROUTER socket on serve's side and a DEALER on the trainer's rank 0.
The trainer speaks first (`Hello`); serve sends only to the trainer that said hello most recently,
so a restarted trainer (a new DEALER identity) takes over the link and the old one is forgotten.
Frames are msgpack (dora.protocol); nothing is pickled.

Serve's side is asyncio (`ServeLink`); the trainer's side is a plain blocking socket
(`LearnLink`), because the trainer's step loop is synchronous torch and only its receiver touches
sockets. Every receive has a deadline and says what it was waiting for when it expires.
"""

from __future__ import annotations

import asyncio
import hmac

import zmq
import zmq.asyncio

from dora.errors import ProtocolError, ServerTimeout, ServerUnavailable
from dora.protocol import (
    Hello,
    LearnMessage,
    ServeMessage,
    decode_from_learn,
    decode_from_serve,
    encode,
)

_HWM = 1000  # bounded queues: backpressure instead of unbounded memory


class ServeLink:
    """Serve's end: binds, accepts the trainer's hello, sends groups, receives acks."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, token: str = "") -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, _HWM)
        self._sock.setsockopt(zmq.RCVHWM, _HWM)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if port == 0:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        self.address = f"tcp://{host}:{self.port}"
        self._token = token
        self._peer: bytes | None = None
        self.hello: Hello | None = None
        self.connected = asyncio.Event()

    async def recv(self) -> LearnMessage:
        """The next message from the trainer. A `Hello` (re)binds the link to its sender."""
        while True:
            peer, frame = await self._sock.recv_multipart()
            message = decode_from_learn(frame)
            if isinstance(message, Hello):
                if self._token and not hmac.compare_digest(message.token, self._token):
                    continue  # a peer without the shared token is ignored, never answered
                self._peer, self.hello = peer, message
                self.connected.set()
                return message
            if peer != self._peer:
                continue  # an old incarnation still talking after a restart
            return message

    async def send(self, message: ServeMessage, *, timeout_s: float = 60.0) -> None:
        """Send to the current trainer; waits (bounded) for it to connect first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.connected.wait()
                assert self._peer is not None
                await self._sock.send_multipart([self._peer, encode(message)])
        except TimeoutError:
            raise ServerTimeout(
                f"no trainer connected to {self.address} within {timeout_s:.0f} s"
            ) from None
        except zmq.ZMQError as exc:
            raise ServerUnavailable(f"trainer on {self.address} is gone: {exc}") from exc

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


class LearnLink:
    """The trainer's end: connects, says hello, receives groups, sends acks and weights."""

    def __init__(self, address: str, *, send_timeout_s: float = 120.0) -> None:
        self.address = address
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.setsockopt(zmq.SNDHWM, _HWM)
        self._sock.setsockopt(zmq.RCVHWM, _HWM)
        # a full send queue (serve gone, weights still streaming) fails instead of hanging
        self._sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        self._send_timeout_s = send_timeout_s
        self._sock.connect(address)

    def send(self, message: LearnMessage) -> None:
        try:
            self._sock.send(encode(message))
        except zmq.Again:
            raise ServerTimeout(
                f"could not send {type(message).__name__} to {self.address} within "
                f"{self._send_timeout_s:.0f} s: dora serve is not reading; is it up?"
            ) from None

    def recv(self, *, timeout_s: float, waiting_for: str) -> ServeMessage:
        """The next message from serve; `ServerTimeout` names `waiting_for` when none comes."""
        if not self._sock.poll(timeout=int(timeout_s * 1000)):
            raise ServerTimeout(
                f"waited {timeout_s:.0f} s on {self.address} for {waiting_for}; is dora serve up?"
            )
        frame = self._sock.recv()
        try:
            return decode_from_serve(frame)
        except ProtocolError as exc:
            raise ProtocolError(f"{self.address}: {exc}") from exc

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
