"""Issue 22 item 2 at the sampler level (one process, no ranks): data.sources mixes prepared
directories in exact proportions over every block of samples, data.stages switches the
mixture at a step, and sample i is the same whichever ranks read it and in whatever order
(1 process, dp 4, dp 2 x tp 2, a resume). Item 6: a wrong mixture is one `error:` line
naming the key or file, exit 2, before any process starts."""

from __future__ import annotations

import subprocess
from collections import Counter

import numpy as np
import pytest
import torch
from helpers import PARITY, cli, cli_process, one_error_line, prepare_words

from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.mixture import integer_weights
from dtensor3d.datasets.sources import make_source
from dtensor3d.datasets.tokens import TrainWindows
from dtensor3d.parallel.data import local_batch, sample_indices

NO_EVAL = ("data.kind=tokens", "training.eval_every=0")
STAGE_STEP = 60  # the second mixture begins at step 60: sample 59 * 8 = 472


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    return {name: prepare_words(root, name, 12, seed) for seed, name in enumerate(("web", "code", "math"))}


def mixture(dirs, *extra: str) -> list[str]:
    """Overrides: web 0.5, code 0.3, math 0.2 until step 59, then code 1 : math 3."""
    web, code, math = (f"{{path: {dirs[n]}, weight: {w}}}" for n, w in (("web", 0.5), ("code", 0.3), ("math", 0.2)))
    first = f"[{web}, {code}, {math}]"
    later = f"[{{path: {dirs['code']}, weight: 1}}, {{path: {dirs['math']}, weight: 3}}]"
    return [
        "data.kind=tokens",
        f"data.sources={first}",
        f"data.stages=[{{start_step: {STAGE_STEP}, sources: {later}}}]",
        "model.vocab_size=264",
        "training.eval_every=0",
        *extra,
    ]


def test_integer_weights_keep_the_exact_proportion():
    assert integer_weights([0.7, 0.2, 0.1]) == [7, 2, 1]
    assert integer_weights([0.5, 0.3, 0.2]) == [5, 3, 2]
    assert integer_weights([3, 3]) == [1, 1] and integer_weights([2.5, 0.5]) == [5, 1]
    assert integer_weights([1 / 3, 2 / 3]) == [1, 2]
    # Issue 43 item 1: a small weight is not rounded away (was [0, 999, 998] and [0, 1]).
    assert integer_weights([0.0004, 0.5, 0.4996]) == [1, 1250, 1249]
    assert integer_weights([0.0001, 0.9999]) == [1, 9999]


FOUR_ORDERS = (("web", 1.0), ("code", 0.1), ("math", 0.01), ("web2", 0.001), ("code2", 0.0001))


def test_weights_over_four_orders_of_magnitude_get_their_tokens(dirs):
    """Issue 43 item 1: weights 1 .. 0.0001 (5 sources, 3 directories under 5 names): over
    3 blocks (33,333 samples: 4,167 steps of 8) each source's tokens are exactly its weight's
    share; over the first 500 steps (4,000 samples, a third of a block) within sampling error."""
    entries = [f"{{path: {dirs[n.rstrip('2')]}, weight: {w}, name: {n}}}" for n, w in FOUR_ORDERS]
    recipe = load_recipe(PARITY, ["data.kind=tokens", sources(*entries), "model.vocab_size=264"])
    source, length = make_source(recipe), recipe.training.sequence_length
    assert source.counts == [[10000, 1000, 100, 10, 1]]
    picks = [source.pick(i)[0].name for i in range(3 * 11111)]
    tokens = Counter({name: length * n for name, n in Counter(picks).items()})
    total = sum(w for _, w in FOUR_ORDERS)
    for name, w in FOUR_ORDERS:
        assert tokens[name] == 3 * length * round(11111 * w / total), (name, tokens[name])
        assert abs(tokens[name] / tokens.total() - w / total) < 1e-12
    first = Counter(picks[:4000])  # hypergeometric: within 4 standard deviations
    for name, w in FOUR_ORDERS:
        share = w / total
        assert abs(first[name] - 4000 * share) <= 4 * (4000 * share * (1 - share)) ** 0.5 + 1, (name, first)


