"""launch.sh's torchrun: torch's elastic agent (LocalElasticAgent, c10d rendezvous,
--max-restarts) run in this process, with these differences from `python -m torch.distributed.run`.

- SIGTERM and SIGINT (Ctrl-C, `scancel`, `kubectl delete`) reaching the launcher are passed
  on to every worker, which stop at the next step boundary, save and exit 0 (faults.py).
  torchrun would instead stop the workers itself, SIGKILL them after 30 s and end with a
  traceback and a non-zero status. (Its workers run in their own sessions, so a Ctrl-C on
  the terminal reaches only the launcher.) A job asked to stop is not restarted.
- A deterministic failure is final: a worker that exits with status 2 (a wrong input, a
  non-finite step under `stop`, a failed save) has printed its one `error:` line; the job
  ends at once with status 2 instead of failing the same way MAX_RESTARTS more times.
- One line per failed attempt, from here: a restart says which rank failed first and how;
  a job that fails for good ends with one `error:` line naming the first failure of the job
  (and the last, after restarts) instead of torchrun's ChildFailedError traceback. A worker
  that fails with status 1 (a collective that failed or timed out: faults.report) puts its
  one line into torch's error file for its rank instead of printing it, so a hang or a dead
  rank is one line per job, not one per rank that noticed it.
- Each rendezvous round gets a fresh TCPStore (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). With
  torch's default, the store the agent hosts is shared by every round, so a restarted rank
  could read a peer's address left there by the round before and gloo's connectFullMesh is
  refused (a peer slower to start than the others: seen under load; pytorch/pytorch#135712).

Usage: python -m dtensor3d.launch.supervise [torchrun options] -m dtensor3d train RECIPE [...]
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import os
import signal
import sys
import threading

# SUPERVISED is set for the workers: errors.write_error_file writes torch's error file
from ..errors import COLLECTIVE_TIMEOUT, RESIZE_CAUSE, SUPERVISED

SIGNALS = {signal.SIGTERM, signal.SIGINT}

DETERMINISTIC = 2  # the exit status of a worker that printed its `error:` line (a UserError)


def worker_pids() -> list[int]:
    """The processes this one started (the agent's workers)."""
    pids = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
            pids += [int(p) for p in f.read().split()]
    return pids


def forward_signals(stopping: threading.Event) -> None:
    """A thread: pass each SIGTERM/SIGINT on to the workers, and the last one to any worker
    started after it (a signal during the rendezvous); the agent keeps waiting for them."""
    last, sent = None, set()
    while True:
        signum = signal.sigtimedwait(SIGNALS, 0.5)
        if signum is not None:
            last, sent = signum.si_signo, set()
            stopping.set()
        for pid in worker_pids() if last else ():
            if pid not in sent:
                sent.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, last)


# ---------------------------------------------------------------- what failed, and first


@dataclasses.dataclass(frozen=True)
class Failure:
    """One rank's failure as the agent saw it."""

    rank: int
    exitcode: int  # negative: killed by that signal
    time: float  # when, as near as known: the worker's own record, else the agent's (whole seconds)
    line: str | None  # the worker's one line (faults.report), if it wrote one
    short: str | None  # the same without torch's text
    printed: bool = False  # the worker printed its `error:` line itself (rank 0, errors.say)

    @property
    def killed(self) -> bool:
        """Killed by a signal other than the agent's own SIGTERM (sent to stop the others)."""
        return self.exitcode < 0 and -self.exitcode != signal.SIGTERM

    @property
    def timed_out(self) -> bool:
        """The worker's own line says a collective did not complete within training.timeout_s."""
        return self.line is not None and COLLECTIVE_TIMEOUT in self.line

    def describe(self) -> str:
        if self.exitcode < 0:
            with contextlib.suppress(ValueError):
                return f"rank {self.rank} was killed by {signal.Signals(-self.exitcode).name}"
            return f"rank {self.rank} was killed by signal {-self.exitcode}"
        return f"rank {self.rank} exited with status {self.exitcode}" + (f": {self.line}" if self.line else "")


