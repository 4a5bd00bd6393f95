"""The token dataset over a prepared directory: the seeded window permutation, samples as a
pure function of (seed, i), the validation windows, and training on it at two meshes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import PARITY, train_metrics

from dtensor3d.__main__ import main
from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.sources import make_source
from dtensor3d.datasets.tokens import FeistelPermutation, TokenStream, TrainWindows, read_meta


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A byte-level prepared directory of ~6k tokens in shards of 1000 tokens."""
    root = tmp_path_factory.mktemp("data")
    for i in range(60):
        (root / "in").mkdir(exist_ok=True)
        (root / "in" / f"{i:02d}.txt").write_text(
            "".join(f"line {j} of file {i}: {'ab' * (j % 5)}\n" for j in range(8))
        )
    out = root / "out"
    args = ["prepare-data", str(root / "in"), "--out", str(out), "--tokenizer", "byte", "--val-fraction", "0.2"]
    assert main([*args, "--shard-tokens", "1000", "--no-progress"]) == 0
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 1000, 4097])
def test_feistel_is_a_bijection_and_differs_per_epoch(n):
    perms = [[FeistelPermutation(n, 5, e)(j) for j in range(n)] for e in range(2)]
    assert sorted(perms[0]) == sorted(perms[1]) == list(range(n))
    if n >= 17:
        assert perms[0] != perms[1] and perms[0] != list(range(n))
        assert perms[0] != [FeistelPermutation(n, 6, 0)(j) for j in range(n)]  # another seed


def test_stream_reads_across_shards(prepared):
    meta = read_meta(str(prepared))
    stream = TokenStream(str(prepared), meta, "train")
    whole = np.concatenate([np.fromfile(prepared / s["file"], "<u2") for s in meta["splits"]["train"]["shards"]])
    assert len(meta["splits"]["train"]["shards"]) > 3 and stream.tokens == len(whole)
    for start, length in [(0, 10), (995, 10), (990, 2020), (len(whole) - 5, 5)]:
        assert np.array_equal(stream.read(start, length), whole[start : start + length])


def test_samples_are_a_pure_function_of_seed_and_index(prepared):
    recipe = load_recipe(PARITY, ["data.kind=tokens", f"data.path={prepared}", "model.vocab_size=264"])
    source, again = make_source(recipe), make_source(recipe)
    L, W = recipe.training.sequence_length, source.windows
    stream = source.stream
    epoch0 = [source.window(i) for i in range(W)]
    assert sorted(epoch0) == list(range(W))  # every window once per epoch
    assert [source.window(i) for i in range(W, 2 * W)] != epoch0  # a fresh order next epoch
    for i in [3 * W + 1, 5, 0, W - 1, 2 * W + 7]:  # any order of access, a fresh object
        sample = source(i)
        assert sample.dtype == torch.int64 and sample.shape == (L + 1,)
        assert torch.equal(sample, again(i))
        assert np.array_equal(sample.numpy(), stream.read(source.window(i) * L, L + 1))
    other = make_source(
        load_recipe(PARITY, ["data.kind=tokens", f"data.path={prepared}", "model.vocab_size=264", "data.seed=99"])
    )
    assert [other.window(i) for i in range(W)] != epoch0


def test_validation_windows_are_the_val_split_in_order(prepared):
    recipe = load_recipe(PARITY, ["data.kind=tokens", f"data.path={prepared}", "model.vocab_size=264"])
    val, L = make_source(recipe, "validation"), recipe.training.sequence_length
    meta = read_meta(str(prepared))
    assert val.count == (meta["splits"]["val"]["tokens"] - 1) // L >= 1
    for j in (0, 1, val.count - 1):
        assert np.array_equal(val(j).numpy(), val.stream.read(j * L, L + 1))
    assert torch.equal(val(val.count), val(0))  # j mod count
    assert TrainWindows(str(prepared), L, 0).stream.tokens == meta["splits"]["train"]["tokens"]


def test_training_on_a_prepared_directory_matches_across_meshes(prepared, tmp_path):
    """The same sample ids at 1 process and at dp 2 x tp 2: the losses agree."""
    data = [
        "data.kind=tokens",
        f"data.path={prepared}",
        "model.vocab_size=264",
        "training.steps=4",
        "training.eval_every=2",
    ]
    one = train_metrics(tmp_path / "one", 1, data)
    four = train_metrics(tmp_path / "four", 4, [*data, "parallelism.dp=2", "parallelism.tp=2"])
    losses = [[r["loss"] for r in run if "loss" in r] for run in (one, four)]
    assert len(losses[0]) == 4 and losses[0][0] > 5.0  # a fresh model over 264 ids: about ln 264
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    vals = [[r["val_loss"] for r in run if "val_loss" in r] for run in (one, four)]
    assert len(vals[0]) == 2
    np.testing.assert_allclose(vals[1], vals[0], rtol=1e-5)