def test_weights_no_exact_block_holds_are_honoured_to_a_thousandth(dirs):
    """Weights whose exact block is too large (1/7, 1/11, 1e-4 with lcm 770,000 x ...) get the
    smallest block found that honours each to 0.1%; weights no block of 10^6 can honour are one
    error line naming the source and the smallest weight that can be."""
    weights = [1 / 7, 1 / 11, 1 / 13, 0.0001]
    counts = integer_weights(weights)
    assert counts is not None and min(counts) >= 1 and sum(counts) <= 10**6
    for c, w in zip(counts, weights):
        assert abs(c / sum(counts) - w / sum(weights)) <= 1e-3 * w / sum(weights), (counts, weights)
    assert integer_weights([1e-7, 1.0]) is None
    web, code = f"{{path: {dirs['web']}, weight: 1e-7}}", f"{{path: {dirs['code']}}}"
    line = refused_line("data.kind=tokens", "training.eval_every=0", sources(web, code))
    assert "data.sources[0].weight=1e-07" in line and "'web'" in line, line
    assert "smallest weight that can be honoured there is 1.1e-06" in line, line
    fixed = f"{{path: {dirs['web']}, weight: 1.1e-6}}"
    ok = cli("validate", PARITY, "model.vocab_size=320", *NO_EVAL, sources(fixed, code))
    assert ok.returncode == 0, ok.stderr


