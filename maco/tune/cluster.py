"""Ray as MACO's cluster: connect to it, and run jobs that need a machine to themselves
(measurements) on one actor per machine, one job at a time, handing a job whose actor or node
died to another machine of its kind.

Spreading parallel work (kernel builds) over every node is Ray's plain task scheduling
(`remote`); this module adds what Ray does not know: which nodes are one machine (Ray nodes
started on one kernel share its boot id and its cores, so they share one measuring actor), and
which machines are of a job's kind (the `group` a probe reports, e.g. a target fingerprint).

Imported only when a user names a cluster (--cluster, cluster=): without one MACO never
imports Ray.
"""
from __future__ import annotations

import os
import re
import socket
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from maco.core.errors import MacoError
from maco.tune.records import Interrupted
from maco.core.timing import environment

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError:  # the [cluster] extra is not installed: connect() says so
    ray = None

ADDRESSES = "ray://HOST:PORT (Ray Client), HOST:PORT (the address `ray start --head` prints) or auto"
CONNECT_TIMEOUT = 10.0  # seconds a cluster's address may take to accept a TCP connection
CURRENT_CLUSTER = "/tmp/ray/ray_current_cluster"  # where `ray start` leaves its address (auto)
ATTEMPTS = 3  # machines a job may lose before it counts as failed (a job that kills every machine)
_HEAD = "node:__internal_head__"


class ClusterAddress(str):
    """An address check_address accepted: handing it on (CLI -> optimize -> Cluster) does not
    check it again."""


def check_address(address: Any) -> ClusterAddress:
    """`address` when it names a cluster the way ray.init takes it, else MacoError naming it."""
    if isinstance(address, ClusterAddress):
        return address
    return ClusterAddress(_parse(address))


def _parse(address: Any) -> str:
    if isinstance(address, str):
        text = address.strip()
        if text == "auto":
            return text
        m = re.fullmatch(r"(ray://)?([A-Za-z0-9._-]+|\[[0-9A-Fa-f:]+\]):(\d{1,5})", text)
        if m and 0 < int(m.group(3)) < 65536:
            return text
    raise MacoError(f"cluster must be {ADDRESSES}, got {address!r}")


def _probe(address: str, timeout: float | None = None) -> None:
    """Fail in seconds, with one line, where nothing answers at a HOST:PORT address: ray.init
    waits minutes for a cluster that is not there, printing only its own warnings. A ray://
    address fails fast by itself; auto is probed at the address it stands for, when it names one
    (RAY_ADDRESS, or the cluster `ray start` last left on this machine)."""
    target = address
    if address == "auto":
        target = os.environ.get("RAY_ADDRESS", "")
        if not target:
            try:
                target = Path(CURRENT_CLUSTER).read_text().strip()
            except (OSError, UnicodeDecodeError):
                return  # ray.init says there is no cluster to connect to, at once
    m = re.fullmatch(r"([A-Za-z0-9._-]+|\[[0-9A-Fa-f:]+\]):(\d{1,5})", target)
    if m is None:
        return
    host, port = m.group(1).strip("[]"), int(m.group(2))
    wait = CONNECT_TIMEOUT if timeout is None else timeout
    try:
        socket.create_connection((host, port), timeout=wait).close()
    except OSError as exc:
        why = f"no answer within {wait:g} s" if isinstance(exc, TimeoutError) else exc.strerror or type(exc).__name__
        raise MacoError(f"cannot connect to the Ray cluster {address!r}: nothing answers at {host}:{port} "
                        f"({why}); is `ray start --head` running there?") from None


@dataclass(frozen=True)
class Node:
    """A live Ray node as a probe on it described it."""

    node_id: str
    machine: str  # the kernel's boot id: Ray nodes that share it share the cores
    head: bool
    gpus: int
    info: dict[str, Any]  # what the probe returned


