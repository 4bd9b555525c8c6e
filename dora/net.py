"""Network helpers that several layers need (the engine, the vLLM launcher, the config checks, the
trainer link and `dora run`), kept apart from all of them so that none imports another for them."""

from __future__ import annotations

import ipaddress
import random
import socket
from pathlib import Path

__all__ = ["ephemeral_ports", "free_port", "is_loopback"]


def free_port(host: str) -> int:
    """A TCP port that is free on `host` now, below the kernel's ephemeral range.

    Another process may still bind it before the caller does, but no outgoing connection takes it
    in the meantime: those get their local ports from the ephemeral range, which is where
    `bind(host, 0)` would pick from too (and where, with engines and clients connecting while a
    run starts, a port picked that way was taken before serve bound it)."""
    low = ephemeral_ports()[0]
    first = max(1024, low - 12288)
    rng = random.Random()
    for _ in range(64):
        port = rng.randrange(first, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on {host} in {first}-{low - 1} after 64 tries")


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux; IANA's elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server on this machine ('0.0.0.0' and '' are every
    interface; a name other than 'localhost' may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
