"""Metrics: a console line and a metrics.jsonl record per logged step, a loss-curve SVG at
the end, and the FLOP / memory arithmetic behind tokens/s, MFU and peak memory."""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import sys
import time

import torch
import yaml

from ..config.schema import Recipe
from ..plan.report import GPUS
from ..plan.shapes import flops_per_token  # noqa: F401  (torch-free, for plan; re-exported


def peak_flops(device: torch.device) -> float | None:
    """This device's peak FLOP/s: a CUDA device's from its name; None on CPU."""
    return peak_flops_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_flops_of(gpu_name: str) -> float | None:
    """A GPU's dense bf16 peak FLOP/s from its device name, by plan's table (None: not listed)."""
    return next((tflops * 1e12 for gpu, tflops in GPUS.items() if gpu in gpu_name), None)


def mfu(tokens_per_sec: float, token_flops: float, peak: float | None, ranks: int) -> float | None:
    """Model FLOPs utilisation: the model's FLOP/s over the peak of `ranks` devices (None
    without a peak: CPU, or a GPU plan's table does not list)."""
    return tokens_per_sec * token_flops / (peak * ranks) if peak else None


def step_times(seconds: float, device: torch.device) -> list[float]:
    """Every rank's train-step seconds, by rank: one all-gather of one number (every rank calls it)."""
    import torch.distributed as dist

    mine = torch.tensor([seconds], dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [float(t) for t in parts]


def straggle(seconds: float) -> float:
    """DTENSOR3D_SLOW_RANK=R:F, a test hook for the straggler warning: rank R sleeps F x its
    train step's time after each step (after the step's last collective, so the other ranks do
    not wait inside theirs); returns the step's seconds with the sleep. Unset: `seconds`."""
    spec = os.environ.get("DTENSOR3D_SLOW_RANK")
    if not spec or int(spec.split(":")[0]) != int(os.environ.get("RANK", "0")):
        return seconds
    start = time.perf_counter()
    time.sleep(float(spec.split(":")[1]) * seconds)
    return seconds + time.perf_counter() - start


class Stragglers:
    """logging.straggler_ratio / straggler_steps: a rank whose step takes more than ratio x the
    median of the ranks' for `steps` steps in a row gets one warning line (ratio 0: never)."""

    def __init__(self, ratio: float, steps: int):
        self.ratio, self.steps, self.streak = ratio, steps, {}

    def see(self, step: int, times: list[float]) -> list[str]:
        """The warning lines this step's times (by rank) complete."""
        if not self.ratio:
            return []
        median = statistics.median(times)
        slow = [r for r, t in enumerate(times) if t > self.ratio * median]
        self.streak = {r: self.streak.get(r, 0) + 1 for r in slow}
        return [
            f"warning: step {step}: rank {r} is a straggler: {1000 * times[r]:.1f} ms per step, over "
            f"logging.straggler_ratio={self.ratio} x the ranks' median {1000 * median:.1f} ms for {self.steps} steps"
            for r in slow
            if self.streak[r] == self.steps
        ]


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (peak RSS)


# The metrics written to TensorBoard: record key -> tag.
TB_TAGS = {
    "loss": "loss/train",
    "val_loss": "loss/val",
    "val_ppl": "loss/val_ppl",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "tokens_per_sec": "perf/tokens_per_sec",
    "ms_per_step": "perf/ms_per_step",
    "mfu": "perf/mfu",
    "tflops": "perf/tflops",
    "step_ms_max": "perf/step_ms_max",
    "step_ms_min": "perf/step_ms_min",
    "peak_mem_gib": "memory/peak_gib",
    "aux_loss": "moe/aux_loss",
    "expert_load_max_over_mean": "moe/expert_load_max_over_mean",
}


def tb_scalars(record: dict) -> list[tuple[str, float]]:
    """The record's (tag, value) pairs for TensorBoard and W&B: TB_TAGS, a mixture's `loss/<name>`,
    downstream evaluation's `eval/<task>/<metric>` and the MoE layers' scalars."""
    extra = {key: key for key in record if key.startswith(("loss/", "eval/"))}
    out = []
    for key, tag in {**TB_TAGS, **extra}.items():
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((tag, value))
    return out + _layer_scalars(record)


def _layer_scalars(record: dict) -> list[tuple[str, float]]:
    """Per MoE layer (in order of the layers with experts): its max/mean load and, when
    balancing, its correction bias's min and max, as TensorBoard (tag, value) pairs."""
    out = [(f"moe/expert_load_max_over_mean/{i}", v) for i, v in enumerate(record.get("expert_load_by_layer", ()))]
    for i, (lo, hi) in enumerate(record.get("router_bias_range", ())):
        out += [(f"moe/router_bias_min/{i}", lo), (f"moe/router_bias_max/{i}", hi)]
    return out


# What a fresh run into a run_dir moves aside: (name, rotated name with {n}).
ROTATED = (
    ("metrics.jsonl", "metrics.{n}.jsonl"),
    ("recipe.yaml", "recipe.{n}.yaml"),
    ("loss.svg", "loss.{n}.svg"),
    ("tensorboard", "tensorboard.{n}"),
)


def rotate_previous(run_dir: str) -> str | None:
    """A fresh run into a run_dir that holds metrics.jsonl: move the earlier run's files to
    numbered names (metrics.1.jsonl, ...; the highest number is the newest); return the line
    that says so, or None when there was nothing to keep."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return None
    taken = [re.fullmatch(r"metrics\.(\d+)\.jsonl", name) for name in os.listdir(run_dir)]
    n = 1 + max((int(m.group(1)) for m in taken if m), default=0)
    moved = []
    for name, pattern in ROTATED:
        if os.path.exists(os.path.join(run_dir, name)):
            os.replace(os.path.join(run_dir, name), os.path.join(run_dir, pattern.format(n=n)))
            moved.append(pattern.format(n=n))
    return f"{run_dir} held an earlier run's metrics (this run is not a resume): kept them as {', '.join(moved)}"


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def console_line(record: dict, elapsed: float, eta: float | None) -> str:
    parts = [
        f"step {record['step']:>5}",
        f"loss {record['loss']:.4f}",
        f"grad_norm {record['grad_norm']:.3f}",
        f"lr {record['lr']:.2e}",
        f"tok/s {record['tokens_per_sec']:,.0f}",
        f"{record['ms_per_step']:.0f} ms",
        f"mem {record['peak_mem_gib']:.2f} GiB",
    ]
    if record.get("val_loss") is not None:
        parts.insert(2, f"val_loss {record['val_loss']:.4f}")
    if "aux_loss" in record:
        parts.append(f"aux {record['aux_loss']:.4f} | expert load max/mean {record['expert_load_max_over_mean']:.2f}")
    if record.get("skipped"):
        parts.insert(1, f"skipped ({record['skip_reason']}: no optimizer step)")
    if record.get("tflops") is not None:
        parts.append(f"tflops {record['tflops']:.3g}")
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    if record.get("step_ms_max", 0) > record.get("step_ms_min", 0):  # more than one rank
        low, high = record["step_ms_min"], record["step_ms_max"]
        parts.append(f"rank ms {low:.0f}-{high:.0f} (slowest {record['slowest_rank']})")
    parts.append(f"elapsed {_hms(elapsed)}" + (f" eta {_hms(eta)}" if eta is not None else ""))
    return " | ".join(parts)


class MetricsLog:
    """Writes <run_dir>/metrics.jsonl, <run_dir>/recipe.yaml, loss.svg at the end and, with
    logging.tensorboard, TensorBoard events in <run_dir>/tensorboard; only rank 0 writes.

    `resume`: the step a resumed run continues from (0: a fresh run). The file's earlier
    records up to that step are kept and new ones appended; later ones (from a run that
    went past the checkpoint) are dropped, so each step appears once; TensorBoard hides them
    the same way (purge_step). A fresh run into a run_dir holding metrics.jsonl keeps the
    earlier run's files under numbered names (`rotate_previous`)."""

    def __init__(self, recipe: Recipe, enabled: bool, resume: int = 0, wandb_id: str | None = None):
        run_dir = recipe.logging.run_dir
        self.enabled, self.run_dir, self.records, self.earlier = enabled, run_dir, [], []
        self.resume, self.start, self.writer, self.wandb = resume, time.perf_counter(), None, None
        self.total_steps, self.checkpoint_dir = recipe.training.steps, recipe.checkpoint.dir
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "metrics.jsonl")
        note = None if resume else rotate_previous(run_dir)
        if note:
            print(note, flush=True)
        with open(os.path.join(run_dir, "recipe.yaml"), "w") as f:
            yaml.safe_dump(recipe.to_dict(), f, sort_keys=False)
        if resume and os.path.exists(path):
            with open(path) as f:
                self.earlier = [r for r in map(json.loads, f) if r["step"] <= resume]
        self.file = open(path, "w")
        for record in self.earlier:
            self.file.write(json.dumps(record) + "\n")
        if recipe.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the earlier events at and after the resumed step.
            tb_dir = os.path.join(run_dir, "tensorboard")
            self.writer = SummaryWriter(tb_dir, purge_step=resume + 1 if resume else None, flush_secs=10)
        if recipe.logging.wandb is not None:
            from .wandb_log import WandbRun

            self.wandb = WandbRun(recipe, wandb_id)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        scalars = tb_scalars(record)
        if self.writer is not None:
            for tag, value in scalars:
                self.writer.add_scalar(tag, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, record["step"])
        elapsed, done = time.perf_counter() - self.start, record["step"] - self.resume
        eta = None
        if self.total_steps is not None and done > 0:
            eta = elapsed / done * max(0, self.total_steps - record["step"])
        print(console_line(record, elapsed, eta), file=sys.stdout, flush=True)

    def close(self, checkpoint: str | None = None, announce: bool = True) -> None:
        """Write loss.svg, close the files and (`announce`) print one line saying where everything
        is. `checkpoint`: the last checkpoint saved (default: the one checkpoint.dir's pointer names)."""
        if not self.enabled:
            return
        self.file.close()
        if self.writer is not None:
            self.writer.close()
        records = self.earlier + self.records
        points = [(r["step"], r["loss"]) for r in records if not r.get("skipped")]  # a skipped step's 0 is no loss
        val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
        evals: dict[str, list] = {}
        for r in records:
            for key, value in r.items():
                if key.startswith("eval/") and isinstance(value, (int, float)):
                    evals.setdefault(key, []).append((r["step"], value))
        if points or val:
            write_loss_svg(os.path.join(self.run_dir, "loss.svg"), points, val, eval_series=evals)
        if self.wandb is not None:
            self.wandb.finish(os.path.join(self.run_dir, "loss.svg"))
        if announce:
            self.done(checkpoint)

    def done(self, checkpoint: str | None = None) -> None:
        """The `done:` line (only for a job every rank finished: the trainer calls it last)."""
        if self.enabled:
            print(self.summary(checkpoint if checkpoint is not None else self._latest_checkpoint()), flush=True)

    def summary(self, checkpoint: str | None) -> str:
        def where(name: str) -> str | None:
            path = os.path.join(self.run_dir, name)
            return path if os.path.exists(path) else None

        parts = [f"metrics {where('metrics.jsonl')}"]
        parts.append(f"loss curve {where('loss.svg') or 'none (nothing logged)'}")
        if self.writer is not None:
            parts.append(f"tensorboard {where('tensorboard')} (tensorboard --logdir {self.run_dir})")
        parts.append(f"last checkpoint {checkpoint or 'none'}")
        return "done: " + " | ".join(parts)

    def _latest_checkpoint(self) -> str | None:
        """The step directory named by checkpoint.dir's `latest` pointer, if there is one."""
        if not self.checkpoint_dir:
            return None
        try:
            with open(os.path.join(self.checkpoint_dir, "latest"), encoding="utf-8") as f:
                name = f.read().strip()
        except OSError:
            return None
        path = os.path.join(self.checkpoint_dir, name)
        return path if name and os.path.isdir(path) else None


COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def write_loss_svg(
    path: str,
    points: list[tuple[int, float]],
    val_points: list[tuple[int, float]] = (),
    width: int = 640,
    height: int = 360,
    eval_series: dict[str, list[tuple[int, float]]] | None = None,
) -> None:
    """A dependency-free line chart of loss (and val_loss, when given) against step; with
    `eval_series` (in-loop downstream metrics, `eval/<task>/<metric>`), a second panel of them below."""
    curves = [("loss", points)] + ([("val_loss", list(val_points))] if val_points else [])
    body = _chart(curves, width, height, 0, "loss")
    total = height
    if eval_series:
        body += "\n" + _chart(sorted(eval_series.items()), width, height, height, "eval")
        total += height
    svg = f"""<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total}" \
font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
{body}
</svg>
"""
    with open(path, "w") as f:
        f.write(svg)


def _chart(curves: list[tuple[str, list]], width: int, height: int, top: int, label: str) -> str:
    """One panel (axes, curves, legend) whose top edge is at y = top."""
    pad = 48
    every = [p for _, pts in curves for p in pts]
    xs, ys = [p[0] for p in every], [p[1] for p in every]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = min(ys), max(max(ys), min(ys) + 1e-9)
    sx = lambda x: pad + (x - x0) / (x1 - x0) * (width - 2 * pad)  # noqa: E731
    sy = lambda y: top + height - pad - (y - y0) / (y1 - y0) * (height - 2 * pad)  # noqa: E731
    out = [
        f'<line x1="{pad}" y1="{top + height - pad}" x2="{width - pad}" y2="{top + height - pad}" stroke="black"/>',
        f'<line x1="{pad}" y1="{top + pad}" x2="{pad}" y2="{top + height - pad}" stroke="black"/>',
        f'<text x="{width / 2}" y="{top + height - 12}" text-anchor="middle">step</text>',
        f'<text x="14" y="{top + height / 2}" transform="rotate(-90 14 {top + height / 2})" '
        f'text-anchor="middle">{label}</text>',
        f'<text x="{pad - 4}" y="{top + pad + 4}" text-anchor="end">{y1:.3f}</text>',
        f'<text x="{pad - 4}" y="{top + height - pad}" text-anchor="end">{y0:.3f}</text>',
        f'<text x="{pad}" y="{top + height - pad + 16}" text-anchor="middle">{x0}</text>',
        f'<text x="{width - pad}" y="{top + height - pad + 16}" text-anchor="middle">{x1}</text>',
    ]
    for k, (name, pts) in enumerate(curves):
        color, line = COLORS[k % len(COLORS)], " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{line}"/>')
        out.append(
            f'<text x="{width - pad}" y="{top + pad - 20 + 14 * k}" text-anchor="end" fill="{color}">{name}</text>'
        )
    return "\n".join(out)
