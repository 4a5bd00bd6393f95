"""Faults during a run, seen by the ranks: preemption signals, non-finite steps, collectives
that do not complete. Each is agreed by every rank, so all of them stop (or skip) at the
same step.

- Preemption: SIGTERM or SIGINT sets a flag. The C-level handler also writes to a wakeup
  pipe, so a watchdog thread notices at once even while the main thread waits inside a
  collective. At each step boundary the ranks take the maximum of their flags (one tiny
  all-reduce), so a signal to any one rank stops them all after the same step; the loop then
  saves a checkpoint and exits 0. A stop that takes longer than
  checkpoint.preempt_timeout_s is ended by the watchdog (one line, exit 1).
- Non-finite values: the loss and the gradient norm are all-reduced, so every rank sees the
  same NaN or inf; the optimizer step is then skipped everywhere (no parameter or optimizer
  state changes). training.on_nonfinite=stop ends the run with one line naming the step and
  the loss or the first parameter (by name) whose gradient was non-finite; skip counts
  `skipped_steps` and stops after training.max_skipped_steps consecutive skips.
- Hangs: training.timeout_s is the timeout of the default process group
  (mesh.init_distributed: a rank missing at the start) and is set on every group once the
  mesh is built (mesh.set_timeout), so a collective that does not complete raises instead of waiting forever;
  setup and the loop turn it into one line naming setup or the step (`report`). Under
  launch.sh that line goes to the supervisor (supervise.py), which prints one per job.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from ..errors import COLLECTIVE_TIMEOUT, UserError, is_rank0, write_error_file
from ..parallel.shards import local

RESIZE = signal.SIGUSR1  # from this node's agent: the job's nodes changed (launch/elastic.py): save and exit 0
SIGNALS = (signal.SIGTERM, signal.SIGINT, RESIZE)
NAME_BYTES = 256  # a parameter name, as bytes, in the all-reduce that finds the first bad one


class FaultError(UserError):
    """A fault seen during training that every rank agrees on (a non-finite step, a failed
    save): one `error:` line naming the step or the directory; nothing saved is lost."""


class CollectiveError(RuntimeError):
    """A collective that failed or did not complete in time (a hung or dead rank). `short`:
    where and why without torch's own text."""

    def __init__(self, short: str, detail: str):
        super().__init__(f"{short}: {detail}")
        self.short = short


# ---------------------------------------------------------------- preemption


