"""Beyond one machine, on one machine (issue 26): two `launch.sh` processes on 127.0.0.1 as the two
nodes of one job (NODE_RANK 0 and 1, one MASTER_PORT), at dp 2 x tp 2 (one dp replica per node).

- A fixed job (NNODES=2, MAX_RESTARTS=1): node 1 is SIGKILLed (its launcher's process group: its
  ranks die with it) and started again; the job resumes from the newest checkpoint and ends with
  losses bitwise equal to the same mesh on one node, each step recorded once.
- An elastic job (NNODES=1:2, parallelism.dp=auto, NPROC_PER_NODE=2): node 1 is lost for good and
  node 0 goes on alone at dp 1 (a `resized:` line naming the lost node), then node 1 comes back
  and the job grows to dp 2 again; the global batch and the sample order stay, so every step's
  loss is within 1e-5 of the uninterrupted run (dp changes only the order of the sums).
- The door: every elastic setting that cannot work is one `error:` line before anything starts.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from helpers import PARITY, ROOT, TOL, clean_env
from jobs import connected, error_lines, free_port, hold, losses, no_traceback, records, release, wait_until

STEPS = 24
BASE = [PARITY, "parallelism.tp=2", "training.eval_every=0", "checkpoint.interval=2", "training.timeout_s=60"]


def args(tmp, dp: str = "2") -> list[str]:
    return [
        *BASE,
        f"parallelism.dp={dp}",
        f"training.steps={STEPS}",
        f"checkpoint.dir={tmp / 'ckpt'}",
        f"logging.run_dir={tmp / 'run'}",
    ]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> list[tuple[int, float, float]]:
    """The uninterrupted run: dp 2 x tp 2, four ranks on one node."""
    tmp = tmp_path_factory.mktemp("one_node")
    proc = subprocess.run(
        ["bash", "launch.sh", *args(tmp)], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = losses(tmp / "run")
    assert [s for s, _, _ in ref] == list(range(1, STEPS + 1))
    return ref


def node(jobs, tmp, rank: int, name: str, run_args: list[str], env: dict[str, str]):
    return jobs(tmp, name, run_args, NODE_RANK=str(rank), **env)


def kill_node(job) -> None:
    """SIGKILL a node's launcher and its process group, as a machine that dies."""
    ranks = list(job.workers().values())
    os.killpg(job.proc.pid, signal.SIGKILL)
    job.proc.wait()
    wait_until(lambda: not any(os.path.exists(f"/proc/{pid}/stat") and _alive(pid) for pid in ranks), None, "ranks", 20)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def steps_once(run_dir) -> None:
    steps = [r["step"] for r in records(run_dir)]
    assert steps == list(range(1, STEPS + 1)), steps


def test_two_nodes_lose_node_1_and_take_it_back_bitwise(tmp_path, jobs, one_node):
    env = dict(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), MAX_RESTARTS="1")
    env["RDZV_KEEP_ALIVE_S"] = "5"  # the killed node leaves the rendezvous after 5 s of silence, not torch's 15
    run_args = args(tmp_path)
    node0 = node(jobs, tmp_path, 0, "node0", run_args, env)
    node1 = node(jobs, tmp_path, 1, "node1", run_args, env)
    wait_until(lambda: any(r["step"] >= 4 for r in records(tmp_path / "run")), node0, "step 4")
    kill_node(node1)
    wait_until(lambda: "restarting (1 of MAX_RESTARTS=1): node 1 was lost" in node0.text(), node0, "the restart")
    again = node(jobs, tmp_path, 1, "node1-again", run_args, env)
    assert node0.wait(300) == 0, node0.text()[-3000:]
    assert again.wait(60) == 0, again.text()[-3000:]
    assert losses(tmp_path / "run") == one_node  # bitwise: the same mesh, resumed from a checkpoint
    steps_once(tmp_path / "run")
    # global rank 0 prints the `done:` line; after the restart the rendezvous may give it to either node
    both = node0.text() + again.text()
    assert both.count("done:") == 1 and not error_lines(both), both[-3000:]
    no_traceback(node0)


