"""Issue 43 item 2: a step whose global batch has no counted target (chat data whose
assistant turns lie outside its windows) is skipped: no optimizer step, the same on every
rank (training/skip.py). Shown with the real commands: prepare-data --chat (its report of
the counted tokens at --sequence-length) and a training run at dp 2 (the ranks agree: every
one reads the global count from the masks of the whole batch), whose checkpoints after each
step show the weights and the optimizer's state untouched by a skipped step."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import torch
from helpers import PARITY, WORDS, chat_tokenizer_dir, cli_process, scheduled_lrs, torchrun, write_jsonl
from safetensors.torch import load_file

from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.chat_report import mask_counts
from dtensor3d.datasets.sources import make_source
from dtensor3d.datasets.tokendir import read_meta
from dtensor3d.parallel.data import loss_tokens

STEPS = 8
TRAIN = ["data.kind=tokens", "model.vocab_size=304", "model.num_hidden_layers=1", "training.eval_every=0",
         f"training.steps={STEPS}", "optimizer.weight_decay=0.1"]  # fmt: skip


def long_questions(n: int) -> list[dict]:
    """Conversations of one long user turn (60-120 words) and a short reply (1-3 words)."""
    rng = random.Random(0)
    return [
        {"messages": [
            {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(60, 120)))},
            {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 3)))},
        ]}
        for _ in range(n)
    ]  # fmt: skip


def row_report(out, length: int) -> tuple[int, int, int, int]:
    """(counted, tokens, rows with a counted token past their first length + 1 tokens, rows
    with none within them), from the files, row by row."""
    mask = np.fromfile(out / "train_00000.mask", dtype=np.uint8)
    offsets = np.fromfile(out / "train_docs.bin", dtype="<i8")
    beyond = none = 0
    for a, b in zip(offsets[:-1], offsets[1:]):
        where = np.flatnonzero(mask[a:b])
        beyond += int(where.max() > length)
        none += int(where.min() > length)
    return int(mask.sum()), len(mask), beyond, none


def tensors(step_dir) -> dict[str, torch.Tensor]:
    return {f"{f.name}:{k}": v for f in sorted(step_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_a_step_without_counted_tokens_is_skipped_and_changes_no_weight(tmp_path):
    tok = chat_tokenizer_dir(tmp_path / "tok")
    data, out = write_jsonl(tmp_path / "long.jsonl", long_questions(40)), tmp_path / "chat"
    proc = cli_process("prepare-data", str(data), "--chat", "--tokenizer", str(tok), "--out", str(out),
                       "--val-fraction", "0", "--sequence-length", "32", "--no-progress")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    counted, tokens, beyond, none = row_report(out, 32)
    line = proc.stdout.strip().splitlines()[-1]
    share = f"{counted / tokens:.1%} of the training tokens count in the loss ({counted:,} of {tokens:,}, in 40 rows)"
    assert line.startswith(f"chat: {share}"), line
    assert f"{beyond:,} rows have counted tokens beyond their first 33 tokens (one sample), {none:,} of them" in line
    assert none == 40, line  # every reply lies past its row's first sample
    c = mask_counts(str(out), read_meta(str(out)), 300)  # some rows fit, some reach past, some have none within
    assert (c["counted"], c["tokens"], c["beyond"], c["none_within"]) == row_report(out, 300)
    assert 0 < c["none_within"] < c["beyond"] < 40, c

    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    extra = [f"data.path={out}", "logging.every=4", f"checkpoint.dir={ckpt}", "checkpoint.interval=1",
             f"checkpoint.keep={STEPS}"]  # fmt: skip
    proc = torchrun(
        2, ["-m", "dtensor3d", "train", PARITY, *TRAIN, *extra, "parallelism.dp=2", f"logging.run_dir={run}"]
    )
    records = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}

    recipe = load_recipe(PARITY, [*TRAIN, f"data.path={out}"])
    source = make_source(recipe)
    empty = {s + 1 for s in range(STEPS) if loss_tokens(recipe, source, s) == 0}
    assert empty and len(empty) < STEPS, empty  # the data gives both kinds of step
    skipped = {s for s, r in records.items() if r.get("skipped")}
    assert skipped == empty, (skipped, empty)  # logged whatever logging.every (4)
    assert all(records[s]["skip_reason"] == "no counted tokens" and records[s]["loss"] == 0.0 for s in skipped)
    warnings = [ln for ln in proc.stdout.splitlines() if ln.startswith("warning:")]
    fraction = f"{len(empty)} of {STEPS} steps ({len(empty) / STEPS:.1%}) had no counted tokens"
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: {fraction}"), warnings
    curve = re.search(r'points="([^"]*)"', (run / "loss.svg").read_text()).group(1).split()
    assert len(curve) == len([s for s in records if s not in skipped])  # a skipped step's 0 is not drawn as a loss
    # The schedule moves on (OLMo-core's skip-step): each logged step's lr is its step's.
    lrs = scheduled_lrs(PARITY, [*TRAIN, f"data.path={out}"])
    assert all(abs(r["lr"] - lrs[s - 1]) <= 1e-12 for s, r in records.items())

    steps = {int(m.group(1)): p for p in ckpt.iterdir() if (m := re.fullmatch(r"step_(\d+)", p.name))}
    assert sorted(steps) == list(range(1, STEPS + 1))
    for s in range(2, STEPS + 1):
        before, after = tensors(steps[s - 1]), tensors(steps[s])
        assert before.keys() == after.keys()
        same = all(torch.equal(before[k], after[k]) for k in before)
        assert same == (s in empty), s  # a skipped step moves nothing, not even by weight decay or momentum
