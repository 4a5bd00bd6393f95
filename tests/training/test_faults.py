"""Faults with real processes and real signals (issue 11): preemption (SIGTERM to one rank,
Ctrl-C to launch.sh's process group), SIGKILLed ranks restarted by the elastic agent
(mid-step and mid-background-save; a rank late to a restarted rendezvous), a job that keeps
failing (a SIGKILL, then a rank frozen with SIGSTOP against training.timeout_s), a rank that
never joins (setup's timeout), non-finite steps (an absurd learning rate; not restarted) and
a save that runs out of space (RLIMIT_FSIZE).

Each interrupted run's final losses are compared bitwise with one uninterrupted run of the
same recipe and mesh (one module-scoped reference run), and each fault test checks that what
was saved before it is intact.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import PARITY, ROOT, clean_env
from jobs import Job, at_step, digest, error_lines, free_port, losses, no_traceback, records, wait_until

from dtensor3d.checkpoint import newest
from dtensor3d.launch.supervise import Failure, final_line, first_failure, summary

STEPS = 12
# The parity model on 2 ranks (dp=2), no validation: a few hundred ms a step on 2 cores.
BASE = [PARITY, "parallelism.dp=2", "training.eval_every=0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[int, float, float]]:
    """The uninterrupted run every interrupted one must equal bitwise."""
    tmp = tmp_path_factory.mktemp("ref")
    job = Job(tmp, "ref", [*BASE, f"training.steps={STEPS}", f"logging.run_dir={tmp / 'run'}"])
    try:
        assert job.wait() == 0, job.text()[-4000:]
    finally:
        job.stop()
    ref = losses(tmp / "run")
    assert [s for s, _, _ in ref] == list(range(1, STEPS + 1))
    return ref


def test_preemption_sigterm_one_rank_then_ctrl_c_then_resume(tmp_path, reference, jobs):
    """SIGTERM to rank 1 alone: every rank stops after the same step, saves and exits 0.
    The resumed run gets Ctrl-C (SIGINT to launch.sh's process group): one line, exit 0, no
    traceback. The third launch finishes; steps 1..12 appear once; losses equal bitwise."""
    run, ckpt = tmp_path / "run", tmp_path / "ck"
    args = [
        *BASE,
        f"training.steps={STEPS}",
        f"logging.run_dir={run}",
        f"checkpoint.dir={ckpt}",
        "checkpoint.interval=100",
    ]
    job = jobs(tmp_path, "first", args)
    wait_until(at_step(run, 2), job, "step 2")
    os.kill(job.workers()[1], signal.SIGTERM)
    assert job.wait() == 0, job.text()[-4000:]
    no_traceback(job)
    lines = [line for line in job.text().splitlines() if line.startswith("preempted:")]
    assert len(lines) == 1 and "SIGTERM" in lines[0], job.text()[-3000:]
    first_stop = records(run)[-1]["step"]
    assert 2 <= first_stop < STEPS and newest(str(ckpt)).endswith(f"step_{first_stop:08d}")
    assert f"resume from step {first_stop}" in lines[0]

    job = jobs(tmp_path, "second", args)
    wait_until(at_step(run, first_stop + 2), job, f"step {first_stop + 2}")
    os.killpg(job.proc.pid, signal.SIGINT)  # what Ctrl-C on a terminal does
    assert job.wait() == 0, job.text()[-4000:]
    no_traceback(job)
    assert f"resumed from {ckpt / f'step_{first_stop:08d}'}" in job.text()
    lines = [line for line in job.text().splitlines() if line.startswith("preempted:")]
    assert len(lines) == 1 and "SIGINT" in lines[0], job.text()[-3000:]
    second_stop = records(run)[-1]["step"]
    assert first_stop < second_stop < STEPS

    job = jobs(tmp_path, "third", args)
    assert job.wait() == 0, job.text()[-4000:]
    assert f"resumed from {ckpt / f'step_{second_stop:08d}'}" in job.text()
    assert losses(run) == reference  # each step once, bitwise the uninterrupted numbers


def _stop_mid_save(job: Job, ckpt: Path, after: int) -> None:
    """Freeze rank 0 while a step directory after `after` is half written, then SIGKILL it."""
    while True:
        tmp = wait_until(lambda: sorted(ckpt.glob(".tmp-step_*")), job, "a save in flight", timeout=240)[-1]
        step = int(tmp.name[-8:])
        pid = job.workers()[0]
        os.kill(pid, signal.SIGSTOP)
        if tmp.exists() and step > after and not (ckpt / tmp.name[5:]).exists():
            assert not (tmp / "manifest.json").exists()
            os.kill(pid, signal.SIGKILL)
            return
        os.kill(pid, signal.SIGCONT)  # too late for this one: wait for the next save
        wait_until(lambda s=tmp: not s.exists(), job, "that save to finish")


def test_sigkill_mid_step_and_mid_background_save_restart(tmp_path, reference, jobs):
    """MAX_RESTARTS=2: rank 1 SIGKILLed mid-run, then rank 0 SIGKILLed while a background
    (checkpoint.async) save is half written. The agent restarts both times from the newest
    complete checkpoint (never the half-written one), one line per restart naming the killed
    rank; exit 0; each step once; bitwise equal."""
    run, ckpt = tmp_path / "run", tmp_path / "ck"
    args = [*BASE, f"training.steps={STEPS}", f"logging.run_dir={run}", f"checkpoint.dir={ckpt}"]
    args += ["checkpoint.interval=2", "checkpoint.async=true"]
    job = jobs(tmp_path, "job", args, MAX_RESTARTS="2")
    wait_until(at_step(run, 3), job, "step 3")
    os.kill(job.workers()[1], signal.SIGKILL)
    wait_until(lambda: job.text().count("checkpoint: resumed from") >= 1, job, "the first restart")
    _stop_mid_save(job, ckpt, after=4)
    assert job.wait() == 0, job.text()[-4000:]
    assert job.text().count("checkpoint: resumed from") == 2, job.text()[-4000:]
    restarts = [line for line in job.err.read_text().splitlines() if line.startswith("restarting")]
    assert len(restarts) == 2, job.text()[-4000:]
    assert restarts[0].startswith("restarting (1 of MAX_RESTARTS=2): rank 1 was killed by SIGKILL"), restarts
    assert restarts[1].startswith("restarting (2 of MAX_RESTARTS=2): rank 0 was killed by SIGKILL"), restarts
    assert error_lines(job.text()) == [] and losses(run) == reference


def test_restart_with_a_rank_late_to_the_rendezvous(tmp_path, jobs):
    """The restarted round's rank 1 starts 5 s after its rank 0 (tests/dist_scripts/late_rank.py):
    with the rendezvous store shared by both rounds (torch's default) rank 0 read rank 1's
    address of the first round and gloo's connectFullMesh was refused; supervise.py gives each
    round a fresh store, so the restarted job completes."""
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=1"]
    supervise = [sys.executable, "-m", "dtensor3d.launch.supervise", "--nproc_per_node=2"]
    job = jobs(tmp_path, "job", [*rdzv, "tests/dist_scripts/late_rank.py"], cmd=supervise)
    assert job.wait(120) == 0, job.text()[-4000:]
    out = job.text()
    assert sorted(line for line in out.splitlines() if line.startswith("attempt")) == [
        f"attempt {a} rank {r} sum 2" for a in (0, 1) for r in (0, 1)
    ], out[-4000:]
    assert "restarting (1 of MAX_RESTARTS=1): rank 1 exited with status 1" in out, out[-4000:]


def test_an_error_only_rank_1_sees_is_one_line_and_not_restarted(tmp_path, jobs):
    """A wrong input that only rank 1 meets (tests/dist_scripts/rank1_error.py): rank 0, which
    prints the job's errors, has nothing to say; the supervisor prints rank 1's line once and
    ends with status 2 at the first attempt, MAX_RESTARTS notwithstanding."""
    starts = tmp_path / "starts"
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=2"]
    supervise = [sys.executable, "-m", "dtensor3d.launch.supervise", "--nproc_per_node=2"]
    job = jobs(tmp_path, "job", [*rdzv, "tests/dist_scripts/rank1_error.py", str(starts)], cmd=supervise)
    assert job.wait(120) == 2, job.text()[-4000:]
    assert error_lines(job.text()) == ["error: data.path: shard 7 is unreadable (only rank 1 reads it)"], job.text()
    assert sorted(starts.read_text().splitlines()) == ["start rank 0", "start rank 1"]
    no_traceback(job)


def test_first_failure_rule():
    """supervise.first_failure on the agent's view of an attempt (times known to the second for
    a signal): a killed rank comes before the peer that then failed in a collective; a rank that
    timed out comes before the frozen one the agent SIGKILLed 30 s later, or that aborted within
    the second once let go; the agent's own
    SIGTERM is never the cause; a deterministic exit (2) is seen as the first failure."""
    killed, peer = Failure(1, -9, 100.0, None, None), Failure(0, 1, 100.7, "step 3: x", "step 3")
    assert first_failure([peer, killed]) == killed
    assert summary([peer, killed]) == "rank 1 was killed by SIGKILL (then rank 0: step 3)"
    timeout = "step 5: a collective did not complete within training.timeout_s=20 s (a rank hung or stopped)"
    timed_out, frozen = Failure(0, 1, 100.2, timeout, "step 5"), Failure(1, -9, 130.0, None, None)
    assert first_failure([frozen, timed_out]) == timed_out
    # the frozen rank, let go once rank 0 has ended, aborts on the closed connection within the
    # second (the agent's time, whole seconds, can read earlier): the timeout still came first
    aborted = Failure(1, -6, 100.0, None, None)
    assert first_failure([aborted, timed_out]) == timed_out
    termed, door = Failure(1, -15, 100.0, None, None), Failure(0, 2, 100.0, None, None)
    assert first_failure([termed, door]) == door
    assert final_line([[peer, killed], [frozen, timed_out]], 1) == (
        "error: the job failed after 1 restart(s) (MAX_RESTARTS=1); the first failure: rank 1 was killed by "
        f"SIGKILL (then rank 0: step 3); the last: rank 0 exited with status 1: {timeout}"
    )


def _unfreeze_when_rank0_ends(job: Job, frozen: int, rank0: int) -> None:
    """Wait until rank 0 (pid `rank0`) has ended (it timed out), then SIGCONT the frozen rank so
    that it takes the agent's SIGTERM (a rank truly hung would be SIGKILLed after 30 s)."""
    wait_until(lambda: job.workers().get(0) != rank0, job, "rank 0 to time out and end", timeout=120)
    os.kill(frozen, signal.SIGCONT)


def test_failing_job_reports_the_first_failure_and_a_hang_once(tmp_path, jobs):
    """MAX_RESTARTS=1. Attempt 1: rank 1 SIGKILLed (one `restarting` line). Attempt 2: rank 1
    frozen with SIGSTOP; rank 0's collective times out (training.timeout_s=8) within 60 s.
    The job stops with status 1 and exactly one `error:` line: the first failure of the job
    (rank 1 SIGKILLed, with the step rank 0 then named) and the last (rank 0's timeout, naming
    the step), not one line per rank that noticed."""
    run = tmp_path / "run"
    args = [*BASE, "training.steps=400", "training.timeout_s=8", f"logging.run_dir={run}"]
    job = jobs(tmp_path, "job", args, MAX_RESTARTS="1")
    wait_until(at_step(run, 1), job, "step 1")
    os.kill(job.workers()[1], signal.SIGKILL)
    wait_until(lambda: job.text().count("dtensor3d: world") >= 2, job, "the restart")
    wait_until(at_step(run, 1), job, "step 1 of the restarted job (metrics.jsonl starts again: no checkpoint)")
    ranks = job.workers()
    os.kill(ranks[1], signal.SIGSTOP)
    start = time.monotonic()
    try:
        _unfreeze_when_rank0_ends(job, ranks[1], ranks[0])
    finally:
        os.kill(ranks[1], signal.SIGCONT)
    assert job.wait() == 1, job.text()[-4000:]
    assert time.monotonic() - start < 60
    no_traceback(job)
    lines = error_lines(job.text())
    assert len(lines) == 1 and job.text().count("did not complete within") == 1, job.text()[-4000:]
    first, last = lines[0].split("; the last: ")
    assert first.startswith(
        "error: the job failed after 1 restart(s) (MAX_RESTARTS=1); the first failure: rank 1 was killed by "
        "SIGKILL (then rank 0: step "
    ), lines[0]
    assert last.startswith("rank 0 exited with status 1: step "), lines[0]
    assert "a collective did not complete within training.timeout_s=8 s" in last, lines[0]


def test_rank_missing_at_the_start_times_out_in_setup(tmp_path):
    """training.timeout_s reaches the rendezvous: rank 0 of a 2-rank world whose rank 1 never
    starts ends after about that long, with one line naming setup, not torch's 30 minutes."""
    world = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    cmd = [sys.executable, "-m", "dtensor3d", "train", *BASE, "training.timeout_s=3", f"logging.run_dir={tmp_path}"]
    start = time.monotonic()
    extra = {**world, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(**extra), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert time.monotonic() - start < 120
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: setup: a collective did not complete within "
                                                   "training.timeout_s=3 s"), proc.stderr[-3000:]  # fmt: skip
    assert "Traceback" not in proc.stderr


def train_one(tmp: Path, *overrides: str, limit: int | None = None) -> subprocess.CompletedProcess:
    """python -m dtensor3d train on one process (optionally under a file-size limit)."""

    def limited():
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [sys.executable, "-m", "dtensor3d", "train", PARITY, "training.eval_every=0", *overrides]
    return subprocess.run(
        cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300, preexec_fn=limited
    )


ABSURD_LR = ["optimizer.lr=1e30", "optimizer.min_lr=0", "optimizer.warmup_steps=0"]


def test_nonfinite_stop_names_the_parameter_keeps_the_checkpoint_and_is_not_restarted(tmp_path, jobs):
    """lr 1e30 at dp 2 under launch.sh with MAX_RESTARTS=2: step 1 is fine, step 2's gradients
    overflow. stop: one error line naming step 2 and the first parameter whose gradient is
    non-finite; status 2 after one attempt (a deterministic failure is not restarted); step
    1's checkpoint untouched."""
    ckpt = tmp_path / "ck"
    args = [*BASE, *ABSURD_LR, "training.steps=6", f"logging.run_dir={tmp_path}/run", f"checkpoint.dir={ckpt}",
            "checkpoint.interval=1"]  # fmt: skip
    job = jobs(tmp_path, "job", args, MAX_RESTARTS="2")
    assert job.wait() == 2, job.text()[-3000:]
    assert job.text().count("dtensor3d: world") == 1 and "restarting" not in job.text(), job.text()[-3000:]
    lines = error_lines(job.text())
    assert len(lines) == 1 and lines[0].startswith("error: step 2: the gradient of model."), job.text()[-3000:]
    no_traceback(job)
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_00000001"]
    manifest = json.loads((ckpt / "step_00000001" / "manifest.json").read_text())["files"]
    assert {k: v["sha256"] for k, v in manifest.items()} == {
        k: v for k, v in digest(ckpt / "step_00000001").items() if k != "manifest.json"
    }
    assert [r["step"] for r in records(tmp_path / "run")] == [1]


def test_nonfinite_skip_changes_nothing_and_stops_after_max(tmp_path):
    """skip: steps 2, 3, 4 are skipped (skipped_steps 1, 2 in metrics.jsonl) and the run
    stops at the third (max_skipped_steps=3); the checkpoints of the skipped steps hold the very
    parameters and optimizer state of step 1."""
    ckpt = tmp_path / "ck"
    proc = train_one(tmp_path, *ABSURD_LR, "training.steps=8", "training.on_nonfinite=skip",
                     "training.max_skipped_steps=3", f"logging.run_dir={tmp_path}/run",
                     f"checkpoint.dir={ckpt}", "checkpoint.interval=1", "checkpoint.keep=10")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: step 4: "), proc.stderr
    assert "max_skipped_steps=3" in proc.stderr
    recs = records(tmp_path / "run")
    assert [(r["step"], r.get("skipped_steps")) for r in recs] == [(1, None), (2, 1), (3, 2)]  # 4: the error line
    steps = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_"))
    assert steps == ["step_00000001", "step_00000002", "step_00000003"]  # not 4: it stopped there
    first = digest(ckpt / steps[0])
    for name in steps[1:]:
        later = digest(ckpt / name)
        for file in ("model-stage00.safetensors", "optim-stage00.safetensors"):
            assert later[file] == first[file], (name, file)


def test_save_out_of_space_keeps_the_previous_checkpoint(tmp_path):
    """A save that fails part-way (a 1 MB file-size limit; the optimizer file is 1.5 MB): one
    error line naming checkpoint.dir and the step; the step-2 checkpoint is byte for byte
    what it was, nothing half-written is left, and it is the one a resume takes."""
    ckpt, run = tmp_path / "ck", f"logging.run_dir={tmp_path}/run"
    common = [run, f"checkpoint.dir={ckpt}", "checkpoint.interval=2"]
    assert train_one(tmp_path, "training.steps=2", *common).returncode == 0
    before = digest(ckpt / "step_00000002")
    proc = train_one(tmp_path, "training.steps=4", *common, limit=1_000_000)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("note: training.steps grew")]
    assert len(lines) == 1 and lines[0].startswith(f"error: checkpoint.dir={str(ckpt)!r}: saving step 4 failed"), lines
    assert "step_00000002 is intact" in lines[0] and "Traceback" not in proc.stdout + proc.stderr
    assert digest(ckpt / "step_00000002") == before
    assert sorted(p.name for p in ckpt.iterdir() if "step_" in p.name) == ["step_00000002"]
    assert newest(str(ckpt)) == str(ckpt / "step_00000002")


