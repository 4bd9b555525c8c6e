"""The messages between serve (the coordinator) and its episode runners: msgpack, never pickle.

One ZeroMQ connection per runner (a DEALER on the runner, serve's ROUTER). The runner speaks
first (`RunnerHello`, with the run's token); serve answers only a hello it admits (`Welcome`).
Then, per episode:

    serve -> runner   RunEpisode(lease, attempt, task, params)
    runner -> serve   NeedRoute(lease, attempt, seq)              one per call of the episode
    serve -> runner   Route(instance, url, call id, version, session) | CallDone(refused/error)
    runner -> serve   CallEnd(tokens, finish | failure)           the runner made the call itself
    serve -> runner   CallDone(interrupted?)                      the router's verdict on a call
                                                                  that ended in "abort" or failed
    runner -> serve   EpisodeDone(sample) | EpisodeFailed(error)
    serve -> runner   StopEpisode                                  the group was stopped

`Beat` goes every `serve.runner_timeout_s / 5` seconds, and serve answers each with one: each
side notices the other's silence. An episode is named by its lease and its attempt (a number
serve never gives twice: a re-run after a lost runner, or a group's retry, is a new attempt), a
call by those and its `seq`, so nothing a runner sends about an episode it no longer owns can be
taken for the current one.

A call that ended well (finish "stop" or "length", no failure) has no verdict to wait for: the
runner goes on with its tokens at once and serve sends no `CallDone` for it, which saves a message
and a round trip on most calls. Its tokens stand even if serve had meanwhile declared the instance
dead (the call had already been answered in full by the version it pinned).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from dora.errors import ProtocolError
from dora.protocol import FinishReason, Sample, SamplingParams

__all__ = [
    "Beat",
    "CallDone",
    "CallEnd",
    "CoordinatorMessage",
    "EpisodeDone",
    "EpisodeFailed",
    "NeedRoute",
    "Route",
    "RunEpisode",
    "RunnerHello",
    "RunnerMessage",
    "StopEpisode",
    "Welcome",
    "decode_from_coordinator",
    "decode_from_runner",
    "encode",
]


class RunnerHello(msgspec.Struct, tag="runner_hello", kw_only=True):
    token: str
    name: str
    """Unique among the runners connected at once (serve's own are `local-0`, `local-1`, ...)."""


class Beat(msgspec.Struct, tag="beat", kw_only=True):
    cpu_s: float = 0.0
    """From a runner: the CPU seconds its process has used (all threads) since serve welcomed it;
    its start-up is not counted, as serve's is not (the bench measures from serve's first tick)."""


class NeedRoute(msgspec.Struct, tag="need_route", kw_only=True):
    lease: str
    attempt: int
    seq: int


class CallEnd(msgspec.Struct, tag="call_end", kw_only=True):
    lease: str
    attempt: int
    seq: int
    tokens: int = 0
    finish: FinishReason = "stop"
    failure: Literal["", "unavailable", "request", "error"] = ""
    """How the call failed, if it did: the instance was unreachable, refused the request as
    malformed, or failed otherwise."""
    error: str = ""

    @property
    def ended_well(self) -> bool:
        """The call was answered in full: no `CallDone` follows (module docstring)."""
        return not self.failure and self.finish != "abort"


class EpisodeDone(msgspec.Struct, tag="episode_done", kw_only=True):
    lease: str
    attempt: int
    sample: Sample
    cpu_s: float = 0.0
    """The CPU seconds the runner's process has used so far, as in `Beat`."""


class EpisodeFailed(msgspec.Struct, tag="episode_failed", kw_only=True):
    lease: str
    attempt: int
    error: str


RunnerMessage = RunnerHello | Beat | NeedRoute | CallEnd | EpisodeDone | EpisodeFailed


class Welcome(msgspec.Struct, tag="welcome", kw_only=True):
    heartbeat_s: float


class RunEpisode(msgspec.Struct, tag="run_episode", kw_only=True):
    lease: str
    attempt: int
    version: int
    prompt_id: str
    data: dict[str, object]
    params: SamplingParams


class Route(msgspec.Struct, tag="route", kw_only=True):
    lease: str
    attempt: int
    seq: int
    instance: str
    url: str
    call_id: str
    version: int | None
    """The version the call pins (None in mode inflight)."""
    session: str | None


class CallDone(msgspec.Struct, tag="call_done", kw_only=True):
    lease: str
    attempt: int
    seq: int
    interrupted: bool = False
    """The call was interrupted (moved, parked, its instance lost): call again with the tokens."""
    refused: str = ""
    """The call can run on no instance, or the instance refused it as malformed."""
    error: str = ""
    """The call failed as no policy covers: the episode raises it."""


class StopEpisode(msgspec.Struct, tag="stop_episode", kw_only=True):
    lease: str
    attempt: int


CoordinatorMessage = Welcome | Beat | RunEpisode | Route | CallDone | StopEpisode

_encoder = msgspec.msgpack.Encoder()
_from_runner = msgspec.msgpack.Decoder(RunnerMessage)
_from_coordinator = msgspec.msgpack.Decoder(CoordinatorMessage)


def encode(message: RunnerMessage | CoordinatorMessage) -> bytes:
    return _encoder.encode(message)


def decode_from_runner(frame: bytes) -> RunnerMessage:
    """A runner's frame; `ProtocolError` if it is not one of its messages."""
    try:
        return _from_runner.decode(frame)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed message from a runner: {exc}") from exc


def decode_from_coordinator(frame: bytes) -> CoordinatorMessage:
    """Serve's frame; `ProtocolError` if it is not one of its messages."""
    try:
        return _from_coordinator.decode(frame)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed message from dora serve: {exc}") from exc
