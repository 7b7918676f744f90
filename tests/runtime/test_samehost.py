"""Ranks sharing one machine (runtime/samehost.py), in one process: the hostfile, the core
blocks, and the ring's sockets found and made to sleep instead of poll. The two-rank run
(tests/test_parallel.py) checks the same under mlx.launch."""

import os
import socket
import time

import pytest

from mlx_ternary.runtime import samehost


def test_local_ranks_are_those_listed_with_this_hosts_ips():
    hosts = [[("10.0.0.1", 5000)], [("10.0.0.2", 5001)], [("10.0.0.1", 5002)]]
    assert samehost.local_ranks(hosts, 0) == [0, 2]
    assert samehost.local_ranks(hosts, 1) == [1]


def test_core_blocks_are_disjoint_and_refused_when_too_few():
    cpus = [0, 1, 2, 3, 4]
    blocks = [samehost.core_block(r, 2, cpus) for r in range(2)]
    assert blocks == [[0, 1], [2, 3]]
    assert samehost.core_block(2, 3, [0, 1]) is None


def test_the_hostfile_mlx_launch_writes_is_read(tmp_path, monkeypatch):
    f = tmp_path / "hosts.json"
    f.write_text('[["127.0.0.1:5000"], ["127.0.0.1:5001"]]')
    monkeypatch.setenv("MLX_HOSTFILE", str(f))
    assert samehost.ring_hosts() == [[("127.0.0.1", 5000)], [("127.0.0.1", 5001)]]
    f.write_text("")  # mlx.launch writes an empty file for one rank
    assert samehost.ring_hosts() is None


@pytest.fixture
def connection():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    server.close()
    for s in (client, accepted):
        s.setblocking(False)  # as MLX's socket threads leave them
    yield client, accepted
    client.close()
    accepted.close()


def test_ring_sockets_are_found_by_address_and_made_to_sleep(connection):
    client, accepted = connection
    addr = accepted.getsockname()[:2]
    fds = samehost.ring_sockets({addr})
    assert sorted(fds) == sorted([client.fileno(), accepted.fileno()])
    assert samehost.ring_sockets({("127.0.0.1", 1)}) == []  # the control: no such address
    with pytest.raises(BlockingIOError):
        os.read(accepted.fileno(), 1)  # non-blocking: returns at once, nothing to read
    samehost.block(fds, timeout_s=0.05)
    t0 = time.perf_counter()
    with pytest.raises(BlockingIOError):  # blocking with a timeout: sleeps, then EAGAIN
        os.read(accepted.fileno(), 1)
    assert time.perf_counter() - t0 >= 0.04
    client.sendall(b"x")
    assert os.read(accepted.fileno(), 1) == b"x"  # data wakes the sleeper
