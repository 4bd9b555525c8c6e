"""The ZeroMQ link between `dora serve` and `dora learn`.

One TCP port, bound by serve: a ROUTER socket on serve's side and a DEALER on the trainer's rank 0.
The trainer speaks first (`Hello`). Serve binds the link to one peer at a time, the one whose hello
it admitted, and hears and sends to that peer only: a restarted trainer (a new DEALER identity)
takes over the link once the old one is gone. Frames are msgpack (dora.protocol); nothing is
pickled.

Who holds the link. A hello binds its sender only if it carries the token (when one is set), no
other trainer is connected, and the caller's `admit` check passes (serve's trainer link admits an
incarnation it could have issued, `dora.serve.trainer_link`). Anything else is refused: logged
(at most one line per `REFUSAL_LOG_S`, with a count), and the bound trainer keeps the link; a
hello without the token is never answered, one with it that serve's check refuses is answered
with the reason (`Refused`), so a trainer of this run stops with it instead of waiting.
"Connected" is read from the socket's monitor: a peer is identified by its routing id and
the connection (file descriptor) its frames arrive on; its `DISCONNECTED` event marks it gone
(what it sent before it left is still read, a send to it fails, and another trainer may say
hello). A hello refused only because another trainer held the link is kept (the newest one) and
admitted when that trainer disconnects, so a restarted trainer whose hello overtakes the news of
its predecessor's death is not lost. Messages other than a hello count only from the bound peer.

Serve's side is asyncio (`ServeLink`); the trainer's side is a plain blocking socket
(`LearnLink`), because the trainer's step loop is synchronous torch and only its receiver touches
sockets. Every receive has a deadline and says what it was waiting for when it expires.

Security. The link binds 127.0.0.1 by default. Off loopback it refuses to bind without
CURVE keys (`serve.link_server_key`, `serve.link_client_key`): with them, ZeroMQ encrypts every
frame, the trainer only talks to a serve holding the server's secret key, and serve's ZAP handler
admits only the trainer's public key (anyone else's handshake is refused, so their frames never
reach `recv`). The `Hello` token (`serve.token`) is checked on top, on any address. Each socket
drops a peer whose message exceeds `serve.link_max_message_bytes` (ZMQ_MAXMSGSIZE), and a frame
that does not decode is logged and dropped: a bad peer never crashes the other side.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from dora.config import ServeConfig
from dora.errors import ConfigError, ProtocolError, ServerTimeout, ServerUnavailable
from dora.net import is_loopback
from dora.protocol import (
    Hello,
    LearnMessage,
    ServeMessage,
    decode_from_learn,
    decode_from_serve,
    encode,
)

log = logging.getLogger("dora.link")

_HWM = 1000  # bounded queues: backpressure instead of unbounded memory
DEFAULT_MAX_MESSAGE_BYTES = 4 << 30  # an inline weight chunk holds at least one whole tensor
REFUSAL_LOG_S = 10.0
"""At most one log line per this many seconds for refused hellos: a flood does not fill the log."""
DECODE_OFF_LOOP_BYTES = 1 << 20
"""A frame from the trainer at least this large (inline weights) is decoded in a worker thread:
decoding half a gigabyte of tensors held serve's loop for 1.7 s, and every call waited."""
_MONITORED = zmq.EVENT_DISCONNECTED
_Z85 = set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


@dataclass(frozen=True, kw_only=True)
class CurveKeys:
    """CURVE keys of the link (Z85). Each side needs its own secret key and the other's public
    key; the other side's secret may be absent (a public key file is enough)."""

    server_public: bytes
    server_secret: bytes | None
    client_public: bytes
    client_secret: bytes | None

    @classmethod
    def from_config(cls, serve: ServeConfig) -> CurveKeys | None:
        """The keys named by `serve.link_server_key` and `serve.link_client_key`; None if neither
        is set."""
        if not serve.link_server_key and not serve.link_client_key:
            return None
        missing = [
            key
            for key, value in (
                ("serve.link_server_key", serve.link_server_key),
                ("serve.link_client_key", serve.link_client_key),
            )
            if not value
        ]
        if missing:
            raise ConfigError(f"CURVE on the trainer link needs both keys: set {missing[0]}")
        server = read_curve_key(serve.link_server_key, key="serve.link_server_key")
        client = read_curve_key(serve.link_client_key, key="serve.link_client_key")
        return cls(
            server_public=server[0],
            server_secret=server[1],
            client_public=client[0],
            client_secret=client[1],
        )


