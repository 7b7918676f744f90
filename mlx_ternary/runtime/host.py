"""Ranks that share one machine: the ring backend's waiting, and a block of cores per rank.

MLX's ring backend gives each of its sockets a thread that, while a receive is pending,
polls the non-blocking socket in a loop (recv, EAGAIN, again): a rank waiting for the other
keeps a thread runnable the whole time. Ranks on separate machines lose nothing by it; ranks
sharing the cores (`mlx.launch -n 2` on one host) do: the waiting rank's poller competes for
the cores the other rank computes on, and on a shared machine it waits its turn in the run
queue before it sees the data it polls for (docs/DISTRIBUTED.md, "Overhead on one machine").

`share_host(group)` fixes both when two or more ranks of the group run on this machine (the
ring hostfile lists this host more than once):
- wait: the ring's sockets are made blocking, with a receive/send timeout of
  `WAIT_TIMEOUT_S`: a pending receive sleeps in the kernel and wakes when data arrives; the
  timeout returns EAGAIN, which MLX's loop treats as no progress, so a send queued behind a
  receive on the same socket (large collectives use both directions) still goes out.
- pin: the local ranks split this process's allowed CPUs into equal blocks, one each, and
  every thread of the rank (MLX's, the ring's, the native kernel's pool) is confined to its
  block; the native pool is resized to the block unless $MLX_TERNARY_NUM_THREADS is set.

$MLX_TERNARY_RING_WAIT=spin keeps MLX's polling, $MLX_TERNARY_PIN=0 the scheduler's
placement. Linux only (other systems: nothing changes).
"""

import fcntl
import json
import os
import socket
import struct
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import mlx.core as mx

ENV_WAIT = "MLX_TERNARY_RING_WAIT"
ENV_PIN = "MLX_TERNARY_PIN"
ENV_THREADS = "MLX_TERNARY_NUM_THREADS"
WAIT_TIMEOUT_S = 0.001
Address = Tuple[str, int]
_done: Dict[Tuple[int, int], dict] = {}  # (rank, size) -> what share_host did


def ring_hosts() -> Optional[List[List[Address]]]:
    """The ring hostfile mlx.launch wrote ($MLX_HOSTFILE): per rank, its (ip, port)s."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path or not Path(path).is_file():
        return None
    try:
        nodes = json.loads(Path(path).read_text() or "null")
        return [[(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in n] for n in nodes]
    except (ValueError, TypeError, AttributeError, IndexError):
        return None  # not a ring hostfile (another backend's)


def local_ranks(hosts: List[List[Address]], rank: int) -> List[int]:
    """The ranks listed with this rank's IPs (this one included), in rank order."""
    mine = {ip for ip, _ in hosts[rank]}
    return [r for r, node in enumerate(hosts) if mine & {ip for ip, _ in node}]


def ring_sockets(addresses: Set[Address]) -> List[int]:
    """This process's TCP sockets whose local or peer address is one of `addresses`."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with s:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            try:
                ends = {s.getsockname()[:2], s.getpeername()[:2]}
            except OSError:
                continue  # not connected
        if ends & addresses:
            fds.append(fd)
    return fds


def block(fds: List[int], timeout_s: float = WAIT_TIMEOUT_S) -> None:
    """Blocking sockets with receive and send timeouts (the flags are the socket's, shared
    with MLX's thread that uses the descriptor)."""
    tv = struct.pack("ll", 0, int(timeout_s * 1e6))
    for fd in fds:
        with socket.socket(fileno=os.dup(fd)) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)


def core_block(local: int, count: int, cpus: List[int]) -> Optional[List[int]]:
    """The `local`-th of `count` equal blocks of `cpus` (None when there are fewer CPUs)."""
    per = len(cpus) // count
    return cpus[local * per : (local + 1) * per] if per else None


def pin(cpus: List[int]) -> None:
    """Confine every thread of this process (and those it starts later) to `cpus`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # a thread that ended meanwhile
    if not os.environ.get(ENV_THREADS):
        from . import cpu

        if cpu.available():
            cpu.set_num_threads(len(cpus))


def share_host(group: mx.distributed.Group) -> dict:
    """Tune this rank for the ranks it shares the machine with (module docstring); returns
    what was done: {"local_ranks", "ring_sockets_blocking", "cpus"}. Idempotent."""
    key = (group.rank(), group.size())
    if key in _done or group.size() == 1 or not hasattr(os, "sched_setaffinity"):
        return _done.get(key, {})
    hosts = ring_hosts()
    if not hosts or len(hosts) != group.size():
        return {}
    local = local_ranks(hosts, group.rank())
    done = {"local_ranks": len(local), "ring_sockets_blocking": 0, "cpus": None}
    if len(local) > 1:
        if os.environ.get(ENV_WAIT, "block") != "spin":
            fds = ring_sockets({a for node in hosts for a in node})
            block(fds)
            done["ring_sockets_blocking"] = len(fds)
        if os.environ.get(ENV_PIN, "1") != "0":
            cpus = core_block(
                local.index(group.rank()), len(local), sorted(os.sched_getaffinity(0))
            )
            if cpus:
                pin(cpus)
                done["cpus"] = cpus
    _done[key] = done
    return done