class Cluster:
    """A connection to a Ray cluster (close() or `with`: disconnects if it connected)."""

    def __init__(self, address: str):
        address = str(check_address(address))  # ray.init takes a str, not a subclass
        if ray is None:
            raise MacoError("--cluster needs Ray: pip install 'maco[cluster]' (Ray on every node too)")
        self.address = address
        self._owned = not ray.is_initialized()
        if self._owned:
            _probe(address)
            try:
                ray.init(address=address, log_to_driver=False, logging_level="WARNING")
            except (ConnectionError, RuntimeError, ValueError) as exc:
                hint = " (RAY_ADDRESS is unset and no `ray start` ran here)" if address == "auto" \
                    and not os.environ.get("RAY_ADDRESS") else ""
                raise MacoError(f"cannot connect to the Ray cluster {address!r}{hint}: "
                                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None

    def close(self) -> None:
        if self._owned and ray.is_initialized():
            ray.shutdown()
        self._owned = False

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def remote(self, fn: Callable, **options: Any) -> Any:
        """`fn` as a Ray task (Ray spreads its calls over every node's CPUs and re-runs a call
        whose node died)."""
        return ray.remote(fn).options(**options) if options else ray.remote(fn)

    def nodes(self, probe: Callable[..., dict[str, Any]], *args: Any) -> list[Node]:
        """Every live node, described by `probe(*args)` run on it."""
        alive = [n for n in ray.nodes() if n.get("Alive")]
        task = ray.remote(_describe)
        refs = [task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            n["NodeID"], soft=False)).remote(probe, *args) for n in alive]
        out = []
        for n, ref in zip(alive, refs):
            try:
                machine, info = ray.get(ref, timeout=300)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                continue  # died since ray.nodes(): not a node any more
            out.append(Node(n["NodeID"], machine, _HEAD in n.get("Resources", {}),
                            int(n.get("Resources", {}).get("GPU", 0)), info))
        return out

    def pool(self, probe: Callable[..., dict[str, Any]], args: Sequence[Any], group: str,
             label: str, per_gpu: bool = False) -> "MachinePool":
        """One actor per machine whose probe says `group` (one per GPU where `per_gpu`); a
        machine made of several Ray nodes measures on one that is not the head (the head runs
        Ray's own services). MacoError naming `label` when no machine of `group` is in the cluster."""
        return MachinePool(self, probe, tuple(args), group, label, per_gpu)


def local_threads(threads: int) -> dict[str, Any]:
    """In a machine's actor: run with the threads a local run would (Ray gives actors
    OMP_NUM_THREADS=1); the environment its records name, this machine's with its Ray node."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return {**environment(), "node": ray.get_runtime_context().get_node_id()}


def _describe(probe: Callable[..., dict[str, Any]], *args: Any) -> tuple[str, dict[str, Any]]:
    return _boot_id(), probe(*args)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket

        return socket.gethostname()


class _Machine:
    """A measuring actor: runs one job at a time (Ray's actor semantics) and keeps `state`
    between jobs, e.g. a measuring worker process."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def pid(self) -> int:
        return os.getpid()

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.state, *args)


@dataclass
class _Slot:
    node: Node
    actor: Any