class Preemption:
    """SIGTERM/SIGINT handling for one run. `install()` before setup, `close()` at the end."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.signal: int | None = None  # the first signal received
        self.finished = threading.Event()
        self.previous: dict[int, object] = {}
        self.pipe: tuple[int, int] | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self.pipe = os.pipe()
        os.set_blocking(self.pipe[1], False)
        for sig in SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handler)
        self.previous[-1] = signal.set_wakeup_fd(self.pipe[1], warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="dtensor3d-preemption", daemon=True).start()
        # Under launch.sh the ranks start with these blocked (supervise.py): one that came
        # during the start is delivered now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)

    def _handler(self, signum, frame) -> None:  # runs in the main thread between bytecodes
        if self.signal is None:
            self.signal = signum

    def _watch(self) -> None:
        """Wake on the first signal byte; end the process if the stop overruns its deadline."""
        try:
            byte = os.read(self.pipe[0], 1)
        except OSError:
            return
        if not byte or self.finished.is_set():
            return
        if self.signal is None:
            self.signal = byte[0]
        if not self.finished.wait(self.timeout_s):
            name = signal.Signals(self.signal).name
            report(
                f"{name} received but the run did not stop and save within checkpoint.preempt_timeout_s="
                f"{self.timeout_s:g} s; exiting without a new checkpoint (a resume takes the newest complete one)"
            )
            os._exit(1)

    def agreed(self, device: torch.device) -> str | None:
        """Collective: the name of the signal any rank received, or None. Call at each step boundary."""
        flag = torch.tensor([self.signal or 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        if value and self.signal is None:
            self.signal = value
        return signal.Signals(value).name if value else None

    def close(self) -> None:
        self.finished.set()
        if self.pipe is None:
            return
        signal.set_wakeup_fd(self.previous.pop(-1))
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        os.close(self.pipe[1])  # the watcher's read returns b""
        self.pipe = None


def preempted_line(name: str, step: int, saved: str | None, ckpt_dir: str | None) -> str:
    if name == RESIZE.name:
        kept = f"saved {saved}" if saved else "no new checkpoint"
        return (
            f"resizing: the job's nodes changed; stopped after step {step}; {kept}; the ranks restart on the new mesh"
        )
    if saved:
        what = f"saved {saved}; run the same command again to resume from step {step}"
    elif ckpt_dir:
        what = f"checkpoint {ckpt_dir} kept as it was"
    else:
        what = "no checkpoint.dir is set, so nothing was saved and the run cannot resume"
    return f"preempted: {name} received; stopped after step {step}; {what}"


# ---------------------------------------------------------------- non-finite steps


def first_nonfinite_grad(model: torch.nn.Module, stage: int) -> str | None:
    """Collective: the name of the first parameter (pipeline stage, then model order) whose
    gradient holds a NaN or inf on any rank; None when every gradient is finite."""
    order = math.inf
    name = ""
    for i, (n, p) in enumerate(model.named_parameters()):
        if p.grad is not None and not bool(torch.isfinite(local(p.grad)).all()):
            order, name = stage * 1_000_000 + i, n
            break
    device = next(model.parameters()).device
    best = torch.tensor([order], dtype=torch.float64, device=device)
    dist.all_reduce(best, op=dist.ReduceOp.MIN)
    mine = name.encode()[:NAME_BYTES] if order == best.item() else b""
    text = torch.zeros(NAME_BYTES, dtype=torch.int32, device=device)
    text[: len(mine)] = torch.tensor(list(mine), dtype=torch.int32)
    dist.all_reduce(text, op=dist.ReduceOp.MAX)  # every rank holding the first one has the same name
    return bytes(text[text > 0].tolist()).decode(errors="replace") or None


def nonfinite(model: torch.nn.Module, stage: int, loss: float, grad_norm: float) -> str | None:
    """What was non-finite in a step (the same answer on every rank, as loss and grad_norm are
    all-reduced), or None. Collective when something was."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return None
    if not math.isfinite(loss):
        return f"the loss ({loss})"
    name = first_nonfinite_grad(model, stage)
    if name is None:
        return f"the gradient norm ({grad_norm}; every gradient is finite, their squared sum overflowed)"
    return f"the gradient of {name} (grad_norm {grad_norm})"


class SkipCount:
    """training.on_nonfinite for the loop: adds `skipped_steps` to a skipped step's metrics,
    raises FaultError on stop or after max_skipped_steps consecutive skips."""

    def __init__(self, training, ckpt_dir: str | None):
        self.mode, self.limit, self.ckpt_dir = training.on_nonfinite, training.max_skipped_steps, ckpt_dir
        self.total = self.consecutive = 0

    def after(self, metrics: dict) -> None:
        what = metrics.pop("nonfinite", None)
        if what is None:
            self.consecutive = 0
            return
        self.total += 1
        self.consecutive += 1
        metrics["skipped_steps"] = self.total
        step = metrics["step"]
        if self.mode == "stop":
            raise FaultError(
                f"step {step}: {what} is non-finite; no update was made and training stopped "
                f"(training.on_nonfinite=stop){self._kept()}"
            )
        if self.consecutive >= self.limit:
            raise FaultError(
                f"step {step}: {what} is non-finite, the {self.consecutive}th step skipped in a row "
                f"(training.max_skipped_steps={self.limit}); training stopped{self._kept()}"
            )

    def _kept(self) -> str:
        if not self.ckpt_dir:
            return ""
        return f"; checkpoint.dir={self.ckpt_dir} keeps the last good checkpoint, untouched"


# ---------------------------------------------------------------- collectives that do not complete


def is_collective_failure(e: BaseException) -> bool:
    """A failed or timed-out collective or store wait (torch's DistError; gloo's errors are
    RuntimeErrors naming gloo), as opposed to a bug, which keeps its traceback."""
    text = str(e).lower()
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and ("gloo" in text or "nccl" in text))


