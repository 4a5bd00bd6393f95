"""The nodes of a multi-node job meeting and watching each other (launch.sh -> supervise.py).

Every node's supervisor talks through the rendezvous store (the TCPStore at
MASTER_ADDR:MASTER_PORT that torch's c10d rendezvous already hosts on node 0):

1. **Join** (`meet`): each node writes `dtensor3d/node/<NODE_RANK>` = its resolved recipe,
   the dtensor3d version and a digest of its source, then waits for every node; one line
   per `WAIT_LINE_S` says who has joined (`waiting for nodes: 1 of 2 joined (node 0), 40 s of
   60`). At `training.timeout_s` the job ends with one `error:` line (exit 2).
2. **Compare**: every node compares every node's record with node 0's; a difference is one
   `error:` line on every node naming the first differing key and both values (exit 2),
   before any worker starts.
3. **Heartbeats** (`Heartbeat`): each node's supervisor bumps `dtensor3d/alive/<NODE_RANK>`
   every `BEAT_S`; when a job's ranks fail, `lost_nodes` names the nodes whose counter stopped
   (a killed node), or says the store's host is unreachable.

Workers never outlive their supervisor (`die_with_parent`: Linux's PR_SET_PDEATHSIG), so a
killed node's ranks die with it and the other nodes' collectives fail at once.
This module must not import torch at import time (the supervisor imports it lazily).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time

WAIT_LINE_S = 10.0  # a "waiting for nodes" line this often
BEAT_S = 1.0  # heartbeat interval
KEY = "dtensor3d"


def source_digest() -> str:
    """sha256 over this package's .py files (name and bytes): two nodes running different code differ."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def flat(d: dict, prefix: str = "") -> dict[str, object]:
    """{"training": {"steps": 10}} -> {"training.steps": 10}."""
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def node_record(recipe_dict: dict) -> dict:
    """What a node tells the others: its resolved recipe (flattened), version and code digest."""
    from importlib import metadata

    try:
        version = metadata.version("dtensor3d")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"recipe": flat(recipe_dict), "dtensor3d.version": version, "dtensor3d.source": source_digest()}


def first_difference(a: dict, b: dict) -> tuple[str, object, object] | None:
    """(key, a's value, b's value) of the first key (in a's order, then b's) where two records differ."""
    fa = {**flat(a["recipe"]), "dtensor3d.version": a["dtensor3d.version"], "dtensor3d.source": a["dtensor3d.source"]}
    fb = {**flat(b["recipe"]), "dtensor3d.version": b["dtensor3d.version"], "dtensor3d.source": b["dtensor3d.source"]}
    for key in [*fa, *(k for k in fb if k not in fa)]:
        if fa.get(key, "<absent>") != fb.get(key, "<absent>"):
            return key, fa.get(key, "<absent>"), fb.get(key, "<absent>")
    return None


class NodesError(Exception):
    """The nodes did not all join in time, or disagree (status 2), or a node was lost (status 1);
    str(err) is the one `error:` line's text."""

    def __init__(self, text: str, status: int = 2):
        super().__init__(text)
        self.status = status


def _joined(store, nnodes: int) -> list[int]:
    return [n for n in range(nnodes) if store.check([f"{KEY}/node/{n}"])]


def wait_for_nodes(store, nnodes: int, timeout_s: float, say=print) -> None:
    """Block until every node has written its record; a line every WAIT_LINE_S; NodesError at the limit."""
    start, next_line = time.monotonic(), WAIT_LINE_S
    while True:
        joined = _joined(store, nnodes)
        if len(joined) == nnodes:
            return
        waited = time.monotonic() - start
        names = ", ".join(f"node {n}" for n in joined)
        if waited >= timeout_s:
            missing = ", ".join(f"node {n}" for n in range(nnodes) if n not in joined)
            raise NodesError(
                f"the rendezvous timed out after {timeout_s:g} s (training.timeout_s): {len(joined)} of {nnodes} "
                f"nodes joined ({names}); missing: {missing}; start every node with the same NNODES, MASTER_ADDR "
                "and MASTER_PORT"
            )
        if waited >= next_line:
            say(f"waiting for nodes: {len(joined)} of {nnodes} joined ({names}), {waited:.0f} s of {timeout_s:g}")
            next_line += WAIT_LINE_S
        time.sleep(0.2)


