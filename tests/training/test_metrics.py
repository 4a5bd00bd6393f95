"""Metrics: TensorBoard events (read back with tensorboard's EventAccumulator; a resumed run
continues the same curves without duplicate steps), the console's elapsed time and ETA, the
closing summary line, loss.svg with a val_loss line, and a rerun into a used run_dir keeping
the earlier run's files under numbered names (through the command line)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PARITY, ROOT, torchrun

from dtensor3d.config.load import recipe_from_dict
from dtensor3d.config.schema import Recipe
from dtensor3d.training.metrics import MetricsLog, write_loss_svg

EventAccumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator").EventAccumulator


def record(step: int, loss: float, **extra) -> dict:
    base = dict(step=step, loss=loss, grad_norm=0.5, lr=1e-3, tokens_per_sec=1000.0, ms_per_step=10.0)
    return base | dict(peak_mem_gib=0.25, mfu=None) | extra


def recipe(run_dir, steps: int, tensorboard: bool = True, ckpt: str | None = None) -> Recipe:
    raw = {"training": {"steps": steps}, "logging": {"tensorboard": tensorboard, "run_dir": str(run_dir)}}
    return recipe_from_dict(raw | {"checkpoint": {"dir": ckpt}})


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_events_and_a_resume_without_duplicate_steps(tmp_path, capsys):
    log = MetricsLog(recipe(str(tmp_path), 8), enabled=True)
    for s in range(1, 7):  # the first run logs past its step-3 checkpoint, then dies
        log.log(record(s, 10.0 - s, aux_loss=0.01, expert_load_max_over_mean=1.5))
    log.close()
    log = MetricsLog(recipe(str(tmp_path), 8), enabled=True, resume=3)
    for s in range(4, 9):
        log.log(record(s, 100.0 - s, val_loss=50.0 - s, aux_loss=0.02, expert_load_max_over_mean=1.25))
    log.close()
    loss = scalars(tmp_path, "loss/train")
    assert [s for s, _ in loss] == list(range(1, 9))
    assert [v for _, v in loss] == [9.0, 8.0, 7.0, 96.0, 95.0, 94.0, 93.0, 92.0]
    assert scalars(tmp_path, "loss/val") == [(s, 50.0 - s) for s in range(4, 9)]
    assert [s for s, _ in scalars(tmp_path, "moe/expert_load_max_over_mean")] == list(range(1, 9))
    for tag in ("optim/lr", "optim/grad_norm", "perf/tokens_per_sec", "memory/peak_gib", "moe/aux_loss"):
        assert len(scalars(tmp_path, tag)) == 8, tag
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 9))
    assert not list(tmp_path.glob("metrics.*.jsonl"))  # a resume rotates nothing


def test_console_elapsed_eta_and_the_summary_line(tmp_path, capsys):
    ckpt = tmp_path / "ck"
    (ckpt / "step_00000004").mkdir(parents=True)
    (ckpt / "latest").write_text("step_00000004\n")
    log = MetricsLog(recipe(str(tmp_path / "run"), 10, ckpt=str(ckpt)), enabled=True, resume=2)
    log.start -= 30.0  # 30 s spent on steps 3 and 4: 15 s a step, 6 steps to go
    log.log(record(4, 2.0))
    log.close()
    out = capsys.readouterr().out.splitlines()
    assert re.search(r"\| elapsed 0:00:3\d eta 0:01:3\d$", out[0]), out[0]
    run = tmp_path / "run"
    assert out[1] == (
        f"done: metrics {run / 'metrics.jsonl'} | loss curve {run / 'loss.svg'} | "
        f"tensorboard {run / 'tensorboard'} (tensorboard --logdir {run}) | last checkpoint {ckpt / 'step_00000004'}"
    )
    log = MetricsLog(recipe(str(tmp_path / "other"), 10, tensorboard=False), enabled=True)
    log.close(checkpoint="/ck/step_00000010")
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"done: metrics {tmp_path / 'other' / 'metrics.jsonl'} | loss curve none (nothing logged) | "
        "last checkpoint /ck/step_00000010"
    )


def test_loss_svg_draws_val_loss_when_records_carry_it(tmp_path):
    write_loss_svg(str(tmp_path / "a.svg"), [(1, 3.0), (2, 2.0), (3, 1.0)])
    write_loss_svg(str(tmp_path / "b.svg"), [(1, 3.0), (2, 2.0), (3, 1.0)], [(2, 2.5), (3, 1.5)])
    a, b = (tmp_path / "a.svg").read_text(), (tmp_path / "b.svg").read_text()
    assert a.count("<polyline") == 1 and "val_loss" not in a
    assert b.count("<polyline") == 2 and ">val_loss</text>" in b


def train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "dtensor3d", "train", PARITY, f"logging.run_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_rerun_into_a_used_run_dir_keeps_the_earlier_metrics(tmp_path):
    run = tmp_path / "run"
    small = ("training.steps=2", "model.num_hidden_layers=1", "logging.tensorboard=true", "checkpoint.resume=none")
    first = train(run, *small)
    assert "held an earlier run" not in first.stdout
    earlier = (run / "metrics.jsonl").read_text()
    second = train(run, *small, "optimizer.lr=0.002")
    notes = [line for line in second.stdout.splitlines() if "held an earlier run" in line]
    assert notes == [
        f"{run} held an earlier run's metrics (this run is not a resume): kept them as "
        "metrics.1.jsonl, recipe.1.yaml, loss.1.svg, tensorboard.1"
    ]
    assert (run / "metrics.1.jsonl").read_text() == earlier
    lr = lambda text: [json.loads(line)["lr"] for line in text.splitlines()]  # noqa: E731
    assert lr((run / "metrics.jsonl").read_text()) == [2 * x for x in lr(earlier)]  # the new run's, lr doubled
    assert [s for s, _ in scalars(run, "loss/train")] == [1, 2]  # the new curve alone
    assert second.stdout.splitlines()[-1].startswith(f"done: metrics {run / 'metrics.jsonl'}")


def test_resumed_training_continues_the_tensorboard_curve(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ck"
    small = ("model.num_hidden_layers=1", "logging.tensorboard=true", f"checkpoint.dir={ckpt}", "checkpoint.interval=2")
    train(run, *small, "training.steps=3")  # checkpoints at 2 and 3; logs 1, 2, 3
    proc = train(run, *small, "training.steps=5", f"checkpoint.resume={ckpt / 'step_00000002'}")
    assert "held an earlier run" not in proc.stdout
    steps = [s for s, _ in scalars(run, "loss/train")]
    assert steps == [1, 2, 3, 4, 5]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [v for _, v in scalars(run, "loss/train")] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert proc.stdout.splitlines()[-1].endswith(f"last checkpoint {ckpt / 'step_00000005'}")


def test_profile_steps_trace_holds_the_steps_matmuls_and_collectives(tmp_path, monkeypatch):
    """tp=2 x dp=1 on 2 ranks, steps 2..3 of 4 profiled: each rank's Chrome trace holds two
    train_step spans, matmuls and collectives (through `train`, the real loop). The same run
    makes rank 1 a straggler (DTENSOR3D_SLOW_RANK: it sleeps 8x its step's time after each
    step): the records name it the slowest and one warning line names it."""
    overrides = ["training.steps=4", "model.num_hidden_layers=1", "parallelism.tp=2", "logging.profile_steps=[2, 3]"]
    overrides += ["logging.straggler_ratio=1.5", "logging.straggler_steps=3"]
    monkeypatch.setenv("DTENSOR3D_SLOW_RANK", "1:8")
    proc = torchrun(2, ["-m", "dtensor3d", "train", PARITY, f"logging.run_dir={tmp_path}", *overrides])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["slowest_rank"] for r in records] == [1, 1, 1, 1], records
    warnings = [line for line in proc.stdout.splitlines() if "is a straggler" in line]
    assert len(warnings) == 1 and "step 3: rank 1 is a straggler" in warnings[0], proc.stdout[-3000:]
    for rank in (0, 1):
        events = json.loads((tmp_path / "profile" / f"trace_rank{rank}.json").read_text())["traceEvents"]
        names = [e.get("name", "") for e in events]
        assert sorted(n for n in names if n.startswith("train_step ")) == ["train_step 2", "train_step 3"]
        assert any(n in ("aten::mm", "aten::addmm", "aten::matmul", "aten::bmm") for n in names)
        collectives = [n for n in names if re.search(r"all_?reduce|all_?gather|reduce_?scatter", n, re.I)]
        assert collectives, sorted(set(names))[:80]


def test_expert_load_per_layer_on_tensorboard_and_the_warning(tmp_path):
    """The step's summed stats [aux, loads of 2 MoE layers x 4 experts] become the worst
    layer's max/mean, each layer's (TensorBoard: one curve per layer), each layer's loads
    with balancing on; a layer above logging.expert_load_warn for expert_load_warn_steps
    consecutive steps gives one warning line, once per streak."""
    import torch

    from dtensor3d.training.balance import load_warning, stats_metrics

    raw = {
        "model": {"num_local_experts": 4, "num_hidden_layers": 2, "router_bias_update_rate": 0.5},
        "logging": {"expert_load_warn": 2.0, "expert_load_warn_steps": 3},
    }
    r = recipe_from_dict(raw)
    stats = torch.tensor([0.25, 10.0, 10.0, 10.0, 10.0, 40.0, 0.0, 0.0, 0.0])
    m = stats_metrics(stats, r)
    assert m["expert_load_by_layer"] == [1.0, 4.0] and m["expert_load_max_over_mean"] == 4.0
    assert m["tokens_per_expert"] == [50, 10, 10, 10] and m["aux_loss"] == 0.25
    assert m["tokens_per_expert_by_layer"] == [[10, 10, 10, 10], [40, 0, 0, 0]]
    streaks: dict[int, int] = {}
    lines = [load_warning(streaks, by_layer, r) for by_layer in ([1.0, 4.0],) * 4 + ([1.0, 1.5], [1.0, 3.0])]
    assert lines[:2] == [None, None] and lines[3:] == [None, None, None]
    assert lines[2] == (
        "warning: expert load max/mean above 2 for 3 steps in MoE layer(s) 1 (4.00): the router may be collapsing"
    )
    log = MetricsLog(recipe(str(tmp_path), 2), enabled=True)
    for s in (1, 2):
        log.log(record(s, 1.0, **m, router_bias_range=[[-0.5, 0.5], [-1.0, 0.5]]))
    log.close()
    assert [v for _, v in scalars(tmp_path, "moe/expert_load_max_over_mean/1")] == [4.0, 4.0]
    assert [v for _, v in scalars(tmp_path, "moe/router_bias_min/1")] == [-1.0, -1.0]