def failures_of(result) -> list[Failure]:
    """The failures of one attempt (torch's RunResult), each with the worker's own line."""
    out = []
    for rank, f in result.failures.items():
        record = f.error_file_data.get("dtensor3d") if isinstance(f.error_file_data, dict) else None
        record = record if isinstance(record, dict) else {}
        time = float(record.get("time", f.timestamp))
        said = bool(record.get("printed"))
        out.append(Failure(rank, f.exitcode, time, record.get("line"), record.get("short"), said))
    return out


def first_failure(failures: list[Failure]) -> Failure:
    """The failure that came first. The agent stops the other workers once it sees one
    (SIGTERM, SIGKILL after its shutdown timeout), so their failures follow it. Times known
    only to the second: among failures within a second of the earliest, a rank whose
    collective timed out comes first (the peer it waited for was alive but stuck, and dies,
    by a signal or its own abort on the closed connection, only after), then a rank killed by
    a signal (the peers of a killed rank fail in their next collective)."""
    causes = [f for f in failures if f.exitcode != -signal.SIGTERM] or failures
    earliest = min(f.time for f in causes)
    near = [f for f in causes if f.time <= earliest + 1.0]
    return min(near, key=lambda f: (not f.timed_out, not f.killed, f.time, f.rank))


def summary(failures: list[Failure]) -> str:
    """One attempt's failure in a phrase: the first failure, and for a rank killed by a
    signal (which says nothing itself) what a peer reported, which names the step."""
    first = first_failure(failures)
    text = first.describe()
    if first.line is None:
        said = sorted((f for f in failures if f.line), key=lambda f: (f.time, f.rank))
        if said:
            text += f" (then rank {said[0].rank}: {said[0].short or said[0].line})"
    return text


def final_line(attempts: list[list[Failure]], max_restarts: int, lost: str | None = None) -> str:
    lost = f"{lost}; " if lost else ""
    if len(attempts) == 1:
        return f"error: the job failed: {lost}{summary(attempts[0])}"
    restarts = len(attempts) - 1
    return (
        f"error: the job failed after {restarts} restart(s) (MAX_RESTARTS={max_restarts}); {lost}"
        f"the first failure: {summary(attempts[0])}; the last: {summary(attempts[-1])}"
    )


# ---------------------------------------------------------------- the nodes


def job_recipe(cmd_args: list[str], world_size: int | None = None):
    """The resolved recipe of `... -m dtensor3d train RECIPE [overrides]` (validated by launch.sh);
    `world_size` resolves an elastic recipe's `dp: auto` (every node resolves it alike)."""
    from ..config.load import load_recipe

    i = cmd_args.index("train")
    return load_recipe(cmd_args[i + 1], [a for a in cmd_args[i + 2 :] if not a.startswith("-")], world_size)


def smallest_world(config) -> int:
    return config.min_nodes * config.nproc_per_node


def meet_nodes(args, config, cmd_args: list[str], rdzv):
    """Multi-node: every node joins and compares recipes through the rendezvous store (nodes.py),
    then beats; returns the agent's `watch` (which node was lost), or None for one node."""
    if config.max_nodes <= 1:
        return None
    from datetime import timedelta

    from torch.distributed import TCPStore

    from . import nodes

    recipe = job_recipe(cmd_args, smallest_world(config))
    host, _, port = rdzv.endpoint.rpartition(":")
    timeout = timedelta(seconds=recipe.training.timeout_s)
    store = TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    if config.min_nodes < config.max_nodes:  # elastic: launch/elastic.py
        nodes.meet_elastic(store, args.node_rank, recipe.to_dict(), recipe.training.timeout_s)
    else:
        nodes.meet(store, args.node_rank, config.max_nodes, recipe.to_dict(), recipe.training.timeout_s)
    nodes.Heartbeat(store, args.node_rank)
    return lambda: nodes.lost_nodes(store, config.max_nodes, args.node_rank, rdzv.endpoint)


# ---------------------------------------------------------------- the agent


