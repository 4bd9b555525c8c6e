"""Network facts that several layers need (the engine, the vLLM launcher, the config checks and
the trainer link), kept apart from all of them so that none has to import another for them."""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server on this machine ('0.0.0.0' and '' are every
    interface; a name other than 'localhost' may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
