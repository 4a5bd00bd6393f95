"""Issue 43 item 18: model.pad_vocab_to_multiple_of (Megatron's convention). A byte tokenizer's
257 tokens at tp 2: the embedding and the head are padded, the padded logits never count (loss,
generate), export-hf writes the padded size, and the run equals the unpadded 1-process run."""

from __future__ import annotations

import json

import torch
import transformers
from helpers import PARITY, TINY_HF_LLAMA, cli, one_error_line, scheduled_lrs, short, train_metrics

from dtensor3d.checkpoint import load_model
from dtensor3d.config.load import load_recipe
from dtensor3d.generate import generate_ids
from dtensor3d.models.llama import LlamaForCausalLM
from dtensor3d.parallel.shards import init_weights

PAD = ["model.vocab_size=257", "model.pad_vocab_to_multiple_of=64"]  # a byte tokenizer's 257 -> 320 rows
# The parity run: vocabulary 255 (test_uneven_vocabulary_shards_resume_exactly's, whose 1-process
# reference run it shares) padded to 256 at tp 2.
UNPADDED = short(["model.vocab_size=255"])
PADDED_TP2 = short(["model.vocab_size=255", "model.pad_vocab_to_multiple_of=64", "parallelism.tp=2"])
SAVES_AT_3 = ["checkpoint.dir={root}/ck", "checkpoint.interval=3"]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_unpadded_vocab_at_tp2_names_the_padding_key():
    line = one_error_line(cli("validate", PARITY, "model.vocab_size=257", "parallelism.tp=2"))
    assert "model.vocab_size=257" in line and "model.pad_vocab_to_multiple_of" in line, line
    line = one_error_line(cli("validate", PARITY, PAD[0], "model.pad_vocab_to_multiple_of=7", "parallelism.tp=2"))
    assert "model.vocab_size=257 (padded to 259)" in line and "model.pad_vocab_to_multiple_of" in line, line
    assert cli("validate", PARITY, *PAD, "parallelism.tp=2").returncode == 0


def test_padded_init_keeps_the_unpadded_rows():
    """Per-parameter seeded init: the real rows are the unpadded model's, bit for bit; the padding is zeros."""
    models = {}
    for extra in ([], ["model.pad_vocab_to_multiple_of=64"]):
        cfg = load_recipe(PARITY, ["model.vocab_size=257", *extra]).model
        models[bool(extra)] = LlamaForCausalLM(cfg)
        init_weights(models[bool(extra)], 7)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        plain, padded = models[False].get_parameter(name), models[True].get_parameter(name)
        assert padded.shape == (320, 64) and torch.equal(padded[:257], plain), name
        assert not padded[257:].any(), name


def test_padded_run_at_tp2_equals_the_unpadded_world_1_run(reference, shared_run, tmp_path):
    """Loss, grad norm and validation loss at every step within 1e-6 of the unpadded 1-process run
    (fp32); resumed at world 1 from its step-3 checkpoint (resharded), steps 4-6 are the run's;
    export-hf writes vocab_size 256 and transformers reads the same real logits."""
    records, root = shared_run(2, PADDED_TP2 + SAVES_AT_3)
    ref = reference(UNPADDED)
    assert [r["step"] for r in records] == [r["step"] for r in ref] == list(range(1, 7))
    worst = {
        k: max(_rel(g[k], r[k]) for g, r in zip(records, ref) if k in r) for k in ("loss", "grad_norm", "val_loss")
    }
    print(f"padded tp2 vs unpadded world 1, worst relative difference: {worst}")
    assert all(v <= 1e-6 for v in worst.values()), worst
    assert [g["lr"] for g in records] == scheduled_lrs(PARITY, PADDED_TP2)

    step = root / "ck" / "step_00000003"
    resumed = train_metrics(
        tmp_path / "resumed", 1, [o for o in PADDED_TP2 if "tp=" not in o] + [f"checkpoint.resume={step}"]
    )
    for g, r in zip(resumed, records[3:], strict=True):
        assert g["step"] == r["step"] and _rel(g["loss"], r["loss"]) <= 1e-6, (g, r)

    assert cli("export-hf", str(root / "ck"), str(tmp_path / "hf")).returncode == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 256
    ours = load_model(root / "ck")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 254, 42, 7]])
    with torch.no_grad():
        mine, hf = ours(ids), theirs(ids).logits
    assert mine.shape[-1] == 256 and torch.isneginf(mine[..., 255:]).all()
    torch.testing.assert_close(mine[..., :255], hf[..., :255], rtol=1e-5, atol=1e-5)


def test_generate_never_yields_a_padding_id():
    """The padding's head rows made the largest logits: still never sampled or chosen."""
    cfg = load_recipe(PARITY, PAD).model
    model = LlamaForCausalLM(cfg).eval()
    init_weights(model, 7)
    with torch.no_grad():
        model.lm_head.weight[257:] = 10.0 * model.lm_head.weight[:257].abs().max()
    for temperature in (0.0, 1.0):
        ids = list(generate_ids(model, [1, 2, 3], 40, temperature=temperature, seed=3))
        assert len(ids) == 40 and max(ids) < 257, ids


def test_init_from_hf_into_a_padded_vocabulary_is_refused_in_one_line(tmp_path):
    """A Hugging Face directory holds vocab_size rows: padding them is refused at the door, naming the key."""
    cfg = transformers.LlamaConfig(**{**TINY_HF_LLAMA, "vocab_size": 255})
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    model = ["model.vocab_size=255", "model.rope_theta=271828.0", "model.rms_norm_eps=1e-5"]
    init = f"checkpoint.init_from_hf={tmp_path / 'hf'}"
    line = one_error_line(cli("validate", PARITY, init, *model, "model.pad_vocab_to_multiple_of=64"))
    assert "model.pad_vocab_to_multiple_of=64 pads vocab_size=255 to 256 rows" in line, line
    assert cli("validate", PARITY, init, *model).returncode == 0
