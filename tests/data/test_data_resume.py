"""Issue 10 item 2's consequence over real text (a byte tokenizer on two stdlib files): one
process, dp 4, and a run resumed at dp 2 x tp 2 x pp 2 from the dp 4 checkpoint read the
same samples in the same order (recorded by tests/dist_scripts/record_samples.py), across
an epoch boundary, and their losses match. The checkpoint carries the data's tokenizer,
export-hf makes it loadable by transformers, and a resume refuses another data.seed."""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from helpers import PARITY, torchrun

from dtensor3d.__main__ import main
from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.sources import epoch_note
from dtensor3d.datasets.tokens import TrainWindows
from dtensor3d.parallel.data import sample_indices

STEPS, SAVED = 6, 3  # dp 4 trains steps 1-3 and saves; dp2 x tp2 x pp2 resumes for 4-6


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """this.py and struct.py, byte-tokenized: about 1.3k tokens, 39 windows of 33."""
    root = tmp_path_factory.mktemp("stdlib")
    (root / "in").mkdir()
    for name in ("this.py", "struct.py"):
        shutil.copyfile(os.path.join(sysconfig.get_paths()["stdlib"], name), root / "in" / name)
    args = ["prepare-data", str(root / "in"), "--out", str(root / "out"), "--tokenizer", "byte"]
    assert main([*args, "--val-fraction", "0", "--no-progress"]) == 0
    return root / "out"


def common(prepared) -> list[str]:
    return ["data.kind=tokens", f"data.path={prepared}", "model.vocab_size=264", "training.eval_every=0"]


def run(root: Path, name: str, nproc: int, overrides: list[str]) -> dict:
    """Train with sample recording; the records by rank, the losses by step, stdout."""
    out = root / name
    script = "tests/dist_scripts/record_samples.py"
    proc = torchrun(nproc, [script, str(out / "samples"), "train", PARITY, f"logging.run_dir={out}", *overrides])
    reads = {}
    for f in sorted((out / "samples").iterdir()):
        reads[int(f.stem[4:])] = [json.loads(line) for line in f.read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"reads": reads, "loss": {r["step"]: r["loss"] for r in metrics if "loss" in r}, "stdout": proc.stdout}


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    ck = [f"checkpoint.dir={root / 'ck'}"]
    one = run(root, "one", 1, [*common(prepared), f"training.steps={STEPS}"])
    dp4 = run(root, "dp4", 4, [*common(prepared), f"training.steps={SAVED}", "parallelism.dp=4", *ck])
    mesh = ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2"]
    resumed = run(root, "resumed", 8, [*common(prepared), f"training.steps={STEPS}", *mesh, *ck])
    return {"one": one, "dp4": dp4, "resumed": resumed, "ck": root / "ck"}


def by_sample(reads: dict) -> dict[int, tuple]:
    """Sample index -> (window, tokens) over all ranks; ranks reading one sample agree."""
    seen: dict[int, tuple] = {}
    for rows in reads.values():
        for i, window, tokens in rows:
            assert seen.setdefault(i, (window, tokens)) == (window, tokens)
    return seen


def test_same_samples_in_the_same_order_across_meshes_and_a_resume(prepared, runs):
    recipe = load_recipe(PARITY, [*common(prepared), f"training.steps={STEPS}"])
    size, windows = recipe.training.global_batch_size, TrainWindows(str(prepared), 32, 7).windows
    assert SAVED * size < windows < STEPS * size  # epoch 1 begins in the resumed part
    one, dp4, resumed = (runs[k]["reads"] for k in ("one", "dp4", "resumed"))
    assert [row[0] for row in one[0]] == list(range(STEPS * size))  # one process: 0, 1, 2, ... in order
    for r in range(4):  # dp 4: rank r reads its share of each global batch, in order
        want = [i for s in range(SAVED) for i in sample_indices(recipe, s, r, 4)]
        assert [row[0] for row in dp4[r]] == want
    assert sorted(resumed) == list(range(8))
    for r in range(8):  # rank = pp * 4 + dp * 2 + tp: its dp coordinate picks the share
        want = [i for s in range(SAVED, STEPS) for i in sample_indices(recipe, s, (r // 2) % 2, 2)]
        assert [row[0] for row in resumed[r]] == want
    whole, first, second = by_sample(one), by_sample(dp4), by_sample(resumed)
    assert sorted(first) == list(range(SAVED * size)) and sorted(second) == list(range(SAVED * size, STEPS * size))
    assert {**first, **second} == whole  # the same window ids and the same tokens for every sample
    assert sorted(whole[i][0] for i in range(windows)) == list(range(windows))  # epoch 0: each window once
    epoch1 = [whole[i][0] for i in range(windows, STEPS * size)]
    assert epoch1 != [whole[i][0] for i in range(STEPS * size - windows)]  # a fresh order, not a repeat
    losses = [runs["one"]["loss"], {**runs["dp4"]["loss"], **runs["resumed"]["loss"]}]
    assert sorted(losses[0]) == sorted(losses[1]) == list(range(1, STEPS + 1))
    ref, got = (np.array([d[s] for s in range(1, STEPS + 1)]) for d in losses)
    assert ref[0] > 5.0  # a fresh model over 264 ids: about ln 264
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=0)


def test_a_new_epoch_is_announced_once(prepared, runs):
    windows = TrainWindows(str(prepared), 32, 7).windows
    line = f"data: epoch 1 begins at sample {windows} (step {windows // 8 + 1})"
    assert runs["one"]["stdout"].count(line) == 1 and runs["resumed"]["stdout"].count(line) == 1
    assert "data: epoch" not in runs["dp4"]["stdout"]


def test_epoch_note_names_every_epoch_a_batch_enters(prepared):
    recipe = load_recipe(PARITY, [*common(prepared), "training.global_batch_size=100"])
    source = TrainWindows(str(prepared), 32, 7)
    w = source.windows
    notes = [epoch_note(source, recipe, s) for s in range(3)]
    starts = [e * w for e in range(1, 300 // w + 1)]
    assert "\n".join(n for n in notes if n).count("data: epoch") == len(starts) and notes[0] is not None
    assert all(f"begins at sample {x} (step {x // 100 + 1})" in "\n".join(filter(None, notes)) for x in starts)
    assert epoch_note(lambda i: None, recipe, 5) is None  # synthetic data: no epochs


def test_checkpoint_carries_the_tokenizer_and_export_loads_in_transformers(prepared, runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    step = runs["ck"] / "step_00000003"
    assert (step / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()
    assert "tokenizer.json" in json.loads((step / "manifest.json").read_text())["files"]
    assert main(["export-hf", str(step), str(tmp_path / "hf")]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def f(x):\n    return x  # é\n"
    assert tok(text)["input_ids"] == list(text.encode()) and tok.decode(list(text.encode())) == text
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 256 and tok.model_max_length == 64


def test_resume_refuses_another_data_seed(prepared, runs, capsys):
    args = ["validate", PARITY, *common(prepared), "training.steps=8", f"checkpoint.dir={runs['ck']}"]
    assert main([*args, "parallelism.dp=2", "data.seed=7"]) == 0  # null was training.seed 7: the same order
    capsys.readouterr()
    assert main([*args, "data.seed=99"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "data.seed=7" in err and "99" in err and err.count("\n") == 1