def test_each_source_takes_its_weight_exactly_in_every_block(dirs):
    recipe = load_recipe(PARITY, mixture(dirs, "training.steps=200"))
    source = make_source(recipe)
    names = [source.window(i)[0] for i in range(1000)]
    switch = (STAGE_STEP - 1) * 8
    for b in range(switch // 10):  # blocks of 10 from sample 0: 5 web, 3 code, 2 math
        assert Counter(names[10 * b : 10 * b + 10]) == {"web": 5, "code": 3, "math": 2}, b
    for b in range((1000 - switch) // 4):  # blocks of 4 from the stage's first sample: 1 code, 3 math
        assert Counter(names[switch + 4 * b : switch + 4 * b + 4]) == {"code": 1, "math": 3}, b
    assert names[:20] != sorted(names[:20]) and names[:10] != names[10:20]  # shuffled, and not one fixed order
    # No draw of a source twice: within each source's first epoch, every window once.
    picks = [source.pick(i) for i in range(1000)]
    draws = [(s.name, d) for s, d in picks]
    assert len(set(draws)) == len(draws)
    for name in ("web", "code", "math"):
        windows = TrainWindows(str(dirs[name]), 32, 0).windows
        seen = [source.window(i)[1] for i, (s, d) in enumerate(picks) if s.name == name and d < windows]
        assert len(seen) == len(set(seen)), name
    # The tokens are that source's window, read straight from its shard file.
    for i in (7, 500, 999):
        name, w = source.window(i)
        tokens = np.fromfile(dirs[name] / "train_00000.bin", dtype="<u2").astype(np.int64)
        assert source(i).tolist() == tokens[w * 32 : w * 32 + 33].tolist()


@pytest.mark.parametrize("mesh", [(1, 1), (4, 1), (2, 2)], ids=["1_process", "dp4", "dp2_tp2"])
def test_the_same_samples_at_any_mesh_and_after_a_resume(dirs, mesh):
    """Each rank (a fresh sampler, as in its own process) reads its share of global batches
    55..64 (the stage switch inside); together they read exactly the 1-process batches; a
    sampler made at step 60 (a resume) reads the same."""
    dp, tp = mesh
    recipe = load_recipe(PARITY, mixture(dirs, "training.steps=64", f"parallelism.dp={dp}", f"parallelism.tp={tp}"))
    whole = make_source(recipe)
    want = {i: whole(i) for i in range(54 * 8, 64 * 8)}
    got: dict[int, torch.Tensor] = {}
    for rank in range(dp * tp):
        source = make_source(recipe)  # each rank's own
        for step in range(54, 64):
            inputs, targets = local_batch(recipe, source, step, rank // tp, dp)
            assert inputs.shape[0] == 8 // dp
            for i, row in zip(sample_indices(recipe, step, rank // tp, dp), targets):
                assert got.setdefault(i, row).equal(row)  # tp peers read the same rows
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[i], want[i][1:]) for i in want)
    resumed = make_source(recipe)
    assert all(torch.equal(resumed(i), want[i]) for i in sorted(want, reverse=True))  # backwards, from a fresh one


# ---------------------------------------------------------------- bad input, item 6
@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """A directory of text under a trained BPE tokenizer (vocabulary 300), not the byte one."""
    from dtensor3d.__main__ import main

    root = tmp_path_factory.mktemp("bpe")
    (root / "text").mkdir()
    for d in range(6):
        (root / "text" / f"{d}.txt").write_text(f"document {d} " * 200)
    args = ["prepare-data", str(root / "text"), "--out", str(root / "bpe"), "--train-tokenizer", "300"]
    assert main([*args, "--no-progress"]) == 0
    return root / "bpe"


def refused_line(*overrides: str) -> str:
    return one_error_line(cli("validate", PARITY, "model.vocab_size=320", *overrides))


def sources(*entries: str) -> str:
    return "data.sources=[" + ", ".join(entries) + "]"


def test_bad_mixtures_are_one_error_line_naming_the_key(dirs, other_tokenizer, tmp_path):
    web, code = f"{{path: {dirs['web']}}}", f"{{path: {dirs['code']}}}"
    cases = [
        ([sources(web, f"{{path: {tmp_path / 'nowhere'}}}")], ["data.sources[1].path", "nowhere", "no such directory"]),
        (
            [sources(web, f"{{path: {other_tokenizer}}}")],
            ["data.sources[1].path", "bpe", "tokenizer", "data.sources[0]"],
        ),
        ([sources(f"{{path: {dirs['web']}, weight: 0}}", code)], ["data.sources[0].weight=0", "positive number"]),
        ([sources(web, f"{{path: {dirs['code']}, weight: -1.5}}")], ["data.sources[1].weight=-1.5"]),
        ([sources(f"{{path: {dirs['web']}, weight: heavy}}", code)], ["data.sources[0].weight='heavy'"]),
        (
            [sources(f"{{path: {dirs['web']}, name: a}}", f"{{path: {dirs['code']}, name: a}}")],
            ["data.sources[1].name='a'", "data.sources[0]"],
        ),
        ([sources(web, f"{{path: {dirs['code']}, wieght: 2}}")], ["data.sources[1].wieght: unknown key", "weight"]),
        (
            [sources(web), f"data.stages=[{{start_step: 5, sources: [{code}]}}, {{start_step: 3, sources: [{web}]}}]"],
            ["data.stages[1].start_step=3", "data.stages[0].start_step=5"],
        ),
        ([sources(web), f"data.stages=[{{start_step: 0, sources: [{code}]}}]"], ["data.stages[0].start_step=0"]),
        (
            [
                sources(f"{{path: {dirs['web']}, name: x}}"),
                f"data.stages=[{{start_step: 3, sources: [{{path: {dirs['code']}, name: x}}]}}]",
            ],
            ["data.stages[0].sources[0]", "name 'x'", "one directory"],
        ),
        ([sources(web), f"data.path={dirs['code']}"], ["data.path", "data.sources", "give one"]),
        ([sources(f"{{path: {dirs['web']}, name: val}}")], ["data.sources[0].name='val'", "loss/<name>"]),
    ]
    for overrides, needles in cases:
        line = refused_line("data.kind=tokens", "training.eval_every=0", *overrides)
        assert all(n in line for n in needles), (needles, line)
    # data.kind synthetic with sources: named.
    line = refused_line(sources(web), "training.eval_every=0")
    assert "data.kind" in line and "tokens" in line


def test_a_bad_mixture_stops_train_before_any_process_starts(dirs, tmp_path):
    run_dir = tmp_path / "run"
    weights = sources(f"{{path: {dirs['web']}}}", f"{{path: {tmp_path / 'gone'}}}")
    proc = cli_process(
        "train", PARITY, "data.kind=tokens", weights, "model.vocab_size=264", f"logging.run_dir={run_dir}"
    )
    line = one_error_line(proc)
    assert "data.sources[1].path" in line and "gone" in line
    assert not run_dir.exists()


def test_data_path_then_stages(dirs):
    """data.path is the first mixture (one source, named after its directory) until the first stage."""
    stage = f"data.stages=[{{start_step: 3, sources: [{{path: {dirs['web']}}}, {{path: {dirs['math']}, weight: 3}}]}}]"
    recipe = load_recipe(PARITY, ["data.kind=tokens", f"data.path={dirs['web']}", stage, "model.vocab_size=264"])
    source = make_source(recipe)
    names = [source.window(i)[0] for i in range(40)]
    assert names[:16] == ["web"] * 16 and Counter(names[16:]) == {"web": 6, "math": 18}
    # web continues its own order: the stage's web draws are not the ones steps 1-2 read.
    draws = [source.pick(i) for i in range(40)]
    web = [d for s, d in draws if s.name == "web"]
    assert len(web) == len(set(web)) and min(d for s, d in draws[16:] if s.name == "web") >= 16


def test_a_mixture_without_validation_windows_is_refused_when_evaluating(dirs, tmp_path):
    from dtensor3d.__main__ import main

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "one.txt").write_text("a b c " * 300)
    args = ["prepare-data", str(tmp_path / "text"), "--out", str(tmp_path / "noval"), "--tokenizer", "byte"]
    assert main([*args, "--val-fraction", "0", "--no-progress"]) == 0
    both = sources(f"{{path: {tmp_path / 'noval'}}}")
    line = one_error_line(cli("validate", PARITY, "data.kind=tokens", both, "model.vocab_size=264"))
    assert "data.validation=split" in line and "training.eval_every: 0" in line
    assert (
        cli("validate", PARITY, "data.kind=tokens", both, "model.vocab_size=264", "training.eval_every=0").returncode
        == 0
    )


def test_a_weight_of_one_in_ten_thousand_through_prepare_data_and_validate(tmp_path):
    """Issue 43 item 1 at the door, as a user runs it: two directories from prepare-data, then
    validate: 0.0001 / 0.9999 passes (a block of 10,000: 1 + 9,999), 1e-7 is one error line."""
    for name in ("rare", "common"):
        (tmp_path / f"{name}.txt").write_text(f"{name} text, some words of it. " * 200)
        proc = cli_process("prepare-data", str(tmp_path / f"{name}.txt"), "--out", str(tmp_path / name),
                           "--tokenizer", "byte", "--no-progress")  # fmt: skip
        assert proc.returncode == 0, proc.stderr

    def validate(rare: str) -> subprocess.CompletedProcess:
        common = f"{{path: {tmp_path / 'common'}, weight: 0.9999}}"
        mix = sources(f"{{path: {tmp_path / 'rare'}, weight: {rare}}}", common)
        return cli_process("validate", PARITY, "data.kind=tokens", mix, "model.vocab_size=264", "training.eval_every=0")

    assert validate("0.0001").returncode == 0
    line = one_error_line(validate("1e-7"))
    assert "data.sources[0].weight=1e-07" in line and "'rare'" in line and "smallest weight" in line, line


# ---------------------------------------------------------------- issue 43 items 6-9, at the door
def test_a_broken_source_is_named_by_its_key_and_name(dirs, tmp_path):
    """Item 6: errors about a mixture source named data.path; they name data.sources[i].path
    and the source's name (a truncated shard, a directory without meta.json)."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(dirs["code"], broken)
    shard = broken / "train_00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    (tmp_path / "empty").mkdir()
    web = f"{{path: {dirs['web']}}}"
    for bad, needle in (
        (f"{{path: {broken}, name: code}}", "bytes, but meta.json records"),
        (f"{{path: {tmp_path / 'empty'}}}", "no meta.json"),
    ):
        line = refused_line(*NO_EVAL, sources(web, bad))
        assert "data.path" not in line and "data.sources[1].path" in line and "(source '" in line, line
        assert needle in line, line
    stage = f"data.stages=[{{start_step: 3, sources: [{{path: {broken}, name: code}}]}}]"
    proc = cli_process("validate", PARITY, "model.vocab_size=320", *NO_EVAL, sources(web), stage)  # as a user runs it
    line = one_error_line(proc)
    assert "data.stages[0].sources[0].path" in line and "(source 'code')" in line, line


def test_a_stage_past_the_last_step_is_one_warning(dirs):
    """Item 7: a stage beginning after training.steps never runs: validate passes with one
    `warning:` line naming it."""
    stage = f"data.stages=[{{start_step: 900, sources: [{{path: {dirs['code']}}}]}}]"
    proc = cli_process("validate", PARITY, *NO_EVAL, sources(f"{{path: {dirs['web']}}}"), stage, "model.vocab_size=264")
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1, proc.stderr
    assert "data.stages[0].start_step=900 past training.steps=10: never begins" in warnings[0], warnings


def test_empty_lists_and_none_where_they_mean_none(dirs):
    """Items 8 and 9: data.stages=[] and data.sources=[] are none (as null); data.validation=none
    (or null) is no validation: validate passes with eval_every 5 and one warning; training
    evaluates nothing."""
    from dtensor3d.training.evaluate import eval_due

    emptied = [*NO_EVAL, f"data.path={dirs['web']}", "data.stages=[]", "data.sources=[]"]
    recipe = load_recipe(PARITY, emptied)
    assert recipe.data.stages is None and recipe.data.sources is None
    proc = cli_process("validate", PARITY, *emptied, "model.vocab_size=264")
    assert proc.returncode == 0 and "error" not in proc.stderr, proc.stderr
    for none in ("none", "null", "None"):
        recipe = load_recipe(PARITY, ["data.kind=tokens", f"data.path={dirs['web']}", f"data.validation={none}"])
        assert recipe.data.validation is None and not any(eval_due(recipe, s) for s in range(1, 11))
    proc = cli_process("validate", PARITY, "data.kind=tokens", f"data.path={dirs['web']}", "data.validation=none",
                       "model.vocab_size=264")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("warning:") == 1 and "data.validation=null: no validation windows" in proc.stderr
