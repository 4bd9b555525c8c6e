"""Rank 0 talks to `dora serve`; every rank sees the same stream of messages, in the same order.

Rank 0 owns the `LearnLink`. Each message it receives is re-encoded as its msgpack frame and
broadcast as raw bytes (a length, then a uint8 tensor) over a gloo group, and every other rank
decodes it with the same msgspec decoder: nothing is pickled, and every rank runs the same
deterministic planning on the same groups, so they stay in lockstep without any other coordination.

If rank 0 fails while the other ranks wait in a broadcast, it broadcasts a `Shutdown` whose reason
starts with `ABORT_PREFIX` first; the other ranks raise on it (no checkpoint, no collective), so a
failure ends every rank instead of leaving them hanging until the collective times out. A failure
on another rank is torchrun's to handle: it stops every worker.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dora.config import ServeConfig
from dora.errors import DoraError
from dora.link import LearnLink
from dora.protocol import LearnMessage, ServeMessage, Shutdown, decode_from_serve, encode

ABORT_PREFIX = "abort: "


class Receiver:
    """The trainer's side of the link, as every rank sees it."""

    def __init__(
        self,
        *,
        address: str,
        rank: int,
        world: int,
        group: dist.ProcessGroup | None,
        recv_timeout_s: float,
        serve: ServeConfig | None = None,
    ) -> None:
        self.address = address
        self.recv_timeout_s = recv_timeout_s  # learn.recv_timeout_s: generous, groups take long
        self.rank = rank
        self.world = world
        self._group = group
        self._link: LearnLink | None = None
        if rank == 0:
            self._link = (
                LearnLink.from_config(address, serve) if serve is not None else LearnLink(address)
            )
        self._aborted = False

    def send(self, message: LearnMessage) -> None:
        """Send to serve (rank 0 only; a no-op on the other ranks)."""
        if self._link is not None:
            self._link.send(message)

    def next(self, *, waiting_for: str) -> ServeMessage:
        """The next message from serve, on every rank."""
        if self._link is None:
            message = decode_from_serve(self._broadcast(None))
            if isinstance(message, Shutdown) and message.reason.startswith(ABORT_PREFIX):
                raise DoraError(f"rank 0 stopped the trainer: {message.reason}")
            return message
        try:
            message = self._link.recv(timeout_s=self.recv_timeout_s, waiting_for=waiting_for)
        except BaseException as exc:
            self.abort(f"rank 0 failed: {exc}")
            raise
        if self.world > 1:
            self._broadcast(encode(message))
        return message

    def abort(self, reason: str) -> None:
        """Rank 0: tell the other ranks to stop (they are waiting for the next message); once."""
        if self._link is not None and self.world > 1 and not self._aborted:
            self._aborted = True
            self._broadcast(encode(Shutdown(reason=ABORT_PREFIX + reason)))

    def _broadcast(self, frame: bytes | None) -> bytes:
        size = torch.tensor([len(frame) if frame is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self._group)
        if frame is not None:
            buf = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self._group)
        return frame if frame is not None else buf.numpy().tobytes()

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
