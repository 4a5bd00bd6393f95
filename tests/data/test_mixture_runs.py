"""Issue 22 items 2 and 5 in real runs (two, shared by every test here): a 1-process run of a
mixture whose stage switches at step 3 (saving at step 2), and its resume at dp 2 x tp 2 from
that checkpoint, both recording every sample they read (tests/dist_scripts/record_samples.py).

- the resumed run reads the same samples (source, window, tokens) and gets the same losses,
  per-source losses and validation loss (<= 1e-5);
- each step's per-source losses, weighted by their tokens, sum to the step's loss, and
  TensorBoard holds them as loss/<name>;
- val_loss computed from outside: transformers' LlamaForCausalLM with the step-2 weights
  (export-hf) over the held-out documents read straight from the shard files, the same
  windows, eval_batches 3, against the run's val_loss at step 2 (<= 1e-5);
- the training loop read no validation document and the validation no training one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import PARITY, prepare_words, torchrun

from dtensor3d.__main__ import main
from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.sources import make_source
from dtensor3d.parallel.data import sample_indices

EVAL_BATCHES, L, EOS = 3, 32, 256


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {
        "web": prepare_words(root, "web", 8, 11, val_fraction=0.15),
        "code": prepare_words(root, "code", 8, 12, val_fraction=0.3),
        "math": prepare_words(root, "math", 8, 13, val_fraction=0.3),
    }


def overrides(dirs, root: Path) -> list[str]:
    """web 3 : code 1 for steps 1-2, then code 1 : math 1; validation every 2 steps."""
    first = f"[{{path: {dirs['web']}, weight: 3}}, {{path: {dirs['code']}, weight: 1}}]"
    later = f"[{{path: {dirs['code']}, weight: 1}}, {{path: {dirs['math']}, weight: 1}}]"
    return [
        "data.kind=tokens",
        f"data.sources={first}",
        f"data.stages=[{{start_step: 3, sources: {later}}}]",
        "model.vocab_size=264",
        "training.steps=4",
        "training.micro_batch_size=2",
        "training.eval_every=2",
        f"training.eval_batches={EVAL_BATCHES}",
        f"checkpoint.dir={root / 'ck'}",
        "checkpoint.interval=2",
    ]


def run(root: Path, nproc: int, extra: list[str]) -> dict:
    script = "tests/dist_scripts/record_samples.py"
    torchrun(nproc, [script, str(root / "samples"), "train", PARITY, f"logging.run_dir={root / 'run'}", *extra])

    def reads(folder: Path) -> dict[int, tuple]:
        seen: dict[int, tuple] = {}
        for f in sorted(folder.glob("rank*.jsonl")):
            for i, window, tokens in map(json.loads, f.read_text().splitlines()):
                assert seen.setdefault(i, (window, tokens)) == (window, tokens)  # peers read the same
        return seen

    metrics = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"train": reads(root / "samples"), "val": reads(root / "samples_validation"), "metrics": metrics}


@pytest.fixture(scope="module")
def runs(dirs, tmp_path_factory):
    one, mesh = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("dp2_tp2")
    first = run(one, 1, [*overrides(dirs, one), "logging.tensorboard=true"])
    resume = [f"checkpoint.resume={one / 'ck' / 'step_00000002'}", "parallelism.dp=2", "parallelism.tp=2"]
    second = run(mesh, 4, [*overrides(dirs, mesh), *resume])
    return {"one": first, "mesh": second, "root": one, "recipe": load_recipe(PARITY, overrides(dirs, one))}


def test_the_resume_at_dp2_tp2_reads_the_same_samples_and_matches(runs):
    recipe, one, mesh = runs["recipe"], runs["one"], runs["mesh"]
    assert sorted(one["train"]) == list(range(32)) and sorted(mesh["train"]) == list(range(16, 32))
    assert all(mesh["train"][i] == one["train"][i] for i in range(16, 32))
    source = make_source(recipe)
    for i in range(32):  # the window each read names is the sampler's, for the source of its stage
        assert one["train"][i][0] == list(source.window(i))
        assert one["train"][i][0][0] in (("web", "code") if i < 16 else ("code", "math"))
    steps = {r["step"]: r for r in mesh["metrics"]}
    assert sorted(steps) == [3, 4]
    for ref in one["metrics"][2:]:
        got = steps[ref["step"]]
        keys = [k for k in ref if k.startswith(("loss", "val_loss", "grad_norm"))]
        assert set(keys) == {k for k in got if k.startswith(("loss", "val_loss", "grad_norm"))}
        for k in keys:
            assert abs(got[k] - ref[k]) <= 1e-5 * abs(ref[k]), (ref["step"], k, got[k], ref[k])
        assert got["tokens/code"] == ref["tokens/code"] and got["tokens/math"] == ref["tokens/math"]


def test_per_source_losses_sum_token_weighted_to_the_loss(runs):
    recipe, source = runs["recipe"], make_source(runs["recipe"])
    for record in runs["one"]["metrics"] + runs["mesh"]["metrics"]:
        names = [k.removeprefix("loss/") for k in record if k.startswith("loss/")]
        step = record["step"] - 1
        picked = [source.window(i)[0] for i in sample_indices(recipe, step, 0, 1)]
        assert sorted(names) == sorted(set(picked))  # the sources of this step, and only them
        assert all(record[f"tokens/{n}"] == L * picked.count(n) for n in names)
        weighted = sum(record[f"loss/{n}"] * record[f"tokens/{n}"] for n in names) / (L * len(picked))
        assert abs(weighted - record["loss"]) <= 1e-6 * record["loss"], record
        assert len(names) == 2 and record[f"loss/{names[0]}"] != record[f"loss/{names[1]}"]
    tb = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = tb.EventAccumulator(str(runs["root"] / "run" / "tensorboard"))
    acc.Reload()
    for name, steps in (("web", [1, 2]), ("code", [1, 2, 3, 4]), ("math", [3, 4])):
        events = acc.Scalars(f"loss/{name}")
        assert [e.step for e in events] == steps
        for e in events:
            want = runs["one"]["metrics"][e.step - 1][f"loss/{name}"]
            assert abs(e.value - want) <= 1e-6 * want


def held_out_windows(dirs, count: int) -> tuple[torch.Tensor, list[str]]:
    """The first `count` validation windows, from the val shards as numpy reads them: each
    source's val stream (every val shard in order) cut into windows of L + 1 tokens at L
    apart, source after source (web, code, math)."""
    rows, names = [], []
    for name in ("web", "code", "math"):
        meta = json.loads((dirs[name] / "meta.json").read_text())
        parts = [np.fromfile(dirs[name] / s["file"], dtype="<u2") for s in meta["splits"]["val"]["shards"]]
        stream = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        for w in range((len(stream) - 1) // L):
            rows.append(torch.from_numpy(stream[w * L : w * L + L + 1]))
            names.append(name)
    assert len(rows) >= count
    return torch.stack(rows[:count]), names[:count]


def test_val_loss_equals_transformers_over_the_held_out_documents(runs, dirs, tmp_path):
    transformers = pytest.importorskip("transformers")
    assert main(["export-hf", str(runs["root"] / "ck" / "step_00000002"), str(tmp_path / "hf")]) == 0
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    windows, names = held_out_windows(dirs, EVAL_BATCHES * 8)
    assert len(set(names)) >= 2, names  # the windows cross from one source's held-out documents to the next
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    got = runs["one"]["metrics"][1]["val_loss"]
    assert abs(got - want) <= 1e-5 * want, (got, want)
    assert runs["one"]["val"] and all(
        torch.equal(torch.tensor(runs["one"]["val"][j][1]), windows[j]) for j in range(24)
    )
    assert math.isclose(runs["one"]["metrics"][1]["val_ppl"], math.exp(got), rel_tol=1e-9)


def documents(path: Path, split: str) -> list[bytes]:
    """A byte-tokenized split's documents, from its token stream and document offsets."""
    meta = json.loads((path / "meta.json").read_text())
    parts = [np.fromfile(path / s["file"], dtype="<u2") for s in meta["splits"][split]["shards"]]
    stream = np.concatenate(parts) if parts else np.zeros(0, np.uint16)
    offsets = np.fromfile(path / f"{split}_docs.bin", dtype="<i8")
    return [bytes(stream[a : b - 1].astype(np.uint8)) for a, b in zip(offsets[:-1], offsets[1:])]