def read_curve_key(value: str, *, key: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) of a Z85 secret key or a `zmq.auth` key file; errors name `key`."""
    if len(value) == 40 and set(value) <= _Z85 and not os.path.exists(value):
        secret = value.encode()
        return zmq.curve_public(secret), secret
    try:
        loaded: tuple[bytes, bytes | None] = zmq.auth.load_certificate(value)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{key} = {value!r} is neither a 40-character Z85 secret key nor a readable "
            f"zmq.auth key file ({exc})"
        ) from None
    return loaded


Admit = Callable[[Hello], str | None]
"""Serve's check of a hello: None admits it, a string says why it is refused."""

Answer = Callable[[Hello, str], ServeMessage]
"""What serve answers a hello that carried the token but that `Admit` refused (and why)."""


@dataclass(frozen=True)
class _Peer:
    """A peer of the ROUTER: its routing id and the connection its frames arrive on."""

    routing_id: bytes
    fd: int


class ServeLink:
    """Serve's end: binds, accepts the trainer's hello, sends groups, receives acks."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str = "",
        curve: CurveKeys | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        check_server_keys(host, curve, what="the trainer link")
        self._ctx = zmq.asyncio.Context()
        self._sock, self._auth = router_socket(self._ctx, curve, max_message_bytes)
        try:
            self.port, self.address = bind_router(self._sock, host, port)
        except zmq.ZMQError as exc:
            self.close()
            raise ServerUnavailable(
                f"cannot bind the trainer link to {host}:{port}: {exc}"
            ) from exc
        self._token = token
        self._monitor = self._sock.get_monitor_socket(_MONITORED)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self._monitor, zmq.POLLIN)
        self._poller.register(self._sock, zmq.POLLIN)
        self._peer: _Peer | None = None
        self._gone = False
        """The bound trainer disconnected: nothing more is sent to it, another may say hello, and
        what it sent before it left is still read (its frames outlive the connection)."""
        self._waiting: tuple[_Peer, Hello] | None = None
        """The newest authentic hello refused because another trainer held the link."""
        self._answers: list[tuple[_Peer, ServeMessage]] = []
        """Answers to authentic hellos that `admit` refused, sent on the next turn of `recv`."""
        self.sent_messages = self.sent_bytes = 0
        self.received_messages = self.received_bytes = 0
        self.hello: Hello | None = None
        self.dropped = 0
        """Frames that did not decode (logged and dropped)."""
        self.refused = 0
        """Hellos refused: without the token, while another trainer is connected, not admitted."""
        self._refusals_logged_at = -REFUSAL_LOG_S
        self._refusals_unlogged = 0
        self.connected = asyncio.Event()
        """Set once a trainer was bound (it stays set: a send to a trainer gone since fails)."""

    @classmethod
    def from_config(cls, serve: ServeConfig) -> ServeLink:
        """The link `serve.*` describes: address, token, CURVE keys, message size limit."""
        return cls(
            host=serve.host,
            port=serve.port,
            token=serve.token,
            curve=CurveKeys.from_config(serve),
            max_message_bytes=serve.link_max_message_bytes,
        )

    async def recv(
        self, *, admit: Admit | None = None, answer: Answer | None = None
    ) -> LearnMessage:
        """The next message from the bound trainer, or a hello that now holds the link.

        A hello binds its sender when it carries the token, no other trainer is connected, and
        `admit(hello)` returns None (otherwise it returns why the hello is refused); see the
        module docstring. A hello held back while another trainer was connected is admitted
        (checked again) when that trainer disconnects. A hello with the token that `admit`
        refuses gets `answer(hello, why)`, so a trainer of this run learns why instead of
        waiting; one without the token is never answered."""
        while True:
            await self._send_answers()
            ready = dict(await self._poller.poll())
            if self._monitor in ready:
                waiting = await self._watch()
                if waiting is not None and self._bind(*waiting, admit, answer):
                    return waiting[1]
            if self._sock not in ready:
                continue
            frames = await self._sock.recv_multipart(copy=False)
            if len(frames) != 2:
                self._drop(f"{len(frames) - 1} frames in one message, expected 1")
                continue
            peer = _Peer(frames[0].bytes, frames[1].get(zmq.SRCFD))
            frame = frames[1].buffer
            self.received_messages += 1
            self.received_bytes += len(frame)
            try:
                if len(frame) >= DECODE_OFF_LOOP_BYTES:
                    message = await asyncio.to_thread(decode_from_learn, frame)
                else:
                    message = decode_from_learn(frame)
            except ProtocolError as exc:
                self._drop(str(exc))
                continue
            if isinstance(message, Hello):
                if self._hello(peer, message, admit, answer):
                    return message
            elif peer == self._peer:
                return message
            # else: not the bound trainer (an old incarnation, or a peer that never said hello)

    def _hello(self, peer: _Peer, hello: Hello, admit: Admit | None, answer: Answer | None) -> bool:
        """Whether `hello` binds `peer` now (see `recv`)."""
        if self._token and not hmac.compare_digest(hello.token.encode(), self._token.encode()):
            self._refuse(hello, "it does not carry serve.token (the run's secret)")
            return False
        if self._peer is not None and not self._gone and peer != self._peer:
            self._waiting = (peer, hello)
            self._refuse(hello, "another trainer is connected; it is heard once that one is gone")
            return False
        return self._bind(peer, hello, admit, answer)

    def _bind(self, peer: _Peer, hello: Hello, admit: Admit | None, answer: Answer | None) -> bool:
        problem = admit(hello) if admit is not None else None
        if problem is not None:
            self._refuse(hello, problem)
            if answer is not None:
                self._answers.append((peer, answer(hello, problem)))
            return False
        self._peer, self.hello, self._gone = peer, hello, False
        self.connected.set()
        return True

    async def _watch(self) -> tuple[_Peer, Hello] | None:
        """Read one monitor event; when the bound trainer disconnected, the hello that waited for
        the link (if its sender is still connected)."""
        event = parse_monitor_message(await self._monitor.recv_multipart())
        fd = int(event["value"])
        waiting, self._waiting = self._waiting, None
        if waiting is not None and waiting[0].fd != fd:
            self._waiting = waiting
        if self._peer is None or self._gone or self._peer.fd != fd:
            return None
        log.info("%s: the trainer disconnected", self.address)
        self._gone = True
        waiting, self._waiting = self._waiting, None
        return waiting

    def _refuse(self, hello: Hello, problem: str) -> None:
        """Count a refused hello; log it unless a line was logged within `REFUSAL_LOG_S`."""
        self.refused += 1
        now = time.monotonic()
        if now - self._refusals_logged_at < REFUSAL_LOG_S:
            self._refusals_unlogged += 1
            return
        more = f" ({self._refusals_unlogged} more refused since the last line)"
        log.warning(
            "%s: refused a hello (incarnation %d, step %d): %s%s",
            *(self.address, hello.incarnation, hello.step, problem),
            more if self._refusals_unlogged else "",
        )
        self._refusals_logged_at, self._refusals_unlogged = now, 0

    async def _send_answers(self) -> None:
        """Send the queued answers; a peer gone since simply misses its answer."""
        answers, self._answers = self._answers, []
        for peer, message in answers:
            with contextlib.suppress(zmq.ZMQError):
                await self._sock.send_multipart([peer.routing_id, encode(message)])

    def _drop(self, problem: str) -> None:
        self.dropped += 1
        log.warning("%s: dropped a malformed message: %s", self.address, problem)

    async def send(self, message: ServeMessage, *, timeout_s: float = 60.0) -> None:
        """Send to the current trainer; waits (bounded) for it to connect first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.connected.wait()
                if self._peer is None or self._gone:
                    raise ServerUnavailable(f"the trainer on {self.address} disconnected")
                frame = encode(message)
                await self._sock.send_multipart([self._peer.routing_id, frame])
                self.sent_messages += 1
                self.sent_bytes += len(frame)
        except TimeoutError:
            raise ServerTimeout(
                f"no trainer connected to {self.address} within {timeout_s:.0f} s"
            ) from None
        except zmq.ZMQError as exc:
            raise ServerUnavailable(f"trainer on {self.address} is gone: {exc}") from exc

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.term()