class MachinePool:
    """Measuring actors for one group of machines; `run` hands them jobs, one per actor at a time."""

    def __init__(self, cluster: Cluster, probe: Callable[..., dict[str, Any]], args: tuple,
                 group: str, label: str, per_gpu: bool):
        self.cluster, self.probe, self.args, self.group, self.per_gpu = cluster, probe, args, group, per_gpu
        self.slots: list[_Slot] = []
        nodes = cluster.nodes(probe, *args)
        mine = [n for n in nodes if n.info.get("group") == group and (n.gpus or not per_gpu)]
        if not mine:
            kinds = sorted({str(n.info.get("label"))[:100] for n in nodes})
            raise MacoError(f"no machine of the target {label} in the Ray cluster {cluster.address!r} "
                            f"(its {len(nodes)} node(s): {'; '.join(kinds) or 'none'})")
        for machine in dict.fromkeys(n.machine for n in mine):
            self._start(machine, [n for n in mine if n.machine == machine])

    @property
    def info(self) -> dict[str, Any]:
        """The probe's description of the first machine."""
        return self.slots[0].node.info

    def _start(self, machine: str, nodes: list[Node]) -> None:
        """Actors for `machine` on the first of `nodes` that accepts them (non-head first)."""
        for node in sorted(nodes, key=lambda n: (n.head, n.node_id)):
            count = max(node.gpus, 1) if self.per_gpu else 1
            strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
            actors = [ray.remote(_Machine).options(num_cpus=0, num_gpus=1 if self.per_gpu else 0,
                                                   max_restarts=0, scheduling_strategy=strategy).remote()
                      for _ in range(count)]
            try:
                ray.get([a.pid.remote() for a in actors], timeout=300)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                for a in actors:
                    ray.kill(a)
                continue
            self.slots += [_Slot(node, a) for a in actors]
            return

    def _replace(self, slot: _Slot) -> list[_Slot]:
        """After `slot`'s actor died: new actors on a live node of the same machine (the same
        node when it lives), or none when the machine is gone."""
        ray.kill(slot.actor)
        self.slots.remove(slot)
        if any(s.node.machine == slot.node.machine for s in self.slots):
            return []  # another GPU's actor of this machine lives on; keep the count
        before = len(self.slots)
        alive = [n for n in self.cluster.nodes(self.probe, *self.args)
                 if n.machine == slot.node.machine and n.info.get("group") == self.group]
        if alive:
            self._start(slot.node.machine, alive)
        return self.slots[before:]

    def pids(self) -> list[tuple[str, int]]:
        """(node id, pid) of every measuring actor (tests kill them)."""
        return [(s.node.node_id, ray.get(s.actor.pid.remote())) for s in self.slots]

    def run(self, fn: Callable[..., Any], jobs: Sequence[tuple], lost: Callable[[str], Any],
            on_result: Callable[[int, Any], None] | None = None) -> list[Any]:
        """`fn(state, *job)` for every job on the pool's actors, each actor one job at a time;
        results in the order of `jobs`. A job whose actor or node dies goes back to the queue
        (to a replacement actor on that machine, or to the other machines); after ATTEMPTS
        losses its result is `lost(reason)`. Ctrl-C stops the actors and raises
        records.Interrupted with the results finished before it."""
        results: list[Any] = [None] * len(jobs)
        finished = [False] * len(jobs)
        losses = [0] * len(jobs)
        queue = deque(range(len(jobs)))
        idle = list(self.slots)
        running: dict[Any, tuple[_Slot, int]] = {}
        try:
            while queue or running:
                while queue and idle:
                    slot, i = idle.pop(0), queue.popleft()
                    running[slot.actor.run.remote(fn, *jobs[i])] = (slot, i)
                if not running:
                    raise MacoError(f"every machine of the target measuring here left the Ray cluster "
                                    f"{self.cluster.address!r}; {sum(not f for f in finished)} job(s) not run")
                (ref,), _ = ray.wait(list(running), num_returns=1)
                slot, i = running.pop(ref)
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayTaskError as exc:
                    if isinstance(exc.cause, MacoError):  # e.g. a full disk on that machine: its one line
                        raise exc.cause from None
                    raise exc.as_instanceof_cause() from None  # a bug in fn, not a fault
                except ray.exceptions.RayError as exc:
                    losses[i] += 1
                    reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                    if losses[i] >= ATTEMPTS:
                        results[i], finished[i] = lost(f"{type(exc).__name__} {losses[i]} times: {reason}"), True
                    else:
                        queue.appendleft(i)
                    idle = [s for s in idle if s is not slot] + self._replace(slot)
                    continue
                finished[i] = True
                idle.append(slot)
                if on_result:
                    on_result(i, results[i])
        except KeyboardInterrupt:
            for slot in self.slots:
                ray.kill(slot.actor)  # its worker process ends at its next read
            self.slots = []
            raise Interrupted([r if f else None for r, f in zip(results, finished)]) from None
        return results

    def close(self) -> None:
        for slot in self.slots:
            ray.kill(slot.actor)
        self.slots = []
