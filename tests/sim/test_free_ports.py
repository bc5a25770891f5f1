"""Loopback ports for the processes a test starts: never handed out twice by one process."""

from __future__ import annotations

import socket

from sim.processes import free_port, free_port_range


def test_ports_are_never_handed_out_twice_before_they_are_bound() -> None:
    ports = [free_port() for _ in range(1500)]
    first = free_port_range(4)
    assert len(set(ports)) == len(ports)
    assert set(range(first, first + 4)).isdisjoint(ports)
    with socket.socket() as sock:  # and each can be bound
        sock.bind(("127.0.0.1", ports[-1]))