@contextlib.contextmanager
def collective_guard(where: str, timeout_s: float):
    """Turn a failed collective inside `where` ("step N", "setup") into a CollectiveError naming it."""
    try:
        yield
    except (dist.DistError, RuntimeError) as e:
        if isinstance(e, UserError) or not is_collective_failure(e):
            raise
        text = " ".join(str(e).split())[:400]
        if "timed out" in text.lower() or "timeout" in text.lower():
            why = f"{COLLECTIVE_TIMEOUT} training.timeout_s={timeout_s:g} s (a rank hung or stopped)"
        else:
            why = "a collective failed (a rank died or its connection closed)"
        raise CollectiveError(f"{where}: {why}", text) from None


def report(line: str, short: str | None = None) -> None:
    """This rank's one line about a fault that ends it with status 1. Under launch.sh
    (supervise.py) it goes into torch's error file for this rank (with `short`, the line
    without torch's text, for the supervisor to quote), and the supervisor prints one line
    for the whole job, whichever ranks noticed; elsewhere it is printed."""
    if write_error_file(line, short=short or line):
        return
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    print(f"error: rank {rank}: {line}", file=sys.stderr, flush=True)


def report_collective(err: CollectiveError) -> int:
    """Report a CollectiveError (other ranks may be gone); exit status 1."""
    report(str(err), err.short)
    return 1


# ---------------------------------------------------------------- the loop's view


class Guard:
    """What the training loop calls: `Guard(recipe)` before setup (signal handlers),
    `setup_phase()` around setup, `step()` around each step, `check(metrics)` after it,
    `boundary(state, hooks)` at its end (an agreed SIGTERM/SIGINT: the hooks' `on_signal`
    save, then True: stop now), `close()` at the end. It owns no saver: checkpoints are a
    step hook (hooks.Checkpointing)."""

    def __init__(self, recipe):
        self.recipe = recipe
        self.preemption = Preemption(recipe.checkpoint.preempt_timeout_s)
        self.preemption.install()
        self.skips = SkipCount(recipe.training, recipe.checkpoint.dir)
        self.resizing = False  # stopped for an elastic resize: no `done:` line, the job goes on

    @contextlib.contextmanager
    def setup_phase(self):
        """Around setup: a collective or rendezvous that fails or times out (a rank missing or
        dead at the start) ends this rank with one line instead of a traceback."""
        try:
            with collective_guard("setup", self.recipe.training.timeout_s):
                yield
        except CollectiveError as e:
            self.close()
            raise SystemExit(report_collective(e)) from None

    def step(self, state):
        return collective_guard(f"step {state.step + 1}", self.recipe.training.timeout_s)

    def after_step(self, state):
        """Around the step's hooks (its step times' gather, evaluation, a save): a rank that hangs
        or dies while they run is the step's fault, one line as in the step (it used to end in
        a traceback from the gather when a SIGSTOP landed between the step and its hooks)."""
        return collective_guard(f"step {state.step}", self.recipe.training.timeout_s)

    def check(self, metrics: dict) -> None:
        self.skips.after(metrics)

    def boundary(self, state, hooks) -> bool:
        """Collective: on an agreed SIGTERM/SIGINT let the hooks save (`on_signal`: waits for
        the save), print one line (rank 0) and return True."""
        with collective_guard(f"step {state.step}", self.recipe.training.timeout_s):
            name = self.preemption.agreed(state.device)
            if name is None:
                return False
            saved = None
            for hook in hooks:
                saved = hook.on_signal(state) or saved
        self.resizing = name == RESIZE.name
        if is_rank0():
            print(preempted_line(name, state.step, saved, self.recipe.checkpoint.dir), flush=True)
        return True

    def final_barrier(self) -> None:
        """Collective, after close: every rank reached the end. A rank lost at the very end
        ends this one with one line (status 1), and the job prints no `done:` line."""
        try:
            with collective_guard("the end of training", self.recipe.training.timeout_s):
                dist.barrier()
        except CollectiveError as e:
            raise SystemExit(report_collective(e)) from None

    def close(self) -> None:
        """Always, last (after the hooks' close): restore the signal handlers."""
        self.preemption.close()
