"""Issue 37 items 4 and 5, in this process on a 1-rank gloo group (the trainer's own setup and
train_step on the parity model, no torchrun): the z-loss (training.z_loss) equals plain
PyTorch on the model's logits, and a step that spikes (training.skip_spikes) is not applied,
its lr schedule held, so the run equals one whose data never held that batch, and a run
resumed before it keeps the window and skips it too. (tp 2 and cp 2:
tests/dist_scripts/z_loss_tp.py.)"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import PARITY, one_rank_group, torchrun

from dtensor3d.checkpoint.background import Saver
from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.sources import make_source
from dtensor3d.parallel.data import IGNORE
from dtensor3d.training import skip
from dtensor3d.training.train import rank_batch, setup, train_step

SMALL = ["model.num_hidden_layers=1", "training.eval_every=0", "training.micro_batch_size=2"]


@pytest.fixture(scope="module")
def one_rank():
    """A 1-process gloo group for the module (the env torch reads, restored after)."""
    with one_rank_group():
        yield


def test_z_loss_equals_plain_pytorch_on_the_logits(one_rank):
    coef = 1e-2
    recipe = load_recipe(PARITY, [*SMALL, f"training.z_loss={coef}", "training.steps=2"])
    state = setup(recipe)
    inputs, targets = rank_batch(state, make_source(recipe), 0)
    targets = targets.clone()
    targets[:, :7] = IGNORE  # a loss mask: both losses are means over the counted targets
    counted = targets != IGNORE
    with torch.no_grad():
        logits = state.model(inputs).double()
    plain_z = coef * (torch.logsumexp(logits, -1)[counted] ** 2).mean().item()
    plain_ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE).item()
    metrics = train_step(state, (inputs, targets), loss_tokens=int(counted.sum()))
    assert abs(metrics["z_loss"] - plain_z) <= 1e-6 * plain_z, (metrics["z_loss"], plain_z)
    assert abs(metrics["loss"] - plain_ce) <= 1e-6 * plain_ce, (metrics["loss"], plain_ce)  # `loss`: the CE alone


def spike_batch(batch: tuple) -> tuple:
    """A crafted sample: every input and target one token (its gradient adds up coherently:
    a grad norm ~20x the random windows')."""
    inputs, targets = batch
    return torch.full_like(inputs, 7), torch.full_like(targets, 7)


def params(state) -> dict[str, torch.Tensor]:
    return {n: q.detach().clone() for n, q in state.model.named_parameters()}


def test_a_spiking_step_is_skipped_and_leaves_no_trace(one_rank, tmp_path):
    """Batches b0 b1 b2 SPIKE b3 under a linear decay (each step its own lr): the spike is
    skipped with the schedule held, so the weights equal the run fed b0 b1 b2 b3 (bitwise);
    a run resumed from step 3 keeps the window (an empty one would not skip) and ends equal."""
    spikes = ["training.skip_spikes={window: 2, sigma: 6.0}", "optimizer.warmup_steps=0", "optimizer.decay=linear"]
    ckpt = [f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.async_save=false", "training.steps=6"]
    recipe = load_recipe(PARITY, [*SMALL, *spikes, *ckpt, "checkpoint.resume=none"])
    state = setup(recipe)
    source = make_source(recipe)
    batches = [rank_batch(state, source, i) for i in range(4)]
    fed = [batches[0], batches[1], batches[2], spike_batch(batches[3]), batches[3]]
    got = []
    for i, batch in enumerate(fed):
        got.append(train_step(state, batch))
        if i == 2:
            Saver(state).save(state)
    assert [m.get("skip_reason") for m in got] == [None, None, None, skip.GRAD_NORM_SPIKE, None], got
    assert got[3]["skipped"] is True and got[3]["grad_norm"] > 10 * got[2]["grad_norm"]
    assert got[4]["lr"] == got[3]["lr"] < got[2]["lr"]  # held: the step after the spike runs at its lr
    assert state.held_steps == 1 and list(state.spikes.grad_norms) == [got[2]["grad_norm"], got[4]["grad_norm"]]
    counter = skip.SkippedSteps()
    for m in got:
        counter.count(m)
    line = counter.warning()  # the run's closing line
    assert line.startswith("warning: 1 of 5 steps (20.0%) had a grad-norm spike and were skipped"), line
    assert "(steps 4)" in line and "the lr schedule held" in line, line

    never = setup(recipe)  # the run whose data never held the spike
    clean = [train_step(never, b) for b in batches]
    assert [m["lr"] for m in clean] == [got[i]["lr"] for i in (0, 1, 2, 4)]
    assert all(torch.equal(a, b) for a, b in zip(params(state).values(), params(never).values()))

    resumed = setup(load_recipe(PARITY, [*SMALL, *spikes, *ckpt]))  # checkpoint.resume: auto
    assert resumed.step == 3 and list(resumed.spikes.grad_norms) == [got[1]["grad_norm"], got[2]["grad_norm"]]
    after = [train_step(resumed, b) for b in fed[3:]]
    assert [m.get("skip_reason") for m in after] == [skip.GRAD_NORM_SPIKE, None]
    assert [m["loss"] for m in after] == [m["loss"] for m in got[3:]]
    assert all(torch.equal(a, b) for a, b in zip(params(state).values(), params(resumed).values()))


def test_z_loss_at_tp2_and_cp2_equals_plain_pytorch():
    """tests/dist_scripts/z_loss_tp.py on 2 ranks: tp 2, logits sharded on the vocabulary and
    never gathered; cp 2, each rank's half of the sequence; the value and the logits' gradient
    against plain PyTorch on the whole logits."""
    out = json.loads(torchrun(2, ["tests/dist_scripts/z_loss_tp.py"]).stdout.strip().splitlines()[-1])
    assert out["z_rel"] <= 1e-6 and out["total_rel"] <= 1e-6 and out["cp_z_rel"] <= 1e-6, out
    assert max(out["grad_max_abs"], out["cp_grad_max_abs"]) <= 1e-6 * out["grad_scale"], out