def test_elastic_shrink_when_a_node_is_lost_and_grow_when_it_returns(tmp_path, jobs, one_node):
    env = dict(
        NNODES="1:2",
        NPROC_PER_NODE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        MAX_RESTARTS="2",
        RDZV_LAST_CALL_S="1",
        RDZV_KEEP_ALIVE_S="5",  # the shrink waits for the lost node to leave the rendezvous: 5 s, not torch's 15
    )
    run_args = args(tmp_path, dp="auto")
    node0 = node(jobs, tmp_path, 0, "node0", run_args, env)
    node1 = node(jobs, tmp_path, 1, "node1", run_args, env)
    wait_until(lambda: any(r["step"] >= 3 for r in records(tmp_path / "run")), node0, "step 3")
    kill_node(node1)
    shrunk = "resized: dp 2 -> 1 (node 1 lost), global batch 8 kept, 4 -> 8 microbatches per rank"
    wait_until(lambda: shrunk in node0.text(), node0, "the shrink to one node")
    # Node 0's ranks wait (SIGSTOP) until node 1's launcher is back at the rendezvous: under load its start
    # (bash, the door, torchrun) took longer than node 0's remaining steps, and the job ended before it joined.
    held = hold(node0)
    again = node(jobs, tmp_path, 1, "node1-again", run_args, env)
    wait_until(lambda: connected(again.proc.pid, int(env["MASTER_PORT"])), again, "node 1 back at the rendezvous")
    release(held)
    grown = "resized: dp 1 -> 2 (a node joined), global batch 8 kept, 8 -> 4 microbatches per rank"
    assert node0.wait(300) == 0, node0.text()[-3000:]
    assert again.wait(60) == 0, again.text()[-3000:]
    assert grown in node0.text(), node0.text()[-3000:]
    steps_once(tmp_path / "run")
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(losses(tmp_path / "run"), one_node, strict=True):
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (step, loss, ref_loss)
        assert abs(norm - ref_norm) <= TOL * abs(ref_norm), (step, norm, ref_norm)
    both = node0.text() + again.text()  # rank 0, which prints `done:`, may be on either node after the rejoin
    assert both.count("done:") == 1 and not error_lines(both), both[-3000:]
    no_traceback(node0)


def launch(*run_args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "launch.sh", *run_args], cwd=ROOT, env=clean_env(**env), capture_output=True, text=True, timeout=120
    )


ELASTIC = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")


@pytest.mark.parametrize(
    "env, dp, expected",
    [
        (dict(NNODES="3:2", NPROC_PER_NODE="2"), "auto", "error: NNODES=3:2: MIN 3 is larger than MAX 2"),
        (
            dict(NNODES="1:3", NPROC_PER_NODE="2"),
            "auto",
            "error: NNODES=1:3 with NPROC_PER_NODE=2: at 3 node(s) (world size 6) the recipe cannot run: "
            "training.global_batch_size=8 is not divisible by",
        ),
        (dict(NNODES="2", NPROC_PER_NODE="2"), "auto", "error: parallelism.dp=auto is for elastic jobs, but NNODES=2"),
        (dict(NNODES="1:2", NPROC_PER_NODE="2"), "2", "error: NNODES=1:2 is an elastic range, so dp must follow"),
        (dict(NNODES="1:2"), "auto", "error: parallelism.dp=auto: set NPROC_PER_NODE"),
        (dict(NNODES="1:x"), "auto", "error: NNODES='1:x' must be a positive integer N"),
        (
            dict(NNODES="1:2", NPROC_PER_NODE="2", RDZV_KEEP_ALIVE_S="0"),
            "auto",
            "error: RDZV_KEEP_ALIVE_S='0' must be a positive integer (seconds of silence",
        ),
    ],
    ids=[
        "min-above-max",
        "a-world-that-cannot-serve",
        "auto-with-fixed-nnodes",
        "range-with-fixed-dp",
        "no-nproc-per-node",
        "not-a-range",
        "keep-alive-zero",
    ],  # fmt: skip
)
def test_elastic_settings_refused_at_the_door(tmp_path, env, dp, expected):
    proc = launch(PARITY, "parallelism.tp=2", f"parallelism.dp={dp}", f"logging.run_dir={tmp_path}", **ELASTIC, **env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), lines
    assert not any(tmp_path.iterdir())  # nothing started, nothing written
