"""MFU without a GPU: the arithmetic (training/metrics.py `mfu`), the peak looked up by a GPU's
device name in plan's table, and the line `bench/throughput.py --device cuda` prints, given a
peak figure (an arbitrary one: no GPU here, and no GPU figure is written)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dtensor3d.config.load import recipe_from_dict
from dtensor3d.plan.report import GPUS
from dtensor3d.training.metrics import flops_per_token, mfu, peak_flops, peak_flops_of

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import throughput  # noqa: E402


def test_mfu_arithmetic_and_the_peak_table():
    """1,000 tokens/s x 6e6 FLOPs per token on 2 devices of 1e12 FLOP/s: 0.3% (by hand); no peak, no MFU."""
    assert mfu(1000.0, 6e6, 1e12, 2) == pytest.approx(0.003)
    assert mfu(1000.0, 6e6, None, 2) is None
    for gpu, tflops in GPUS.items():
        assert peak_flops_of(f"NVIDIA {gpu} 80GB HBM3") == tflops * 1e12, gpu
    assert peak_flops_of("a GPU the table does not list") is None
    assert peak_flops(torch.device("cpu")) is None


def test_bench_throughput_prints_mfu_on_cuda(tmp_path):
    """report(): on CUDA the MFU of the variant's tokens/s against the given peak, or 'n/a'
    for a GPU the table lacks; on CPU no MFU."""
    raw = {k: dict(v) for k, v in throughput.BENCH.items()} | {"logging": {"run_dir": str(tmp_path)}}
    recipe = recipe_from_dict(raw)
    t = recipe.training
    tokens_per_sec = t.global_batch_size * t.sequence_length / 0.5
    expected = mfu(tokens_per_sec, flops_per_token(recipe.model, t.sequence_length), 1e12, 1)
    line = throughput.report("eager fp32", {"step_s": 0.5}, recipe, "cuda", 1e12)
    assert f"MFU {100 * expected:5.1f}%" in line, line
    assert "MFU n/a" in throughput.report("eager fp32", {"step_s": 0.5}, recipe, "cuda", None)
    assert "MFU" not in throughput.report("eager fp32", {"step_s": 0.5}, recipe, "cpu", None)


def test_straggler_named_once_after_its_streak():
    """logging.straggler_ratio=2, straggler_steps=3: rank 2 at 3.5x the median for 3 steps in a
    row gets one warning line at the third (not before, not again while the streak goes on);
    a step back under the ratio restarts the count; ratio 0 never warns."""
    from dtensor3d.training.metrics import Stragglers

    watch, slow, even = Stragglers(2.0, 3), [0.1, 0.1, 0.35, 0.1], [0.1, 0.1, 0.1, 0.1]
    lines = [watch.see(step, times) for step, times in enumerate([slow, slow, slow, slow, even, slow], start=1)]
    assert [len(x) for x in lines] == [0, 0, 1, 0, 0, 0]
    assert "step 3: rank 2 is a straggler: 350.0 ms per step" in lines[2][0] and "median 100.0 ms" in lines[2][0]
    assert lines[2][0].startswith("warning:")
    assert Stragglers(0.0, 1).see(1, slow) == []


def test_tflops_and_step_times_in_the_records(parity_reference):
    """The 1-process parity run: tflops = plan's FLOPs per token x tokens/s (1 rank), mfu null on
    CPU without logging.peak_tflops, and one rank's step time is max, min and its ms_per_step."""
    from helpers import PARITY

    from dtensor3d.config.load import load_recipe

    recipe = load_recipe(PARITY)
    per_token = flops_per_token(recipe.model, recipe.training.sequence_length)
    for r in parity_reference:
        assert r["tflops"] == pytest.approx(r["tokens_per_sec"] * per_token / 1e12, rel=1e-12)
        assert r["mfu"] is None
        assert r["step_ms_max"] == r["step_ms_min"] == r["ms_per_step"] and r["slowest_rank"] == 0


def test_mfu_is_tflops_over_the_given_peak(reference, parity_reference):
    """logging.peak_tflops on CPU: mfu = tflops / peak in every record; the losses are the run's
    without it (the all-gather of step times and the straggler watch change nothing)."""
    records = reference(["logging.peak_tflops=0.001", "logging.straggler_ratio=1000"])
    for r, base in zip(records, parity_reference, strict=True):
        assert r["mfu"] == pytest.approx(r["tflops"] / 0.001, rel=1e-12)
        assert r["loss"] == base["loss"]