def stop_for_resize(timeout_s: float) -> None:
    """A node joined an elastic job: ask this node's ranks to save at the step boundary and exit
    (SIGUSR1, training/faults.py), and wait for them, before the agent stops them (SIGTERM)."""
    import time

    pids = worker_pids()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and any(_running(pid) for pid in pids):
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def make_agent(spec, config, stopping: threading.Event, watch=None, resize_timeout_s: float = 60.0):
    """torch's LocalElasticAgent, keeping each attempt's failures and ending the job at a
    deterministic failure (status 2) or after a SIGTERM/SIGINT instead of restarting.
    `watch()`: for a multi-node job, the phrase naming a lost node (nodes.lost_nodes) or None."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(LocalElasticAgent):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attempts: list[list[Failure]] = []
            self.lost: str | None = None  # the last failed attempt's lost node(s), if any
            self.failed = False  # the last check found failed ranks (else a restart is a node joining)

        def _restart_workers(self, worker_group):
            # An elastic job's ranks learn why their world changed (checkpoint/resume.resize_line).
            cause = (self.lost.replace(" was lost", " lost") if self.lost else "") if self.failed else "a node joined"
            os.environ[RESIZE_CAUSE] = cause
            if not self.failed:
                stop_for_resize(resize_timeout_s)
            self.failed = False
            super()._restart_workers(worker_group)

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if not result.is_failed():
                return result
            self.failed = True
            failures = failures_of(result)
            self.attempts.append(failures)
            self.lost = watch() if watch is not None else None
            if first_failure(failures).exitcode == DETERMINISTIC or stopping.is_set():
                self._remaining_restarts = 0  # the agent's own count: 0 makes this attempt the last
            elif self._remaining_restarts > 0:
                n, m = len(self.attempts), spec.max_restarts
                lost = f"{self.lost}; " if self.lost else ""
                print(
                    f"restarting ({n} of MAX_RESTARTS={m}): {lost}{summary(failures)}; every rank restarts "
                    f"from the newest complete checkpoint",
                    file=sys.stderr,
                    flush=True,
                )
            return result

    return Agent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,
    )


def rendezvous_parameters(config, cmd_args: list[str], node_rank: int):
    """torchrun's c10d rendezvous; with several nodes it waits training.timeout_s (torch: 600 s)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    if config.max_nodes > 1:  # node 0 hosts the store at MASTER_ADDR (on one machine too), others wait for it
        seconds = int(max(1, job_recipe(cmd_args, smallest_world(config)).training.timeout_s))
        config.rdzv_configs.update(join_timeout=seconds, read_timeout=seconds)
        if "RDZV_LAST_CALL_S" in os.environ:  # elastic: how long a re-forming rendezvous waits for more nodes
            config.rdzv_configs["last_call_timeout"] = int(os.environ["RDZV_LAST_CALL_S"])
        if "RDZV_KEEP_ALIVE_S" in os.environ:  # a lost node leaves the rendezvous after this silence (torch: 5 s x 3)
            keep_alive = int(os.environ["RDZV_KEEP_ALIVE_S"])  # launch.sh checked it: a positive integer
            config.rdzv_configs.update(keep_alive_interval=1, keep_alive_max_attempt=keep_alive)
        config.rdzv_configs["is_host"] = "1" if node_rank == 0 else "0"
    return RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )


def unreachable(rdzv, what: str) -> str:
    return f"node 0 (the rendezvous host, {rdzv.endpoint}; MASTER_ADDR:MASTER_PORT) {what}"


def failed_first(agent) -> str:
    return f"; {summary(agent.attempts[-1])}" if agent.attempts else ""


def agent_for(spec, config, stopping: threading.Event, args, cmd_args: list[str], rdzv):
    """The agent, after the nodes met (multi-node); a resize waits for the ranks' save."""
    watch = meet_nodes(args, config, cmd_args, rdzv)
    resize_s = job_recipe(cmd_args, smallest_world(config)).checkpoint.preempt_timeout_s + 10 if watch else 60.0
    return make_agent(spec, config, stopping, watch, resize_s)


