"""launch.sh's torchrun: torch's elastic agent (c10d rendezvous, --max-restarts) run in this
process, with two differences from `python -m torch.distributed.run`.

- SIGTERM and SIGINT (Ctrl-C, `scancel`, `kubectl delete`) reaching the launcher are passed
  on to every worker, which stop at the next step boundary, save and exit 0 (faults.py).
  torchrun would instead stop the workers itself, SIGKILL them after 30 s and end with a
  traceback and a non-zero status. (Its workers run in their own sessions, so a Ctrl-C on
  the terminal reaches only the launcher.)
- A job that fails ends with one `error:` line naming the rank that failed first and how,
  instead of torchrun's ChildFailedError traceback. Status 2 (a wrong input, a non-finite
  step, a failed save) means the workers printed their own line already.

Usage: python -m dtensor3d.supervise [torchrun options] -m dtensor3d train RECIPE [...]
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import sys
import threading

SIGNALS = {signal.SIGTERM, signal.SIGINT}


def worker_pids() -> list[int]:
    """The processes this one started (the agent's workers)."""
    pids = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
            pids += [int(p) for p in f.read().split()]
    return pids


def forward_signals() -> None:
    """A thread: pass each SIGTERM/SIGINT on to the workers, and the last one to any worker
    started after it (a signal during the rendezvous); the agent keeps waiting for them."""
    last, sent = None, set()
    while True:
        signum = signal.sigtimedwait(SIGNALS, 0.5)
        if signum is not None:
            last, sent = signum.si_signo, set()
        for pid in worker_pids() if last else ():
            if pid not in sent:
                sent.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, last)


def failure_line(err, max_restarts: int) -> str:
    rank, failure = err.get_first_failure()
    how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with status {failure.exitcode}"
    tries = f" after {max_restarts} restart(s) (MAX_RESTARTS={max_restarts})" if max_restarts else ""
    return f"error: the job failed{tries}: rank {rank} {how}; its output above says why"


def main(argv: list[str]) -> int:
    # Blocked here, and so in the workers from their first instruction (a blocked mask is
    # inherited): a signal during a worker's start waits until faults.Preemption takes it.
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    threading.Thread(target=forward_signals, name="dtensor3d-signals", daemon=True).start()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(["--signals-to-handle=SIGHUP,SIGQUIT", *argv])  # SIGTERM, SIGINT: ours
    try:
        run(args)
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        if failure.exitcode == 2:  # the workers printed their one `error:` line
            return 2
        print(failure_line(err, args.max_restarts), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
