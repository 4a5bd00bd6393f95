"""Fine-tuning on chat data (prepare-data --chat): the loss counts only the unmasked targets and
is normalised by their count over the whole global batch, so it is one number at every mesh.

One 1-process run and one dp 2 x tp 2 run of 2 steps, evaluating 2 validation batches after
each: their losses, gradient norms and validation losses agree (the two dp ranks hold
different counts of assistant tokens), and the 1-process run equals plain PyTorch: the mean
cross entropy over the unmasked targets of the step's 8 windows (and its gradient norm) at
the initial weights, and after one torch AdamW step the validation loss over both
evaluation batches' unmasked targets."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from helpers import PARITY, chat_rows, chat_tokenizer_dir, train_metrics, write_jsonl

from dtensor3d.__main__ import main
from dtensor3d.config.load import load_recipe
from dtensor3d.config.lr import lr_at
from dtensor3d.datasets.chat import find_template
from dtensor3d.datasets.prepare import PrepareOptions, prepare
from dtensor3d.datasets.sources import make_source
from dtensor3d.models.llama import LlamaForCausalLM
from dtensor3d.parallel.data import IGNORE, local_batch
from dtensor3d.parallel.shards import init_weights


def _files(out, meta: dict, split: str):
    """The split's tokens and loss mask, read with numpy from the files meta.json lists."""
    shards = meta["splits"][split]["shards"]
    tokens = np.concatenate([np.fromfile(out / s["file"], dtype=meta["dtype"]) for s in shards]).astype(np.int64)
    return tokens, np.concatenate([np.fromfile(out / s["mask"], dtype=np.uint8) for s in shards])


def _plain_loss(model, rows: np.ndarray, masks: np.ndarray) -> torch.Tensor:
    """Mean cross entropy of the targets whose mask is 1 (rows, masks: [n, L + 1])."""
    x, y = torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])
    per_token = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
    return per_token[torch.from_numpy(masks[:, 1:].reshape(-1) == 1)].mean()


def _windows(tokens, masks, starts, length):
    return np.stack([tokens[s : s + length + 1] for s in starts]), np.stack([masks[s : s + length + 1] for s in starts])


def test_masked_loss_parity_and_plain_pytorch(tmp_path):
    import json

    tok_dir = chat_tokenizer_dir(tmp_path / "tok")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(160))
    out = tmp_path / "data"
    prepare(PrepareOptions((str(data),), str(out), tokenizer=str(tok_dir), val_fraction=0.2, chat=True))
    overrides = [
        "data.kind=tokens",
        f"data.path={out}",
        "model.vocab_size=304",
        "training.steps=2",
        "training.eval_every=1",
        "training.eval_batches=2",
    ]
    recipe = load_recipe(PARITY, overrides)
    t, source = recipe.training, make_source(recipe)
    # Uneven: the two dp ranks of step 1 hold different counts of counted targets.
    counts = [int((local_batch(recipe, source, 0, r, 2)[1] != IGNORE).sum()) for r in (0, 1)]
    assert counts[0] != counts[1] and min(counts) > 0, counts
    one = train_metrics(tmp_path / "one", 1, [*overrides, f"checkpoint.dir={tmp_path / 'ck'}"])
    four = train_metrics(tmp_path / "four", 4, [*overrides, "parallelism.dp=2", "parallelism.tp=2"])
    # The checkpoint carries the template (as tokenizer_config.json's chat_template: a step
    # directory holds JSON and safetensors only); export-hf writes it where transformers reads it.
    step_dir = tmp_path / "ck" / (tmp_path / "ck" / "latest").read_text().strip()
    template = (out / "chat_template.jinja").read_text()
    assert find_template(str(step_dir / "tokenizer.json")).source == template
    assert main(["export-hf", str(tmp_path / "ck"), str(tmp_path / "hf")]) == 0
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == template
    for key in ("loss", "grad_norm", "val_loss"):
        got, ref = ([r[key] for r in run if key in r] for run in (four, one))
        assert len(ref) == 2
        np.testing.assert_allclose(got, ref, rtol=1e-5, err_msg=key)

    # Plain PyTorch over the files: step 1's windows at the initial weights.
    meta = json.loads((out / "meta.json").read_text())
    tokens, masks = _files(out, meta, "train")
    L = t.sequence_length
    rows, row_masks = _windows(tokens, masks, [source.window(i) * L for i in range(t.global_batch_size)], L)
    model = LlamaForCausalLM(recipe.model)
    init_weights(model, t.seed)
    loss = _plain_loss(model, rows, row_masks)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.optimizer.clip_grad)
    step1 = next(r for r in one if "loss" in r)
    np.testing.assert_allclose([step1["loss"], step1["grad_norm"]], [loss.item(), norm.item()], rtol=1e-5)
    # One torch AdamW step (decay on matrices only), then the validation windows 0..15.
    o = recipe.optimizer
    groups = [
        {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    torch.optim.AdamW(groups, lr=lr_at(0, o, t.steps), betas=o.betas, eps=o.eps).step()
    val_tokens, val_masks = _files(out, meta, "val")
    count = (len(val_tokens) - 1) // L
    starts = [(j % count) * L for j in range(t.eval_batches * t.global_batch_size)]
    with torch.no_grad():
        val = _plain_loss(model, *_windows(val_tokens, val_masks, starts, L)).item()
    first_val = next(r for r in one if "val_loss" in r)
    assert first_val["step"] == 1
    np.testing.assert_allclose(first_val["val_loss"], val, rtol=1e-5)