def launch(args, stopping: threading.Event):
    """torch's launcher.api.launch_agent, less its metrics, events and health-check server:
    run the agent; return it (its `attempts`) and whether the workers succeeded (None: the
    rendezvous was closed, by another node's agent that ended the job)."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry
    from torch.distributed.run import config_from_args

    from .nodes import NodesError

    config, cmd, cmd_args = config_from_args(args)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    rdzv = rendezvous_parameters(config, cmd_args, args.node_rank)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=cmd,
        args=tuple(cmd_args),
        rdzv_handler=None,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
    )
    try:
        handler = rdzv_registry.get_rendezvous_handler(rdzv)
    except RendezvousConnectionError:  # node 0's store never came up
        raise NodesError(unreachable(rdzv, "could not be reached")) from None
    spec = dataclasses.replace(spec, rdzv_handler=handler)
    agent = agent_for(spec, config, stopping, args, cmd_args, rdzv)
    try:
        result = agent.run()  # None: torch's own "graceful exit" of the rendezvous
    except RendezvousClosedError:  # a restart found the rendezvous closed
        result = None
    except RendezvousConnectionError:  # node 0, which hosts the rendezvous store, is gone
        raise NodesError(unreachable(rdzv, "was lost") + failed_first(agent), status=1) from None
    except RendezvousTimeoutError:  # a restart waited training.timeout_s for a node that never came back
        lost = f" ({agent.lost})" if agent.lost else ""
        raise NodesError(
            f"a node did not rejoin within training.timeout_s={rdzv.get('join_timeout')} s{lost}"
            f"{failed_first(agent)}; the newest complete checkpoint is kept: start every node again to resume",
            status=1,
        ) from None
    finally:
        spec.rdzv_handler.shutdown()  # closes the rendezvous: other nodes' agents end too
    return agent, None if result is None else not result.is_failed()


def main(argv: list[str]) -> int:
    # Blocked here, and so in the workers from their first instruction (a blocked mask is
    # inherited): a signal during a worker's start waits until faults.Preemption takes it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {*SIGNALS, signal.SIGUSR1})  # SIGUSR1: see stop_for_resize
    stopping = threading.Event()
    threading.Thread(target=forward_signals, args=(stopping,), name="dtensor3d-signals", daemon=True).start()
    os.environ[SUPERVISED] = "1"
    os.environ["DTENSOR3D_AGENT_PID"] = str(os.getpid())  # nodes.die_with_parent: the workers' parent
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # a fresh store per round: see the docstring
    if "LOGLEVEL" not in os.environ:  # torch's own log lines about each failure: ours replace them
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    from torch.distributed.run import get_args_parser

    if "LOGLEVEL" not in os.environ:  # after its import, which sets its level: "node_rank ... ignored" (c10d)
        logging.getLogger("torch.distributed.run").setLevel(logging.ERROR)

    args = get_args_parser().parse_args(["--signals-to-handle=SIGHUP,SIGQUIT", *argv])  # SIGTERM, SIGINT: ours
    from .nodes import NodesError

    try:
        agent, ok = launch(args, stopping)
    except NodesError as e:  # a node missing at the limit, nodes that disagree (on every node), node 0 lost
        print(
            f"error: {e}" if e.status == DETERMINISTIC else f"error: the job failed: {e}", file=sys.stderr, flush=True
        )
        return e.status
    if ok:
        return 0
    if ok is None:
        print("error: the rendezvous was closed: another node's agent ended the job", file=sys.stderr, flush=True)
        return 1
    first = first_failure(agent.attempts[-1])
    if first.exitcode == DETERMINISTIC:  # rank 0 printed its one `error:` line (errors.say)...
        said = any(f.printed or (f.rank == 0 and f.exitcode == DETERMINISTIC) for f in agent.attempts[-1])
        if first.line and not said:
            print(first.line, file=sys.stderr, flush=True)  # ...unless only another rank saw the error
        return DETERMINISTIC
    print(final_line(agent.attempts, args.max_restarts, agent.lost), file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
