"""Real `bash launch.sh` jobs for the fault and multi-node tests: a job in its own process
group with its output in files, its ranks found through /proc, its metrics read back; the
`jobs` fixture (conftest.py) stops whatever a test leaves running."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from helpers import ROOT, clean_env


class Job:
    """`bash launch.sh ARGS` (or `cmd`) in its own process group (as a terminal runs it),
    output in files."""

    def __init__(self, tmp: Path, name: str, args: list[str], cmd: list[str] | None = None, **extra_env: str):
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [*(cmd or ["bash", "launch.sh"]), *args],
                cwd=ROOT,
                env=clean_env(**extra_env),
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def wait(self, timeout: float = 300) -> int:
        return self.proc.wait(timeout)

    def text(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def stop(self) -> None:
        """SIGKILL the launcher and its ranks if still running (a failed test leaves nothing
        behind: the ranks run in sessions of their own, out of the launcher's group)."""
        if self.proc.poll() is not None:
            return
        ranks = self.workers().values()
        os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()

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


def hold(job: Job) -> list[int]:
    """SIGSTOP the job's ranks (its launcher keeps running); `release` them with the list returned."""
    pids = list(job.workers().values())
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def release(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def connected(pid: int, port: int) -> bool:
    """Whether process `pid` holds an established TCP connection to `port` (/proc: its socket
    descriptors against the net table's remote ports)."""
    sockets = set()
    for fd in glob.glob(f"/proc/{pid}/fd/*"):
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                sockets.add(link[8:-1])
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                field = row.split()
                if int(field[2].rsplit(":", 1)[1], 16) == port and field[3] == "01" and field[9] in sockets:
                    return True
    return False


def at_step(run_dir: Path, step: int):
    return lambda: any(r["step"] >= step for r in records(run_dir))


def digest(step_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(step_dir.iterdir())}


def losses(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records(run_dir)]


def no_traceback(job: Job) -> None:
    assert "Traceback" not in job.text(), job.text()[-4000:]


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