def pieces(tokens: list[int]) -> list[bytes]:
    """The runs of text between end-of-document tokens, those long enough (>= 12 random
    letters and spaces) to name the one document they come from."""
    out, run_ = [], []
    for t in [*tokens, EOS]:
        if t == EOS:
            if len(run_) >= 12:
                out.append(bytes(run_))
            run_ = []
        else:
            run_.append(t)
    return out


def test_training_reads_no_validation_document_and_validation_no_training_one(runs, dirs):
    train_docs = [d for p in dirs.values() for d in documents(p, "train")]
    val_docs = [d for p in dirs.values() for d in documents(p, "val")]
    assert train_docs and val_docs and not set(train_docs) & set(val_docs)
    checked = {"train": 0, "val": 0}
    for run_ in (runs["one"], runs["mesh"]):
        for split, own, other in (("train", train_docs, val_docs), ("val", val_docs, train_docs)):
            for _, tokens in run_[split].values():
                for piece in pieces(tokens):
                    assert any(piece in d for d in own) and not any(piece in d for d in other), (split, piece)
                    checked[split] += 1
    assert checked["train"] >= 48 and checked["val"] >= 24, checked


def test_a_resume_keeps_the_mixtures_begun_and_may_change_later_stages(runs, dirs, capsys):
    """From the step-2 checkpoint: the stage that begins at step 3 may change (no sample of it
    was read); data.sources, which steps 1-2 read, may not."""
    base = [a for a in overrides(dirs, runs["root"]) if not a.startswith(("data.sources", "data.stages"))]
    args = ["validate", PARITY, *base, f"checkpoint.resume={runs['root'] / 'ck' / 'step_00000002'}"]
    first = f"data.sources=[{{path: {dirs['web']}, weight: 3}}, {{path: {dirs['code']}, weight: 1}}]"
    later = f"data.stages=[{{start_step: 3, sources: [{{path: {dirs['math']}, weight: 1}}]}}]"
    assert main([*args, first, later]) == 0
    capsys.readouterr()
    other = f"data.sources=[{{path: {dirs['web']}, weight: 1}}, {{path: {dirs['code']}, weight: 1}}]"
    assert main([*args, other, later]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint") and "data.sources=" in err and err.count("\n") == 1


def test_per_source_losses_at_pp2_equal_the_1_process_run(runs, dirs, tmp_path):
    """pp 2 (1F1B): the last stage's loss calls include one of torch's shape inference in the
    first step; the per-source losses are still those of the 1-process run (<= 1e-5)."""
    extra = [
        a for a in overrides(dirs, tmp_path) if not a.startswith(("training.steps", "training.eval", "checkpoint"))
    ]
    pp2 = run(tmp_path, 2, [*extra, "training.steps=2", "training.eval_every=0", "parallelism.pp=2"])
    for got, ref in zip(pp2["metrics"], runs["one"]["metrics"][:2], strict=True):
        keys = [k for k in ref if k.startswith(("loss", "tokens/"))]
        assert keys == [k for k in got if k.startswith(("loss", "tokens/"))]
        for k in keys:
            assert abs(got[k] - ref[k]) <= 1e-5 * abs(ref[k]), (ref["step"], k, got[k], ref[k])


def test_per_source_losses_count_only_the_unmasked_targets_of_chat_data(tmp_path):
    """Two chat directories (prepare-data --chat, one tokenizer) mixed 1 : 1, one process, 2
    steps: tokens/<name> is each source's count of unmasked targets, and the per-source losses
    weighted by them sum to the loss, normalised by the step's global unmasked count."""
    from helpers import chat_rows, chat_tokenizer_dir, train_metrics, write_jsonl

    from dtensor3d.datasets.prepare import PrepareOptions, prepare
    from dtensor3d.parallel.data import IGNORE, local_batch

    tok, rows = chat_tokenizer_dir(tmp_path / "tok"), chat_rows(160)
    for name, part in (("qa", rows[:80]), ("chat", rows[80:])):
        data = write_jsonl(tmp_path / f"{name}.jsonl", part)
        prepare(PrepareOptions((str(data),), str(tmp_path / name), tokenizer=str(tok), val_fraction=0.2, chat=True))
    mix = f"data.sources=[{{path: {tmp_path / 'qa'}, weight: 1}}, {{path: {tmp_path / 'chat'}, weight: 1}}]"
    extra = ["data.kind=tokens", mix, "model.vocab_size=304", "training.steps=2", "training.micro_batch_size=2"]
    records = train_metrics(tmp_path / "run", 1, [*extra, "training.eval_every=0"])
    recipe = load_recipe(PARITY, extra)
    source = make_source(recipe)
    for record in records:
        step = record["step"] - 1
        targets = local_batch(recipe, source, step)[1]
        names = [source.window(i)[0] for i in sample_indices(recipe, step, 0, 1)]
        want = {n: int(sum((targets[k] != IGNORE).sum() for k in range(8) if names[k] == n)) for n in set(names)}
        assert {k[7:]: v for k, v in record.items() if k.startswith("tokens/")} == want
        assert sum(want.values()) < 8 * L  # the masks exclude most targets
        weighted = sum(record[f"loss/{n}"] * want[n] for n in want) / sum(want.values())
        assert abs(weighted - record["loss"]) <= 1e-6 * record["loss"], (weighted, record)