def check_server_keys(host: str, curve: CurveKeys | None, *, what: str) -> None:
    """A link bound on `host` off loopback needs CURVE keys, and serve needs the server's
    secret one; `what` names the link in the error."""
    if not is_loopback(host) and curve is None:
        raise ConfigError(
            f"serve.host = {host!r} is off loopback: {what} needs CURVE keys; set "
            "serve.link_server_key and serve.link_client_key (key files from "
            "zmq.auth.create_certificates, or Z85 secret keys from zmq.curve_keypair)"
        )
    if curve is not None and curve.server_secret is None:
        raise ConfigError(
            "serve.link_server_key names a public key: dora serve needs the server's secret "
            "key (the .key_secret file)"
        )


def router_socket(
    ctx: zmq.asyncio.Context,
    curve: CurveKeys | None,
    max_message_bytes: int,
    *,
    send_hwm: int = _HWM,
) -> tuple[zmq.asyncio.Socket, ThreadAuthenticator | None]:
    """serve's ROUTER socket of a link, not yet bound: bounded queues (`send_hwm` messages per
    peer going out, 0: no bound), peers whose message exceeds `max_message_bytes` dropped, and
    with `curve` a CURVE server whose ZAP handler admits only `curve.client_public` (the
    authenticator is the caller's to stop)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, send_hwm)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    auth: ThreadAuthenticator | None = None
    if curve is not None:
        assert curve.server_secret is not None
        auth = ThreadAuthenticator(ctx, log=log)
        auth.start()
        auth.configure_curve_callback("*", _OneClient(curve.client_public))
        sock.curve_secretkey = curve.server_secret
        sock.curve_publickey = curve.server_public
        sock.curve_server = True
    return sock, auth


def bind_router(sock: zmq.asyncio.Socket, host: str, port: int) -> tuple[int, str]:
    """Bind `sock` on `host:port` (0: a random port); its port and `tcp://` address."""
    shown = f"[{host}]" if ":" in host else host
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    if port == 0:
        port = sock.bind_to_random_port(f"tcp://{shown}")
    else:
        sock.bind(f"tcp://{shown}:{port}")
    return port, f"tcp://{shown}:{port}"


def check_client_keys(curve: CurveKeys | None) -> None:
    """A client of a link needs its own secret key, not only the public one."""
    if curve is not None and curve.client_secret is None:
        raise ConfigError(
            "serve.link_client_key names a public key: this side needs its secret key "
            "(the .key_secret file)"
        )


def curve_client(sock: zmq.Socket[bytes] | zmq.asyncio.Socket, curve: CurveKeys | None) -> None:
    """Make a DEALER a CURVE client of the server `curve` names (nothing without keys); also
    lets it reach `tcp://[::1]:port` (IPv4 addresses work as before)."""
    check_client_keys(curve)
    if curve is not None:
        assert curve.client_secret is not None
        sock.curve_secretkey = curve.client_secret
        sock.curve_publickey = curve.client_public
        sock.curve_serverkey = curve.server_public
    sock.setsockopt(zmq.IPV6, 1)


class _OneClient:
    """The ZAP credentials check: only the configured trainer's public key gets in."""

    def __init__(self, public: bytes) -> None:
        self._public = public

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self._public):
            return True
        log.warning("trainer link: refused a peer whose CURVE key is not serve.link_client_key")
        return False