# ---------------------------------------------------------------- two nodes on one machine


def two_nodes(jobs, tmp: Path, per_node: list[list[str]], **extra_env: str) -> list[Job]:
    """launch.sh twice as two nodes of one job (NNODES=2, NODE_RANK 0 and 1, one MASTER_PORT)."""
    common = dict(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **extra_env)
    return [jobs(tmp, f"node{n}", [*BASE, *args], NODE_RANK=str(n), **common) for n, args in enumerate(per_node)]


@pytest.mark.parametrize("lost", [1, 0])
def test_a_killed_node_takes_its_ranks_and_the_other_node_names_it(tmp_path, jobs, lost):
    """SIGKILL to one node's launcher process group (node 0 also hosts the rendezvous store):
    its rank dies with its agent (no orphan training unsupervised), the other node's rank fails
    in its next collective, and that node ends with one line naming the lost node, no `done:`
    line, no traceback."""
    args = ["training.steps=100000", "training.timeout_s=8", f"logging.run_dir={tmp_path / 'run'}"]
    restarts = "1" if lost == 1 else "0"  # node 0 restarts, waits timeout_s for node 1 to rejoin, then ends
    nodes = two_nodes(jobs, tmp_path, [args, args], MAX_RESTARTS=restarts)
    victim, survivor = nodes[lost], nodes[1 - lost]
    wait_until(at_step(tmp_path / "run", 2), survivor, "step 2")
    orphan = wait_until(lambda: victim.workers().get(lost), victim, f"node {lost}'s rank")
    os.killpg(victim.proc.pid, signal.SIGKILL)
    wait_until(lambda: _state(orphan) in ("", "Z"), None, f"node {lost}'s rank to die", 10)
    assert survivor.wait(60) == 1, survivor.text()[-3000:]
    lines = error_lines(survivor.text())
    assert len(lines) == 1 and lines[0].startswith("error: the job failed: "), survivor.text()[-3000:]
    assert f"node {lost} " in lines[0] and "was lost" in lines[0] and "done:" not in survivor.text()
    if restarts == "1":
        assert "restarting (1 of MAX_RESTARTS=1): node 1 was lost;" in survivor.text(), survivor.text()[-3000:]
        assert "a node did not rejoin within training.timeout_s=8 s (node 1 was lost)" in lines[0], lines
    no_traceback(survivor)


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return ""


