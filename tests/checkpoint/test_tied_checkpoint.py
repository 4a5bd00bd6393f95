"""Tied embeddings in checkpoints (parallel/tied.py): a run at tp 2 x pp 2 holds the matrix
twice (a copy on the first and on the last stage) and saves it once, as the embedding; it
resumes in one process, and a one-parameter run (dp 2 x tp 2) resumes at pp 2, each
continuing its run's trajectory; export-hf of the pp 2 checkpoint loads in transformers as a
tied model with the same logits. The saving runs are test_parity's (conftest.shared_run)."""

import json

import torch
import transformers
from helpers import SAVES_AT_3_AND_6, TIED_DP2_TP2, TIED_TP2_PP2, TOL, cli, short, train_metrics

from dtensor3d.checkpoint import load_model

TIED = "model.tie_word_embeddings=true"


def tied_run(shared_run, mesh: list[str]):
    """(records, root) of test_parity's tied run on `mesh` (the same overrides, so the same run)."""
    overrides = short(mesh)
    return shared_run(4, overrides + ["logging.layout=true"] + SAVES_AT_3_AND_6)


def assert_continues(got: list[dict], ref: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [4, 5, 6], json.dumps(got)[:300]
    for g, r in zip(got, ref):
        for key in ("loss", "grad_norm"):
            assert abs(g[key] - r[key]) <= TOL * abs(r[key]), (g["step"], key, g[key], r[key])


def saved_names(step_dir) -> tuple[set[str], set[str]]:
    index = json.loads((step_dir / "state.json").read_text())["tensors"]
    return set(index["model"]), set(index["optim"])


def test_tied_pp2_checkpoint_resumes_in_one_process(shared_run, tmp_path):
    records, root = tied_run(shared_run, [*TIED_TP2_PP2, "parallelism.tp_mode=REDUCE_SCATTER"])
    step = root / "ck" / "step_00000003"
    model, optim = saved_names(step)
    assert "model.embed_tokens.weight" in model and "lm_head.weight" not in model  # saved once
    assert not any(n.startswith("lm_head.weight.") for n in optim) and "model.embed_tokens.weight.exp_avg" in optim
    got = train_metrics(tmp_path, 1, short([TIED, f"checkpoint.resume={step}"]))
    assert_continues(got, records[3:])


def test_tied_pp1_checkpoint_resumes_at_pp2(shared_run, tmp_path):
    records, root = tied_run(shared_run, TIED_DP2_TP2)
    step = root / "ck" / "step_00000003"
    got = train_metrics(tmp_path, 2, short([TIED, "parallelism.pp=2", f"checkpoint.resume={step}"]))
    assert_continues(got, records[3:])


def test_tied_pp2_export_loads_in_transformers(shared_run, tmp_path):
    _, root = tied_run(shared_run, [*TIED_TP2_PP2, "parallelism.tp_mode=REDUCE_SCATTER"])
    out = tmp_path / "hf"
    proc = cli("export-hf", str(root / "ck"), str(out))
    assert proc.returncode == 0, proc.stderr
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, got = model.eval()(tokens).logits, load_model(root / "ck")(tokens)
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