class LearnLink:
    """The trainer's end: connects, says hello, receives groups, sends acks and weights."""

    def __init__(
        self,
        address: str,
        *,
        send_timeout_s: float = 120.0,
        curve: CurveKeys | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        check_client_keys(curve)
        self.address = address
        self.dropped = 0
        """Frames that did not decode (logged and dropped)."""
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.setsockopt(zmq.SNDHWM, _HWM)
        self._sock.setsockopt(zmq.RCVHWM, _HWM)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        # a full send queue (serve gone, weights still streaming) fails instead of hanging
        self._sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        curve_client(self._sock, curve)
        self._send_timeout_s = send_timeout_s
        self._sock.connect(address)

    @classmethod
    def from_config(cls, address: str, serve: ServeConfig) -> LearnLink:
        """The trainer's end of the link `serve.*` describes, connected to `address`."""
        return cls(
            address,
            curve=CurveKeys.from_config(serve),
            max_message_bytes=serve.link_max_message_bytes,
        )

    def send(self, message: LearnMessage) -> None:
        try:
            self._sock.send(encode(message))
        except zmq.Again:
            raise ServerTimeout(
                f"could not send {type(message).__name__} to {self.address} within "
                f"{self._send_timeout_s:.0f} s: dora serve is not reading; is it up?"
            ) from None

    def recv(self, *, timeout_s: float, waiting_for: str) -> ServeMessage:
        """The next message from serve; `ServerTimeout` names `waiting_for` when none comes.

        A frame that does not decode is logged and dropped, and the wait goes on (same deadline).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(timeout=left_ms):
                raise ServerTimeout(
                    f"waited {timeout_s:.0f} s on {self.address} for {waiting_for}; "
                    "is dora serve up?"
                )
            frame = self._sock.recv()
            try:
                return decode_from_serve(frame)
            except ProtocolError as exc:
                self.dropped += 1
                log.warning("%s: dropped a malformed message: %s", self.address, exc)

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