def test_a_node_that_never_joins_is_one_line_at_the_timeout(tmp_path, jobs):
    """Node 0 alone: a line every 10 s says who joined; at training.timeout_s one error, exit 2."""
    start = time.monotonic()
    (node0,) = two_nodes(jobs, tmp_path, [["training.timeout_s=12"]])
    assert node0.wait(60) == 2, node0.text()[-3000:]
    assert time.monotonic() - start < 12 + 20  # the limit, plus launch.sh's validate and imports
    text = node0.text()
    assert "waiting for nodes: 1 of 2 joined (node 0), 10 s of 12" in text, text
    lines = error_lines(text)
    assert len(lines) == 1 and "the rendezvous timed out after 12 s" in lines[0] and "missing: node 1" in lines[0]
    no_traceback(node0)


def test_nodes_with_different_recipes_are_refused_on_every_node(tmp_path, jobs):
    node0, node1 = two_nodes(jobs, tmp_path, [["training.steps=10"], ["training.steps=6"]])
    for node in (node0, node1):
        assert node.wait(120) == 2, node.text()[-3000:]
        lines = error_lines(node.text())
        assert lines == ["error: the nodes' recipes differ at training.steps: node 0 has 10, node 1 has 6; start "
                         "every node with the same recipe, overrides and dtensor3d"], node.text()[-3000:]  # fmt: skip
        no_traceback(node)


def test_a_hang_noticed_in_the_steps_hooks_is_the_steps_one_line():
    """A rank frozen between a step and its hooks (the step times' all_gather, an evaluation, a
    save) times out in a hook: Guard.after_step, around run_step's hooks, names the step as the
    step's own guard does (it was a traceback: a full-suite run caught it under load)."""
    from types import SimpleNamespace

    from dtensor3d.config.load import load_recipe
    from dtensor3d.training.faults import CollectiveError, Guard

    guard = Guard(load_recipe(PARITY, ["training.timeout_s=8"]))
    try:
        with pytest.raises(
            CollectiveError, match=r"^step 3: a collective did not complete within training\.timeout_s=8 s"
        ):
            with guard.after_step(SimpleNamespace(step=3)):
                raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv")
        with pytest.raises(ZeroDivisionError):  # a bug in a hook keeps its traceback
            with guard.after_step(SimpleNamespace(step=3)):
                raise ZeroDivisionError
    finally:
        guard.close()
