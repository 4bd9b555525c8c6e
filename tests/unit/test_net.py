"""Ports picked before they are bound: outside the range outgoing connections take theirs from."""

from __future__ import annotations

import socket

from dora.net import ephemeral_ports, free_port


def test_a_free_port_is_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = ephemeral_ports()
    assert 1024 <= low < high
    for _ in range(20):
        port = free_port("127.0.0.1")
        assert 1024 <= port < low  # no outgoing connection can take it before it is bound
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_picked() -> None:
    held = []
    try:
        for _ in range(30):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", free_port("127.0.0.1")))
            s.listen()
            held.append(s)
        ports = {s.getsockname()[1] for s in held}
        assert len(ports) == len(held)
    finally:
        for s in held:
            s.close()
