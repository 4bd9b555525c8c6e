"""Network helpers that several layers need (the engine, the vLLM launcher, the config checks, the
trainer link and `dora run`), kept apart from all of them so that none imports another for them."""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["free_port", "is_loopback"]


def free_port(host: str) -> int:
    """A TCP port that is free on `host` now (another process may take it before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server on this machine ('0.0.0.0' and '' are every
    interface; a name other than 'localhost' may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
