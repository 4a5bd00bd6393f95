"""Checkpoints: exact resume (bitwise, 1 process and dp2 x tp2 x pp2), resume on other meshes
(1 -> tp2 x pp2, dp2 x tp2 x pp2 -> 1, FSDP -> replicate; within 1e-5 of the uninterrupted
run), atomic writes, keep and the pointer, a planted pickle never executed, bad checkpoints
refused with one error line and nothing overwritten, Hugging Face export / import / init
against transformers' own LlamaForCausalLM (logits within 1e-5, fp32; measured 0.0)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import (
    MESH_822,
    PARITY,
    QWEN2_DP2_TP2,
    ROOT,
    SAVES_AT_3_AND_6,
    SAVES_AT_5_AND_10,
    TINY_HF_LLAMA,
    assert_parity,
    clean_env,
    cli,
    cli_process,
    one_error_line,
    scheduled_lr,
    scheduled_lrs,
    short,
    train_metrics,
    tree_digest,
)
from safetensors.torch import load_file

from dtensor3d import checkpoint as ck
from dtensor3d.__main__ import main
from dtensor3d.checkpoint import load_model
from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.sources import make_source
from dtensor3d.errors import CheckpointError
from dtensor3d.parallel.data import local_batch

TOL = 1e-5


# ---------------------------------------------------------------- helpers


def steps_of(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.iterdir() if p.name.startswith("step_"))


def assert_close_run(got: list[dict], ref: list[dict]) -> None:
    """Same steps; loss and grad_norm within TOL relative; the same LR."""
    assert [r["step"] for r in got] == [r["step"] for r in ref] and got
    for g, r in zip(got, ref):
        for key in ("loss", "grad_norm"):
            rel = abs(g[key] - r[key]) / abs(r[key])
            assert rel <= TOL, f"step {r['step']} {key}: {g[key]!r} vs uninterrupted {r[key]!r} (rel {rel:.2e})"
        assert g["lr"] == r["lr"]


def assert_bitwise_run(got: list[dict], ref: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref] and got
    for g, r in zip(got, ref):
        assert (g["loss"], g["grad_norm"], g["lr"]) == (r["loss"], r["grad_norm"], r["lr"]), (g, r)


def tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(step_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def batch_tokens(seed_batch: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed_batch))


# ---------------------------------------------------------------- runs shared by the tests


@pytest.fixture(scope="module")
def run_one(tmp_path_factory):
    """1 process, 10 steps, a checkpoint after every step, keep 6."""
    root = tmp_path_factory.mktemp("one")
    records = train_metrics(
        root / "run", 1, [f"checkpoint.dir={root / 'ck'}", "checkpoint.interval=1", "checkpoint.keep=6"]
    )
    return records, root


@pytest.fixture(scope="module")
def run_822(shared_run):
    """dp2 x tp2 x pp2 (FSDP2 + TP + 1F1B), 10 steps, checkpoints at 5 and 10: the run of
    test_parity[dp2_tp2_pp2] (conftest.shared_run; it also writes the layout files)."""
    return shared_run(8, MESH_822 + ["logging.layout=true", *SAVES_AT_5_AND_10])


# ---------------------------------------------------------------- saving, exact resume


def test_saving_leaves_training_unchanged(run_one, parity_reference):
    records, _ = run_one
    assert_bitwise_run(records, parity_reference)


def test_keep_pointer_and_layout(run_one):
    _, root = run_one
    ckpt = root / "ck"
    assert steps_of(ckpt) == [f"step_{s:08d}" for s in range(5, 11)]
    assert (ckpt / "latest").read_text().strip() == "step_00000010"
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]
    step = ckpt / "step_00000010"
    assert sorted(p.name for p in step.iterdir()) == [
        "manifest.json",
        "model-stage00.safetensors",
        "optim-stage00.safetensors",
        "state.json",
    ]
    manifest = json.loads((step / "manifest.json").read_text())
    for name, info in manifest["files"].items():
        assert hashlib.sha256((step / name).read_bytes()).hexdigest() == info["sha256"]
    state = json.loads((step / "state.json").read_text())
    assert state["step"] == 10 and state["data"]["samples_consumed"] == 80
    assert state["recipe"]["model"]["hidden_size"] == 64 and len(state["rng"]["cpu"]) > 0
    saved = tensors(step)
    assert saved["model.layers.0.self_attn.k_proj.weight.exp_avg"].shape == (32, 64)
    assert saved["model.layers.0.self_attn.k_proj.weight.step"].item() == 10.0


def test_exact_resume_one_process(run_one, tmp_path):
    """10 straight steps == 5 steps + resume + 5 steps, bitwise; metrics.jsonl keeps steps 1-5.
    nanotron #245's resume (the Adam moments back in bf16, the lr schedule restarted) fails it."""
    records, root = run_one
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    resumed = train_metrics(
        run, 1, [f"checkpoint.dir={tmp_path / 'ck'}", f"checkpoint.resume={root / 'ck' / 'step_00000005'}"]
    )
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert resumed[:5] == records[:5]
    assert_bitwise_run(resumed[5:], records[5:])
    # The final model and optimizer state are the same bits as the uninterrupted run's.
    a, b = tensors(root / "ck" / "step_00000010"), tensors(tmp_path / "ck" / "step_00000010")
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_exact_resume_dp2_tp2_pp2(run_822, tmp_path):
    records, root = run_822
    assert steps_of(root / "ck") == ["step_00000005", "step_00000010"]
    step = root / "ck" / "step_00000005"
    # Each rank writes the slices it holds (FSDP2 x TP: all 8 hold distinct ones); the first
    # rank of each stage (ranks 0 and 4) writes the stage's unsuffixed files.
    assert {p.name for p in step.glob("*.safetensors")} == {
        f"{kind}-stage{r // 4:02d}{'' if r % 4 == 0 else f'-rank{r:05d}'}.safetensors"
        for kind in ("model", "optim")
        for r in range(8)
    }
    resumed = train_metrics(tmp_path, 8, MESH_822 + [f"checkpoint.resume={step}"])
    assert_bitwise_run(resumed, records[5:])