def compare_nodes(store, nnodes: int) -> None:
    """NodesError naming the first key where a node's record differs from node 0's."""
    records = [json.loads(store.get(f"{KEY}/node/{n}")) for n in range(nnodes)]
    for n in range(1, nnodes):
        diff = first_difference(records[0], records[n])
        if diff is not None:
            key, mine, theirs = diff
            raise NodesError(
                f"the nodes' recipes differ at {key}: node 0 has {mine!r}, node {n} has {theirs!r}; start every "
                "node with the same recipe, overrides and dtensor3d"
            )


def meet(store, node_rank: int, nnodes: int, recipe_dict: dict, timeout_s: float) -> None:
    """Join, wait for every node, compare; then wait until every node has compared (so node 0,
    which hosts the store, never leaves while another node still reads it)."""
    store.set(f"{KEY}/node/{node_rank}", json.dumps(node_record(recipe_dict)))
    wait_for_nodes(store, nnodes, timeout_s, say=lambda line: print(line, file=sys.stderr, flush=True))
    problem = None
    try:
        compare_nodes(store, nnodes)
    except NodesError as e:
        problem = e
    store.set(f"{KEY}/compared/{node_rank}", "1")
    deadline = time.monotonic() + min(timeout_s, 30.0)
    try:
        while time.monotonic() < deadline and not all(store.check([f"{KEY}/compared/{n}"]) for n in range(nnodes)):
            time.sleep(0.1)
    except Exception:  # node 0 left, which it does only once every node has compared: done
        pass
    if problem is not None:
        raise problem


def meet_elastic(store, node_rank: int, recipe_dict: dict, timeout_s: float) -> None:
    """An elastic job (NNODES=MIN:MAX): nodes come and go, so none waits for all; each node other
    than node 0 (which hosts the store and whose record is the job's) compares its record with
    node 0's and is refused (this node only, status 2) when they differ."""
    store.set(f"{KEY}/node/{node_rank}", json.dumps(node_record(recipe_dict)))
    if node_rank == 0:
        return
    wait_for_nodes_named(store, [0], timeout_s)
    ours, theirs = json.loads(store.get(f"{KEY}/node/{node_rank}")), json.loads(store.get(f"{KEY}/node/0"))
    diff = first_difference(theirs, ours)
    if diff is not None:
        key, mine, other = diff
        raise NodesError(
            f"this node's recipe differs from the job's at {key}: node 0 has {mine!r}, node {node_rank} has "
            f"{other!r}; start every node with the same recipe, overrides and dtensor3d"
        )


def wait_for_nodes_named(store, wanted: list[int], timeout_s: float) -> None:
    """Block until the nodes `wanted` have written their records (NodesError at the limit)."""
    end = time.monotonic() + timeout_s
    while not all(store.check([f"{KEY}/node/{n}"]) for n in wanted):
        if time.monotonic() > end:
            missing = ", ".join(f"node {n}" for n in wanted)
            raise NodesError(
                f"the rendezvous timed out after {timeout_s:g} s (training.timeout_s) waiting for {missing}"
            )
        time.sleep(0.2)


class Heartbeat:
    """A daemon thread bumping this node's counter in the store every BEAT_S."""

    def __init__(self, store, node_rank: int):
        self.store, self.node_rank = store, node_rank
        threading.Thread(target=self._run, name="dtensor3d-heartbeat", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                self.store.add(f"{KEY}/alive/{self.node_rank}", 1)
            except Exception:  # the store's host is gone: lost_nodes says so
                return
            time.sleep(BEAT_S)


def lost_nodes(store, nnodes: int, me: int, endpoint: str = "MASTER_ADDR:MASTER_PORT") -> str | None:
    """A phrase naming the nodes whose heartbeat stopped ("node 1 was lost"), or the store's
    host when it cannot be reached; None when every node is alive."""
    try:
        before = [store.add(f"{KEY}/alive/{n}", 0) for n in range(nnodes)]
        time.sleep(3 * BEAT_S)
        after = [store.add(f"{KEY}/alive/{n}", 0) for n in range(nnodes)]
    except Exception:
        return f"node 0 (the rendezvous host, {endpoint}) was lost" if me != 0 else None
    lost = [n for n in range(nnodes) if n != me and after[n] == before[n] and after[n] > 0]  # 0: never joined
    if not lost:
        return None
    return ", ".join(f"node {n}" for n in lost) + (" was" if len(lost) == 1 else " were") + " lost"


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent (the node's supervisor) dies, so a rank
    never trains on unsupervised; if the parent is already gone, exit now."""
    import ctypes
    import signal

    parent = os.environ.get("DTENSOR3D_AGENT_PID")
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: nothing to set
        return
    if parent and os.getppid() != int(parent):  # the supervisor died before prctl took effect
        os._exit(1)
