"""A chaos soak: a real `bash launch.sh` job (dp 2 x tp 2, four ranks on this machine) with K faults
injected at seeded random steps, relaunched whenever it ends (as a scheduler would), checked at
the end against one uninterrupted run of the same recipe and mesh.

    python bench/chaos.py --steps 200 --faults 20 --seed 0

Faults, in a seeded order (each kind in turn, then again): SIGKILL of a rank (the agent restarts
the job, MAX_RESTARTS), SIGKILL of the launcher's process group (a lost node: its ranks die with
it; relaunched), SIGSTOP of a rank for longer than training.timeout_s (a hang: the peers time out,
the agent restarts; once a peer has ended the rank is let go, SIGCONT, so that it takes the
agent's SIGTERM at once instead of torch's 30 s wait before SIGKILL), SIGTERM to the launcher
(preemption: save, exit 0; relaunched), a full disk during a save (RLIMIT_FSIZE set on the ranks:
the save fails, the job ends with status 2, the previous checkpoint is intact; relaunched), and a
corrupt newest checkpoint (a byte flipped in a tensor file, then the launcher killed: with
`checkpoint.on_damaged: previous` the relaunch's door sets the step aside and resumes from the one
before).

At the end: every step appears exactly once in metrics.jsonl, and the losses and grad norms equal
the uninterrupted run's bitwise. Prints one line:
`faults injected K, survived K, steps lost 0, wall overhead X%`
(exit status 1 when a fault was not survived).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("kill_rank", "kill_launcher", "hang", "preempt", "full_disk", "corrupt")
TIMEOUT_S = 8  # training.timeout_s: a hang is noticed after this


def recipe_args(steps: int, work: Path, name: str) -> list[str]:
    return [
        str(ROOT / "tests" / "recipes" / "parity.yaml"),
        "parallelism.dp=2",
        "parallelism.tp=2",
        "training.eval_every=0",
        f"training.steps={steps}",
        f"training.timeout_s={TIMEOUT_S}",
        "checkpoint.interval=2",
        "checkpoint.keep=3",
        "checkpoint.on_damaged=previous",
        f"checkpoint.dir={work / name / 'ckpt'}",
        f"logging.run_dir={work / name / 'run'}",
    ]


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**out, "MAX_RESTARTS": "100", "PYTHONPATH": str(ROOT)}


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return [json.loads(line) for line in lines]


def stepped_since(run_dir: Path, since: float) -> bool:
    """The job logged a step after `since` (its launch, or the last fault): it is training."""
    path = run_dir / "metrics.jsonl"
    return path.exists() and path.stat().st_mtime > since


def last_step(run_dir: Path) -> int:
    return max((r["step"] for r in records(run_dir)), default=0)


class Launch:
    """One `bash launch.sh` in its own process group, output appended to a log."""

    def __init__(self, args: list[str], log: Path):
        with open(log, "a") as out:
            self.proc = subprocess.Popen(
                ["bash", "launch.sh", *args], cwd=ROOT, env=env(), stdout=out, stderr=out, start_new_session=True
            )

    def ranks(self) -> list[int]:
        """The pids of the ranks (the agent's children that have RANK set)."""
        pids = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            try:
                children = task.read_text().split()
            except OSError:
                continue
            for pid in children:
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes()
                except OSError:
                    continue
                if b"\0RANK=" in environ or environ.startswith(b"RANK="):
                    pids.append(int(pid))
        return sorted(pids)

    def running(self) -> bool:
        return self.proc.poll() is None


def inject(kind: str, job: Launch, work: Path, rng: random.Random) -> str:
    """Do one fault to the running job; returns what was done."""
    ranks = job.ranks()
    if kind == "kill_rank" and ranks:
        victim = rng.choice(ranks)
        os.kill(victim, signal.SIGKILL)
        return f"SIGKILL rank pid {victim}"
    if kind == "hang" and ranks:
        victim = rng.choice(ranks)
        os.kill(victim, signal.SIGSTOP)  # soak lets it go (SIGCONT) once a peer has timed out and ended
        return f"SIGSTOP rank pid {victim}"
    if kind == "preempt":
        os.kill(job.proc.pid, signal.SIGTERM)
        return "SIGTERM to the launcher"
    if kind == "full_disk" and ranks:
        for pid in ranks:  # any write beyond 64 KiB fails: the next save's tensor files do
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        return "RLIMIT_FSIZE 64 KiB on every rank"
    if kind == "corrupt":
        newest = sorted((work / "chaos" / "ckpt").glob("step_*[0-9]"))
        tensors = sorted(newest[-1].glob("*.safetensors")) if newest else []
        if tensors:
            with open(tensors[0], "r+b") as f:
                f.seek(os.path.getsize(tensors[0]) - 1)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
        os.killpg(job.proc.pid, signal.SIGKILL)
        return f"flipped a byte of {tensors[0] if tensors else 'nothing'}; SIGKILL the launcher"
    os.killpg(job.proc.pid, signal.SIGKILL)  # kill_launcher (or no ranks up yet)
    return "SIGKILL the launcher's process group"


def let_go_when_noticed(job: Launch | None, frozen: set[int] | None) -> set[int] | None:
    """A hang's ranks (`frozen`: their pids at the fault) get SIGCONT once one of them has ended (a peer
    timed out: the hang was noticed), so that the stopped one takes the agent's SIGTERM; returns what
    is still held."""
    if frozen is None or job is None or (job.running() and set(job.ranks()) == frozen):
        return frozen
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return None


def schedule(steps: int, faults: int, seed: int) -> list[tuple[int, str]]:
    """(step, kind) pairs: K distinct steps in 2..steps-2, kinds each in turn in a seeded order."""
    rng = random.Random(seed)
    at = sorted(rng.sample(range(2, steps - 1), faults))
    kinds = list(KINDS)
    rng.shuffle(kinds)
    return [(step, kinds[i % len(kinds)]) for i, step in enumerate(at)]


def run_reference(steps: int, work: Path) -> tuple[list[tuple[int, float, float]], float]:
    start = time.monotonic()
    proc = subprocess.run(["bash", "launch.sh", *recipe_args(steps, work, "reference")], cwd=ROOT, env=env(),
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"error: the uninterrupted run failed: {proc.stderr[-2000:]}")
    return trajectory(work / "reference" / "run"), time.monotonic() - start


def trajectory(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records(run_dir)]


def soak(steps: int, plan: list[tuple[int, str]], work: Path, seed: int, say) -> tuple[int, float, bool]:
    """Run the job under the fault plan, relaunching until it finishes; (faults injected, wall, done)."""
    args, log, rng = recipe_args(steps, work, "chaos"), work / "chaos.log", random.Random(seed + 1)
    run_dir, pending, injected, launches = work / "chaos" / "run", list(plan), 0, 0
    start, deadline = time.monotonic(), time.monotonic() + 60 * (10 + len(plan) + steps / 10)
    job, frozen = None, None
    while time.monotonic() < deadline:
        frozen = let_go_when_noticed(job, frozen)
        if job is None or not job.running():
            if job is not None and job.proc.returncode == 0 and last_step(run_dir) >= steps and not pending:
                return injected, time.monotonic() - start, True
            job, launches, since = Launch(args, log), launches + 1, time.time()
        if pending and stepped_since(run_dir, since) and last_step(run_dir) >= pending[0][0] and job.ranks():
            since = time.time()
            step, kind = pending.pop(0)
            injected += 1
            ranks = job.ranks()
            say(f"step {last_step(run_dir)}: fault {injected} ({kind}): {inject(kind, job, work, rng)}")
            frozen = set(ranks) if kind == "hang" else None
        time.sleep(0.05)
    return injected, time.monotonic() - start, False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default=None, help="a directory for the runs (default: a temporary one)")
    args = parser.parse_args(argv)
    if not 0 < args.faults <= args.steps - 3:
        print(
            f"error: --faults={args.faults} must be in 1..{args.steps - 3} (one fault a step at most)", file=sys.stderr
        )
        return 2
    work = Path(args.work or tempfile.mkdtemp(prefix="chaos-"))
    say = lambda line: print(line, flush=True)  # noqa: E731
    plan = schedule(args.steps, args.faults, args.seed)
    say(f"chaos: {args.steps} steps, {args.faults} faults, seed {args.seed}, work {work}")
    reference, ref_wall = run_reference(args.steps, work)
    injected, wall, finished = soak(args.steps, plan, work, args.seed, say)
    got = trajectory(work / "chaos" / "run")
    steps_seen = [s for s, _, _ in got]
    lost = len(set(range(1, args.steps + 1)) - set(steps_seen))
    once = steps_seen == list(range(1, args.steps + 1))
    same = got == reference
    survived = injected if finished and once and same else 0
    say(f"every step once: {once}; losses and grad norms bitwise equal to the uninterrupted run: {same}")
    say(
        f"faults injected {injected}, survived {survived}, steps lost {lost}, "
        f"wall overhead {100 * (wall - ref_wall) / ref_wall:.0f}%"
    )
    return 0 if survived == injected == args.faults else 1


if __name__ == "__main__":
    sys.exit(main())