# ---------------------------------------------------------------- resume on another mesh


def test_reshard_one_process_to_tp2_pp2(run_one, tmp_path):
    records, root = run_one
    got = train_metrics(
        tmp_path, 4, ["parallelism.tp=2", "parallelism.pp=2", f"checkpoint.resume={root / 'ck' / 'step_00000005'}"]
    )
    assert_close_run(got, records[5:])


def test_reshard_dp2_tp2_pp2_to_one_process(run_822, tmp_path):
    records, root = run_822
    got = train_metrics(tmp_path, 1, [f"checkpoint.resume={root / 'ck' / 'step_00000005'}"])
    assert_close_run(got, records[5:])


def test_reshard_fsdp_to_replicate(run_822, tmp_path):
    """Saved with FSDP2 (dp_mode shard) across 2 stages, resumed at dp2 replicate, 1 stage."""
    records, root = run_822
    got = train_metrics(
        tmp_path,
        2,
        ["parallelism.dp=2", "parallelism.dp_mode=replicate", f"checkpoint.resume={root / 'ck' / 'step_00000005'}"],
    )
    assert_close_run(got, records[5:])


def test_qwen2_biases_resume_on_another_mesh(shared_run, tmp_path):
    """Qwen2 (q/k/v biases split over tp) saved at dp2 x tp2 (test_parity's run), resumed at tp 2 alone."""
    records, root = shared_run(4, short(QWEN2_DP2_TP2) + ["logging.layout=true"] + SAVES_AT_3_AND_6)
    step = root / "ck" / "step_00000003"
    assert any(n.endswith("q_proj.bias") for n in tensors(step)), "the biases are saved"
    got = train_metrics(tmp_path, 2, short(["model.family=qwen2", "parallelism.tp=2", f"checkpoint.resume={step}"]))
    assert_close_run(got, records[3:])


def test_uneven_vocabulary_shards_resume_exactly(reference, shared_run, tmp_path):
    """torchtitan #1136 (the loss after a resume differs when the vocabulary does not divide by
    the world): vocabulary 255 at dp 2, FSDP2 cuts the embedding and the head into 128 + 127
    rows; the run matches the 1-process run, and resumed at step 3 on the same mesh its steps
    4-6 are the uninterrupted run's, bitwise."""
    overrides = short(["model.vocab_size=255", "parallelism.dp=2"])
    records, root = shared_run(2, overrides + SAVES_AT_3_AND_6)
    assert_parity(records, reference(overrides), scheduled_lrs(PARITY, overrides))
    step = root / "ck" / "step_00000003"
    index = json.loads((step / "state.json").read_text())["tensors"]
    for kind, name in (("model", "model.embed_tokens.weight"), ("optim", "model.embed_tokens.weight.exp_avg")):
        assert sorted(s["offset"][0] for s in index[kind][name]["slices"]) == [0, 128], (name, index[kind][name])
    resumed = train_metrics(tmp_path, 2, overrides + [f"checkpoint.resume={step}"])
    assert_bitwise_run(resumed, records[3:])


