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

- sum: when the group is exactly two ranks, both on this machine, `all_sum` (which the
  sharded layers and the fused sharded block call) sums float32 arrays through a native
  primitive over a shared-memory segment the two ranks map, on the MLX stream thread that
  evaluates it: each rank copies its part into its slot and publishes a sequence number,
  waits for the other's (a short spin with a pause instruction, then yields, then sleeps;
  an error after `LOCAL_SUM_TIMEOUT_S`), and writes slot 0 + slot 1, the same bits on both
  ranks and the same as MLX's ring (a0 + a1). MLX's ring all_sum hands each collective from
  the stream thread to its pool and socket threads and back, each hand-off waiting for the
  rank's one core. The segment (rank 0 creates it, named from the ring's ports) is unlinked
  as soon as both have mapped it. Under a transform (mx.grad, vjp, compile: the native
  `is_tracer`) and for other dtypes `all_sum` is mx.distributed.all_sum.

$MLX_TERNARY_RING_WAIT=spin keeps MLX's polling, $MLX_TERNARY_PIN=0 the scheduler's
placement, $MLX_TERNARY_LOCAL_SUM=0 MLX's all_sum. Linux only (other systems: nothing
changes).
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
ENV_LOCAL_SUM = "MLX_TERNARY_LOCAL_SUM"
WAIT_TIMEOUT_S = 0.001
LOCAL_SUM_TIMEOUT_S = 60.0  # a rank waiting this long for the other's share raises
LOCAL_SUM_ADVICE = f"{ENV_LOCAL_SUM}=0 sums over MLX's ring instead"  # the end of that error
LOCAL_SUM_SLOT_BYTES = 1 << 20  # larger sums go in chunks of this
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


def _barrier(group) -> None:
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))


def _attach_local_sum(group, hosts: List[List[Address]]) -> bool:
    """Map the two ranks' shared segment (rank 0 makes it, both map it, rank 0 unlinks it:
    nothing is left behind); False where the native backend is unavailable."""
    from . import cpu

    if not cpu.available() or not Path("/dev/shm").is_dir():
        return False
    m = cpu.require()
    ports = "_".join(str(node[0][1]) for node in hosts)
    path = f"/dev/shm/mlx_ternary_sum_{ports}"
    if group.rank() == 0:
        if os.path.exists(path):
            os.unlink(path)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, m.local_sum_bytes(LOCAL_SUM_SLOT_BYTES))
        finally:
            os.close(fd)
        m.local_sum_attach(path, 0, LOCAL_SUM_SLOT_BYTES, LOCAL_SUM_TIMEOUT_S, LOCAL_SUM_ADVICE)
    _barrier(group)  # made
    if group.rank() != 0:
        m.local_sum_attach(
            path, group.rank(), LOCAL_SUM_SLOT_BYTES, LOCAL_SUM_TIMEOUT_S, LOCAL_SUM_ADVICE
        )
    _barrier(group)  # mapped by both
    if group.rank() == 0:
        os.unlink(path)
    return True


def all_sum(x: mx.array, group: mx.distributed.Group) -> mx.array:
    """mx.distributed.all_sum(x, group=group), through shared memory where share_host set
    it up for this group (module docstring) and nothing traces x."""
    if (
        x.dtype == mx.float32
        and _done.get((group.rank(), group.size()), {}).get("local_sum")
        and not _native().is_tracer(x)
    ):
        return _native().local_sum(x)
    return mx.distributed.all_sum(x, group=group)


def _native():
    from . import cpu

    return cpu.require()


def local_sums() -> int:
    """How many sums this process has run over shared memory (tests: the path is taken)."""
    from . import cpu

    return _native().local_sum_calls() if cpu.available() else 0


def share_host(group: mx.distributed.Group) -> dict:
    """Tune this rank for the ranks it shares the machine with (module docstring); returns
    what was done: {"local_ranks", "ring_sockets_blocking", "cpus", "local_sum"}.
    Idempotent."""
    key = (group.rank(), group.size())
    if key in _done or group.size() == 1 or not hasattr(os, "sched_setaffinity"):
        return _done.get(key, {})
    hosts = ring_hosts()
    if not hosts or len(hosts) != group.size():
        return {}
    local = local_ranks(hosts, group.rank())
    done = {"local_ranks": len(local), "ring_sockets_blocking": 0, "cpus": None, "local_sum": False}
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
        if len(local) == group.size() == 2 and os.environ.get(ENV_LOCAL_SUM, "1") != "0":
            done["local_sum"] = _attach_local_sum(group, hosts)
    _done[key] = done
    return done