# ---------------------------------------------------------------- atomicity, finding the newest


def test_interrupted_saves_are_never_taken(run_one, tmp_path):
    _, root = run_one
    ckpt = tmp_path / "ck"
    shutil.copytree(root / "ck", ckpt)
    good = str(ckpt / "step_00000010")
    # A save interrupted before its rename; one whose manifest was never written; one cut
    # off mid-manifest; and a pointer naming an incomplete directory.
    shutil.copytree(good, ckpt / ".tmp-step_00000011")
    shutil.copytree(good, ckpt / "step_00000012")
    (ckpt / "step_00000012" / "manifest.json").unlink()
    shutil.copytree(good, ckpt / "step_00000013")
    text = (ckpt / "step_00000013" / "manifest.json").read_text()
    (ckpt / "step_00000013" / "manifest.json").write_text(text[: len(text) // 2])
    recipe = load_recipe(PARITY, [f"checkpoint.dir={ckpt}"])
    assert ck.resume_dir(recipe) == good
    (ckpt / "latest").write_text("step_00000012\n")
    assert ck.resume_dir(recipe) == good
    (ckpt / "latest").unlink()
    assert ck.resume_dir(recipe) == good
    for bad in ("step_00000012", "step_00000013"):
        with pytest.raises(CheckpointError, match="incomplete"):
            ck.resume_dir(load_recipe(PARITY, [f"checkpoint.resume={ckpt / bad}"]))
    # `none` ignores the directory; an empty or absent one means a fresh start.
    assert ck.resume_dir(load_recipe(PARITY, [f"checkpoint.dir={ckpt}", "checkpoint.resume=none"])) is None
    assert ck.resume_dir(load_recipe(PARITY, [f"checkpoint.dir={tmp_path / 'absent'}"])) is None


def test_publish_replaces_and_prune_keeps_newest(tmp_path, run_one):
    _, root = run_one
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    (ckpt / ".tmp-step_00000001").mkdir()  # a leftover of an interrupted save
    for step in (2, 4, 6, 8, 6):
        tmp = ckpt / f".tmp-step_{step:08d}"
        tmp.mkdir()
        shutil.copy(root / "ck" / "step_00000010" / "model-stage00.safetensors", tmp)
        ck.seal(str(tmp), {"step": step, "marker": f"write of step {step}", "recipe": {}})
        ck.publish(str(ckpt), str(tmp), f"step_{step:08d}")
        ck.prune(str(ckpt), step, keep=2)
    # Keep 2 at each save: after step 8, steps 6 and 8. The second write of step 6 replaced
    # the first and became `latest`; step 8 (beyond it, from an abandoned future) is left alone.
    assert steps_of(ckpt) == ["step_00000006", "step_00000008"]
    assert (ckpt / "latest").read_text().strip() == "step_00000006"
    assert json.loads((ckpt / "step_00000006" / "state.json").read_text())["marker"] == "write of step 6"
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------- nothing unsafe is loaded


class Payload:
    """Unpickling this creates `path`: proof that pickle ran."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def plant(path: Path, marker: Path) -> None:
    with open(path, "wb") as f:
        pickle.dump({"model.embed_tokens.weight": Payload(str(marker))}, f)


def test_pickle_payload_is_never_executed(run_one, tmp_path):
    _, root = run_one
    marker = tmp_path / "PWNED"
    # The payload is live: unpickling a copy does create a marker.
    proof = tmp_path / "proof.pt"
    plant(proof, tmp_path / "live")
    with open(proof, "rb") as f:
        pickle.load(f)
    assert (tmp_path / "live").exists()

    ckpt = tmp_path / "ck"
    shutil.copytree(root / "ck", ckpt)
    step = ckpt / "step_00000010"
    for name in ("model.pt", "pytorch_model.bin", "optimizer.bin"):
        plant(step / name, marker)
    # Resume (the run has nothing left to do at step 10), load_model, export: all ignore them.
    proc = cli_process("train", PARITY, f"checkpoint.dir={ckpt}", f"logging.run_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stdout and "step 10" in proc.stdout
    load_model(ckpt)
    assert cli("export-hf", str(ckpt), str(tmp_path / "hf")).returncode == 0
    assert sorted(os.listdir(tmp_path / "hf")) == [".dtensor3d-written-by", "config.json", "model.safetensors"]
    # A pickle in place of a listed file is refused (its size and sha256 differ).
    plant(step / "model-stage00.safetensors", marker)
    line = one_error_line(cli("validate", PARITY, f"checkpoint.resume={step}"))
    assert "model-stage00.safetensors" in line
    with pytest.raises(CheckpointError, match="model-stage00.safetensors"):
        load_model(step)
    # A manifest edited to list the pickle (with its true hash) is refused by name.
    shutil.copy(root / "ck" / "step_00000010" / "model-stage00.safetensors", step)
    manifest = json.loads((step / "manifest.json").read_text())
    data = (step / "model.pt").read_bytes()
    manifest["files"]["model.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert "model.pt" in one_error_line(cli("validate", PARITY, f"checkpoint.resume={step}"))
    # A Hugging Face directory with only pickle weights is refused, naming them.
    hf = tmp_path / "hf_pickle"
    hf.mkdir()
    shutil.copy(tmp_path / "hf" / "config.json", hf)
    plant(hf / "pytorch_model.bin", marker)
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        load_model(hf)
    assert "pytorch_model.bin" in one_error_line(cli("import-hf", str(hf), str(tmp_path / "imported")))
    assert not marker.exists()


# ---------------------------------------------------------------- bad checkpoints


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01
    path.write_bytes(bytes(data))


BAD = {
    "missing-shard": (
        lambda s: (s / "optim-stage00.safetensors").unlink(),
        (),
        ("optim-stage00.safetensors", "missing"),
    ),
    "truncated": (lambda s: _truncate(s / "model-stage00.safetensors"), (), ("model-stage00.safetensors", "bytes")),
    "checksum": (lambda s: _flip(s / "model-stage00.safetensors"), (), ("model-stage00.safetensors", "sha256")),
    "shape": (
        lambda s: None,
        ("model.intermediate_size=256",),
        ("model-stage00.safetensors", "mlp.gate_proj.weight", "[128, 64]", "[256, 64]"),
    ),
    "config": (lambda s: None, ("model.rope_theta=500000",), ("state.json", "rope_theta", "10000.0", "500000.0")),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_one_error_line(case, run_one, tmp_path):
    _, root = run_one
    ckpt = tmp_path / "ck"
    shutil.copytree(root / "ck", ckpt)
    damage, overrides, expect = BAD[case]
    damage(ckpt / "step_00000010")
    before = tree_digest(ckpt)
    line = one_error_line(cli("validate", PARITY, f"checkpoint.dir={ckpt}", *overrides))
    for text in expect:
        assert text in line, line
    assert str(ckpt / "step_00000010") in line
    assert tree_digest(ckpt) == before


def test_bad_checksum_found_by_the_ranks(run_one, tmp_path):
    """`train` (as torchrun runs it) checks sizes at the door and sha256 on the ranks; a
    flipped bit stops it with one error line before any step, and nothing is overwritten."""
    _, root = run_one
    ckpt = tmp_path / "ck"
    shutil.copytree(root / "ck", ckpt)
    _flip(ckpt / "step_00000010" / "optim-stage00.safetensors")
    before = tree_digest(ckpt)
    proc = cli_process(
        "train", PARITY, f"checkpoint.dir={ckpt}", "training.steps=12", f"logging.run_dir={tmp_path / 'run'}"
    )
    line = one_error_line(proc)
    assert "optim-stage00.safetensors" in line and "sha256" in line
    assert "step " not in proc.stdout
    assert tree_digest(ckpt) == before


def test_launch_verifies_checksums_before_torchrun(run_one, tmp_path):
    """`bash launch.sh` checks every sha256 (its `validate`) and starts no rank: one error
    line, and launch.sh's Python calls (logged through $PYTHON) are that one `validate`."""
    _, root = run_one
    ckpt = tmp_path / "ck"
    shutil.copytree(root / "ck", ckpt)
    _flip(ckpt / "step_00000010" / "model-stage00.safetensors")  # same size: only sha256 tells
    before = tree_digest(ckpt)
    log, wrapper = tmp_path / "python-calls.log", tmp_path / "python"
    wrapper.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> "{log}"\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    env = clean_env(PYTHON=str(wrapper))
    args = [PARITY, f"checkpoint.dir={ckpt}", "training.steps=12", f"logging.run_dir={tmp_path / 'run'}"]
    proc = subprocess.run(["bash", "launch.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    line = one_error_line(proc)
    assert "model-stage00.safetensors" in line and "sha256" in line
    calls = log.read_text().splitlines()
    assert len(calls) == 1 and calls[0].startswith("-m dtensor3d validate"), calls
    assert not (tmp_path / "run").exists() and tree_digest(ckpt) == before


def test_bad_checksum_found_by_two_ranks_together(run_one, tmp_path):
    """Under torchrun the ranks split the sha256 checks (file i on rank i mod world). The
    damaged file is the second of the manifest, rank 1's share: both ranks stop before any
    step, with one error line (rank 0 prints it), and nothing is overwritten."""
    _, root = run_one
    ckpt = tmp_path / "ck"
    shutil.copytree(root / "ck", ckpt)
    step = ckpt / "step_00000010"
    names = sorted(json.loads((step / "manifest.json").read_text())["files"])
    assert names[1] == "optim-stage00.safetensors", names
    _flip(step / names[1])
    before = tree_digest(ckpt)
    env = clean_env()
    train = ["-m", "dtensor3d", "train", PARITY, "parallelism.dp=2", f"checkpoint.dir={ckpt}", "training.steps=12"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *train]
    proc = subprocess.run(
        [*cmd, f"logging.run_dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0, proc.stdout[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(step / names[1]) in errors[0] and "sha256" in errors[0], proc.stderr[-4000:]
    assert "step " not in proc.stdout
    assert tree_digest(ckpt) == before


def test_resume_from_a_checkpoint_dir_interval_0_and_init_from_hf_ignored(run_one, hf_model, tmp_path):
    """checkpoint.resume=<checkpoint dir> takes its newest step (10, of 5..10); init_from_hf,
    also given, is ignored because there is a checkpoint to resume; checkpoint.interval=0
    saves only at the end (step 13, not 11 or 12); micro_batch_size and the optimizer
    settings may change on resume."""
    _, root = run_one
    model, hf_root = hf_model
    ckpt, run = tmp_path / "ck", tmp_path / "run"
    changed = ["training.micro_batch_size=2", "optimizer.lr=2e-3", "optimizer.decay=linear"]
    proc = cli_process(
        "train",
        PARITY,
        "training.steps=13",
        f"checkpoint.dir={ckpt}",
        "checkpoint.interval=0",
        f"checkpoint.resume={root / 'ck'}",
        f"checkpoint.init_from_hf={hf_root / 'single'}",
        f"logging.run_dir={run}",
        *changed,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {root / 'ck' / 'step_00000010'} at step 10" in proc.stdout, proc.stdout[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [11, 12, 13]
    # Step 11's loss is the step-10 model's loss on global batch 10, not the Hugging Face model's.
    recipe = load_recipe(PARITY)
    inputs, targets = local_batch(recipe, make_source(recipe), 10)
    ours = F.cross_entropy(our_logits(load_model(root / "ck"), inputs).flatten(0, 1), targets.flatten()).item()
    theirs = F.cross_entropy(hf_logits(model, inputs).flatten(0, 1), targets.flatten()).item()
    assert abs(records[0]["loss"] - ours) / ours <= TOL, (records[0]["loss"], ours)
    assert abs(theirs - ours) / ours > 1e-3, (theirs, ours)  # the two starts are told apart
    new = load_recipe(PARITY, ["training.steps=13", *changed]).optimizer
    assert [r["lr"] for r in records] == pytest.approx([scheduled_lr(s, new, 13) for s in (10, 11, 12)], rel=1e-12)
    assert steps_of(ckpt) == ["step_00000013"] and (ckpt / "latest").read_text().strip() == "step_00000013"


# ---------------------------------------------------------------- Hugging Face

HF_CONFIG = TINY_HF_LLAMA
# What the parity recipe must add to describe HF_CONFIG's model (its rope_theta is not the default)
HF_ROPE = f"model.rope_theta={HF_CONFIG['rope_theta']}"


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def our_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny random transformers LlamaForCausalLM (GQA 8/4, untied), saved whole and sharded."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG)).float().eval()
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1, every tensor distinct
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="300KB")
    assert (root / "sharded" / "model.safetensors.index.json").exists()
    return model, root


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_load_model_from_hf_dir(hf_model, layout):
    model, root = hf_model
    ours = load_model(root / layout)
    tokens = batch_tokens()
    ref = hf_logits(model, tokens)
    got = our_logits(ours, tokens)
    assert got.shape == (2, 24, 256)
    assert (got - ref).abs().max().item() <= 1e-5


def test_import_hf_then_export_round_trip(hf_model, tmp_path):
    model, root = hf_model
    out = tmp_path / "ck"
    proc = cli("import-hf", str(root / "sharded"), str(out))
    assert proc.returncode == 0, proc.stderr
    assert steps_of(out) == ["step_00000000"] and (out / "latest").read_text().strip() == "step_00000000"
    tokens = batch_tokens(1)
    assert (our_logits(load_model(out), tokens) - hf_logits(model, tokens)).abs().max().item() <= 1e-5
    proc = cli("export-hf", str(out), str(tmp_path / "back"))
    assert proc.returncode == 0, proc.stderr
    original, back = (
        load_file(root / "single" / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert sorted(original) == sorted(back) and all(torch.equal(original[k], back[k]) for k in original)


@pytest.mark.parametrize("shard_mb", [None, 0.3])
def test_export_hf_loads_in_transformers(run_822, tmp_path, shard_mb):
    """A checkpoint saved at dp2 x tp2 x pp2 (two stage files) -> export-hf -> from_pretrained."""
    _, root = run_822
    out = tmp_path / "hf"
    args = ["export-hf", str(root / "ck"), str(out)] + (["--max-shard-mb", str(shard_mb)] if shard_mb else [])
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr
    if shard_mb:
        assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("model-*.safetensors"))) > 1
    model, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = load_model(root / "ck")
    tokens = batch_tokens(2)
    ref, got = hf_logits(model.eval(), tokens), our_logits(ours, tokens)
    assert (got - ref).abs().max().item() <= 1e-5
    # The trained weights, not the initial ones: step 10 differs from step 5.
    assert (our_logits(load_model(root / "ck" / "step_00000005"), tokens) - ref).abs().max().item() > 1e-3
    # Nothing is overwritten: exporting again into the same directory is refused.
    before = tree_digest(out)
    assert str(out) in one_error_line(cli("export-hf", str(root / "ck"), str(out)))
    assert tree_digest(out) == before


def test_init_from_hf_on_tp2_pp2(hf_model, tmp_path):
    """init_from_hf at tp2 x pp2: the first step's loss is the Hugging Face model's loss on
    the first global batch (the loss is computed before the first update)."""
    model, root = hf_model
    got = train_metrics(
        tmp_path,
        4,
        [
            "parallelism.tp=2",
            "parallelism.pp=2",
            "training.steps=1",
            HF_ROPE,
            f"checkpoint.init_from_hf={root / 'single'}",
        ],
    )
    recipe = load_recipe(PARITY)
    inputs, targets = local_batch(recipe, make_source(recipe), 0)
    ref = F.cross_entropy(hf_logits(model, inputs).flatten(0, 1), targets.flatten()).item()
    assert abs(got[0]["loss"] - ref) / ref <= TOL, (got[0]["loss"], ref)


def test_init_from_hf_checked_at_the_door(hf_model, tmp_path):
    _, root = hf_model
    hf = root / "single"
    line = one_error_line(cli("validate", PARITY, f"checkpoint.init_from_hf={hf}", "model.rope_theta=500000"))
    assert "config.json" in line and "rope_theta" in line and "500000" in line
    line = one_error_line(cli("validate", PARITY, f"checkpoint.init_from_hf={tmp_path / 'nope'}"))
    assert "checkpoint.init_from_hf" in line and "no such directory" in line
    line = one_error_line(cli("validate", PARITY, f"checkpoint.init_from_hf={hf}"))  # the recipe's default 10000
    assert "rope_theta" in line and "271828" in line and "10000" in line
    assert cli("validate", PARITY, f"checkpoint.init_from_hf={hf}", HF_ROPE).returncode == 0


@pytest.mark.parametrize(
    "key,value,expect",
    [
        ("hidden_act", "gelu", "silu"),
        ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "rope_type='dynamic' is not supported; supported"),
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "longrope"),
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
        ("rope_parameters", {"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("model_type", "gpt2", "supported model_type: llama, qwen2, qwen3, mistral, mixtral"),
        ("attention_dropout", 0.1, "dropout"),
    ],
)
def test_unsupported_hf_config_refused(key, value, expect):
    hf = transformers.LlamaConfig(**HF_CONFIG).to_dict()
    assert ck.config_from_hf(hf, "config.json").hidden_size == 64
    hf[key] = value
    with pytest.raises(CheckpointError, match=expect) as err:
        ck.config_from_hf(hf, "config.json")
    assert key in str(err.value)


def test_expected_shapes_match_transformers():
    """Our parameter names and shapes are transformers' LlamaForCausalLM's, one to one."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG))
    theirs = {n: list(p.shape) for n, p in model.named_parameters()}
    assert ck.expected_shapes(load_recipe(PARITY).model) == theirs


def test_import_hf_carries_the_tokenizer_and_generate_needs_no_flag(hf_model, tmp_path, capsys):
    """import-hf copies tokenizer.json / tokenizer_config.json into the step directory (in its
    manifest), a chat_template.jinja folded into tokenizer_config.json (a step directory holds
    JSON and safetensors only); generate, and generate --chat, then run without --tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dtensor3d.checkpoint.format import read_manifest

    _, root = hf_model
    hf = tmp_path / "hf"
    shutil.copytree(root / "single", hf)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(200)}, unk_token="w0"))  # within vocab 256
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    template = "{% for m in messages %}w3 {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w4{% endif %}"
    (hf / "chat_template.jinja").write_text(template)
    assert main(["import-hf", str(hf), str(tmp_path / "ck")]) == 0
    step = tmp_path / "ck" / "step_00000000"
    assert (step / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    config = {"eos_token": "<|endoftext|>", "chat_template": template}
    assert json.loads((step / "tokenizer_config.json").read_text()) == config
    assert sorted(n for n in read_manifest(str(step))["files"] if "token" in n or "chat" in n) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    capsys.readouterr()
    argv = ["generate", str(tmp_path / "ck"), "--prompt", "w1 w2", "--max-new-tokens", "3", "--temperature", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("w1 w2")
    assert main([*argv, "--chat"]) == 0  # the prompt is the template's "w3 w1 w2 w4"; the reply alone
    from dtensor3d.checkpoint import load_model
    from dtensor3d.generate import generate_ids

    reply = generate_ids(load_model(tmp_path / "ck"), tok.encode("w3 w1 w2 w4").ids, 3, temperature=0.0)
    assert capsys.readouterr().out == tok.decode(list(reply)) + "\n"


def test_init_from_hf_without_a_model_section_and_float32_config_values(hf_model, tmp_path, capsys):
    """No `model` section: the model is DIR/config.json. With one, fields are compared one by one,
    floats to a relative 1e-6 (a float32 rms_norm_eps of 9.999999747378752e-06 equals 1e-05)."""
    import yaml

    from dtensor3d.checkpoint.hf import check_hf_init, read_hf_config

    _, root = hf_model
    hf = tmp_path / "hf"
    shutil.copytree(root / "single", hf)
    config = json.loads((hf / "config.json").read_text())
    config["rms_norm_eps"] = 9.999999747378752e-06
    (hf / "config.json").write_text(json.dumps(config))
    base = yaml.safe_load(Path(PARITY).read_text())
    without = {k: v for k, v in base.items() if k != "model"}
    without["checkpoint"] = {**(without.get("checkpoint") or {}), "init_from_hf": str(hf)}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(without))
    recipe = load_recipe(str(tmp_path / "r.yaml"))
    assert recipe.model == read_hf_config(str(hf), "DIR") and recipe.model.rms_norm_eps == 9.999999747378752e-06
    close = dataclasses.replace(recipe.model, rms_norm_eps=1e-05)
    check_hf_init(dataclasses.replace(recipe, model=close))  # equal to a relative 1e-6: accepted
    for field, value in (("rms_norm_eps", 1.1e-05), ("hidden_size", recipe.model.hidden_size * 2)):
        other = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, **{field: value}))
        with pytest.raises(CheckpointError, match=f"config.json has {field}="):
            check_hf_init(other)
