"""nanotron configs: a config in nanotron's published format is mapped field by field onto a
recipe (recognised by load_recipe, so train / plan / validate / launch.sh take it), refused
with one `error:` line where it would change the maths, and trains to exactly the losses of
the same recipe written natively, at 1 process and on a tp=2 mesh."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import cli_process, scheduled_lr, torchrun

from dtensor3d.config import nanotron
from dtensor3d.config.load import load_recipe, recipe_from_dict
from dtensor3d.errors import RecipeError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "tests" / "nanotron_configs" / "small_llama.yaml")
LR = "optimizer.learning_rate_scheduler"
MC = "model.model_config"
# Shrinks small_llama.yaml (hidden 1024, 12 layers, dp 2 x tp 4) to a few CPU steps, in nanotron's spelling.
SHRINK = [
    f"{MC}.hidden_size=64",
    f"{MC}.intermediate_size=128",
    f"{MC}.num_hidden_layers=2",
    f"{MC}.num_attention_heads=4",
    f"{MC}.num_key_value_heads=2",
    f"{MC}.max_position_embeddings=64",
    f"{MC}.vocab_size=250",  # padded to 256: make_vocab_size_divisible_by 8 x tp
    "model.make_vocab_size_divisible_by=8",
    "model.dtype=float32",
    "tokens.sequence_length=32",
    "tokens.micro_batch_size=1",
    "tokens.batch_accumulation_per_replica=2",
    "tokens.train_steps=4",
    f"{LR}.lr_warmup_steps=1",
    f"{LR}.lr_decay_steps=3",
    "parallelism.dp=1",
    "parallelism.tp=1",
]
# What SHRINK + small_llama.yaml means, written as a recipe by hand.
NATIVE = {
    "model": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "parallelism": {
        "dp": 1,
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "ep": 1,
        "pp_engine": "1f1b",
        "tp_mode": "REDUCE_SCATTER",
        "tp_linear_async_communication": True,
        "recompute_layer": False,
        "dp_mode": "shard",
    },
    "training": {
        "steps": 4,
        "seed": 1234,
        "sequence_length": 32,
        "global_batch_size": 2,
        "micro_batch_size": 1,
        "dtype": "float32",
    },
    "optimizer": {
        "lr": 3e-4,
        "weight_decay": 0.0,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "clip_grad": 1.0,
        "warmup_steps": 1,
        "decay": "cosine",
        "min_lr": 3e-5,
        "decay_steps": 3,
    },
    "data": {"kind": "synthetic"},
    "checkpoint": {"dir": "checkpoints/small_llama", "interval": 500, "resume": "auto"},
    "logging": {"every": 1},
}


def raw_config() -> dict:
    with open(CONFIG) as f:
        return yaml.safe_load(f)


def shrink(*extra: str) -> list[str]:
    """SHRINK with `extra` replacing or adding keys (a key is given once on a command line)."""
    given = dict(text.split("=", 1) for text in SHRINK) | dict(text.split("=", 1) for text in extra)
    return [f"{k}={v}" for k, v in given.items()]


def convert(raw: dict, overrides: list[str]):
    """(Recipe, Conversion) of a nanotron config, as load_recipe builds it."""
    conv = nanotron.convert(raw, overrides)
    return recipe_from_dict(conv.fields, conv.recipe_overrides, strict=True), conv


def test_every_field_maps_onto_the_native_recipe():
    recipe, conv = convert(raw_config(), SHRINK)
    assert recipe == recipe_from_dict(NATIVE)
    assert conv.sources["training.global_batch_size"].startswith("tokens.micro_batch_size * batch_accumulation")
    assert "padded to a multiple of make_vocab_size_divisible_by*tp = 8" in conv.sources["model.vocab_size"]
    assert conv.sources["training.steps"] == "tokens.train_steps (override)"
    assert "general.project" in conv.ignored and "tokenizer.tokenizer_name_or_path" in conv.ignored
    assert not any(key.startswith("general.step") for key in conv.ignored)  # null values are not listed


def test_profiler_schedule_maps_onto_profile_steps():
    prof = ["profiler.profiler_export_path=./tb_logs", "profiler.skip_first=1", "profiler.active=2"]
    # 0-based: step 0 skipped, 1 wait, 2 warmup, 3 and 4 recorded: 1-based steps 4 and 5.
    recipe, _ = convert(raw_config(), shrink(*prof, "tokens.train_steps=6", f"{LR}.lr_decay_steps=5"))
    assert recipe.logging.profile_steps == (4, 5)
    assert convert(raw_config(), SHRINK)[0].logging.profile_steps is None  # profiler: null
    # Past a shortened tokens.train_steps (issue 43 item 17): a warning, and what the run reaches is profiled.
    recipe, conv = convert(raw_config(), shrink(*prof))
    assert recipe.logging.profile_steps == (4, 4)
    assert any("profiles steps 4..5, past tokens.train_steps=4: only steps 4..4" in a for a in conv.approximated)
    recipe, conv = convert(raw_config(), shrink(*prof, "profiler.skip_first=5"))
    assert recipe.logging.profile_steps is None
    assert any("past tokens.train_steps=4: nothing is profiled" in a for a in conv.approximated)


def test_overrides_in_either_spelling():
    nano, _ = convert(
        raw_config(), shrink(f"{LR}.learning_rate=0.002", "tokens.train_steps=6", f"{LR}.lr_decay_steps=5")
    )
    base = [text for text in shrink(f"{LR}.lr_decay_steps=5") if not text.startswith("tokens.train_steps=")]
    native, conv = convert(raw_config(), base + ["optimizer.lr=0.002", "training.steps=6"])
    assert nano == native and native.optimizer.lr == 0.002 and native.training.steps == 6
    assert conv.sources["optimizer.lr"] == "optimizer.learning_rate_scheduler.learning_rate (override)"
    assert (
        convert(raw_config(), shrink("logging.run_dir=r"))[1].sources["logging.run_dir"] == "override logging.run_dir=r"
    )
    # tp in nanotron's spelling re-pads the vocabulary (250 -> a multiple of 100 * 2) as nanotron would.
    tp2, _ = convert(raw_config(), shrink("parallelism.tp=2", "model.make_vocab_size_divisible_by=100"))
    assert tp2.model.vocab_size == 400 and tp2.parallelism.tp == 2
    # One key, two spellings or twice: refused, as in a file.
    for twice in (["training.steps=6", "tokens.train_steps=6"], ["tokens.train_steps=5", "tokens.train_steps=6"]):
        with pytest.raises(RecipeError, match="tokens.train_steps is also set by"):
            convert(raw_config(), shrink(*twice[:1]) + twice[1:])


@pytest.mark.parametrize(
    "overrides, expect",
    [
        (
            [f"{MC}.hidden_act=gelu", f"{MC}.rope_scaling={{type: linear, factor: 2.0}}"],
            ["hidden_act='gelu'", "rope_scaling="],
        ),
        (["optimizer.optimizer_factory.name=sgd", f"{MC}.attention_bias=true"], ["name='sgd'", "attention_bias=True"]),
        ([f"{LR}.lr_decay_style=inverse_sqrt"], ["lr_decay_style='inverse_sqrt'", "valid: cosine, linear, 1-sqrt"]),
        ([f"{LR}.lr_decay_starting_step=0"], ["lr_decay_starting_step=0", "lr_warmup_steps=1"]),
        ([f"{LR}.lr_decay_steps=0"], ["lr_decay_steps=0", ">= 1"]),
        (["model.dtype=float16"], ["model.dtype='float16'"]),
        (["data_stages.0.data.dataset={hf_dataset_or_datasets: stas/openwebtext-10k}"], ["prepare-data"]),
        ([f"{MC}.hiden_size=3"], ["hiden_size", "did you mean 'hidden_size'"]),
    ],
)
def test_refused_with_one_error_line(overrides, expect):
    proc = cli_process("validate", CONFIG, *shrink(*overrides))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for text in expect:
        assert text in lines[0]


def test_unknown_key_in_the_file(tmp_path):
    raw = raw_config()
    raw["tokens"]["train_step"] = 3
    raw["general"]["projekt"] = "x"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(
        RecipeError,
        match=r"unknown keys general.projekt \(did you mean 'project'\?\), "
        r"tokens.train_step \(did you mean 'train_steps'\?\)$",
    ):
        load_recipe(str(path))


def test_data_override_in_recipe_spelling_replaces_the_stage(tmp_path):
    tokens = tmp_path / "ids.bin"
    tokens.write_bytes(bytes(4000))
    hf = "data_stages.0.data.dataset={hf_dataset_or_datasets: stas/openwebtext-10k}"
    recipe, _ = convert(raw_config(), shrink(hf, "data.kind=tokens", f"data.path={tokens}"))
    assert recipe.data.kind == "tokens" and recipe.data.path == str(tokens)


def test_convert_prints_a_commented_recipe_that_loads_as_the_same(tmp_path):
    proc = cli_process("convert-nanotron", CONFIG, *SHRINK, "logging.run_dir=runs/x")
    assert proc.returncode == 0, proc.stderr
    warning = proc.stderr.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("warning: ") and "general.project" in warning[0]
    body = [line for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert body and all("  # " in line for line in body)  # a comment on every field
    assert "  steps: 4  # tokens.train_steps (override)" in proc.stdout
    out = tmp_path / "recipe.yaml"
    out.write_text(proc.stdout)
    assert load_recipe(str(out)) == load_recipe(CONFIG, SHRINK + ["logging.run_dir=runs/x"])
    assert cli_process("convert-nanotron", str(out)).returncode == 2  # a recipe is not a nanotron config


def test_validate_and_plan_take_a_nanotron_config():
    proc = cli_process("validate", CONFIG)
    assert proc.returncode == 0 and proc.stdout.strip() == "8", proc.stderr  # dp 2 x tp 4
    assert len(proc.stderr.strip().splitlines()) == 1  # the warning, once
    proc = cli_process("plan", CONFIG, "--json", "parallelism.context_parallel_size=2")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["dims"] == {"ep": 1, "pp": 1, "dp": 2, "cp": 2, "tp": 4}


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_trains_like_the_native_recipe_at_world_1(tmp_path):
    native = tmp_path / "native.yaml"
    native.write_text(yaml.safe_dump(NATIVE))
    common = ["training.device=cpu", f"checkpoint.dir={tmp_path / 'ck'}"]
    # A profiler schedule (steps 4..5) past the shortened train_steps=4: one warning line, and it runs (item 17).
    prof = ["profiler.profiler_export_path=./tb_logs", "profiler.skip_first=1", "profiler.active=2"]
    proc = cli_process(
        "train", CONFIG, *shrink(*prof), *common, "checkpoint.resume=none", f"logging.run_dir={tmp_path / 'a'}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "past tokens.train_steps=4: only steps 4..4" in warnings[0], warnings
    assert (tmp_path / "a" / "profile" / "trace_rank0.json").is_file()
    proc = cli_process("train", str(native), *common, "checkpoint.resume=none", f"logging.run_dir={tmp_path / 'b'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(a) == 4 and a == b and a[-1] < a[0]


def test_trains_like_the_native_recipe_on_tp2(tmp_path):
    """launch.sh takes the nanotron config (2 processes from its tp=2); torchrun the recipe."""
    native = tmp_path / "native.yaml"
    native.write_text(yaml.safe_dump(NATIVE))
    mesh = ["parallelism.tp=2", "training.device=cpu", "checkpoint.resume=none", f"checkpoint.dir={tmp_path / 'ck'}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    launch = ["bash", "launch.sh", CONFIG, *shrink(*mesh), f"logging.run_dir={tmp_path / 'a'}"]
    proc = subprocess.run(launch, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torchrun(2, ["-m", "dtensor3d", "train", str(native), *mesh, f"logging.run_dir={tmp_path / 'b'}"])
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(a) == 4 and a == b


# Warmup-stable-decay in nanotron's spelling: warmup 1, stable until step 3, 1-sqrt decay over
# 2 steps (shorter than the run), then min_decay_lr for the last step.
WSD = [
    "tokens.train_steps=6",
    f"{LR}.lr_decay_starting_step=3",
    f"{LR}.lr_decay_steps=2",
    f"{LR}.lr_decay_style=1-sqrt",
]


def test_schedule_keys_map_onto_decay_start_and_decay_steps():
    opt = convert(raw_config(), shrink(*WSD))[0].optimizer
    assert (opt.decay, opt.decay_start, opt.decay_steps, opt.min_lr) == ("1-sqrt", 3, 2, 3e-5)
    # unset: decay right after warmup, to the last step (the file's lr_decay_steps=980 replaced by null).
    opt = convert(raw_config(), shrink("tokens.train_steps=6", f"{LR}.lr_decay_steps=null"))[0].optimizer
    assert (opt.decay, opt.decay_start, opt.decay_steps) == ("cosine", None, None)
    # a decay shorter than train_steps - lr_warmup_steps converts (it was refused before).
    opt = convert(raw_config(), shrink("tokens.train_steps=6", f"{LR}.lr_decay_steps=2"))[0].optimizer
    assert (opt.decay_start, opt.decay_steps) == (None, 2)
    # a decay past train_steps runs (stopping part-way down it), said in the one warning line.
    proc = cli_process("validate", CONFIG, *shrink(*WSD, f"{LR}.lr_decay_steps=5"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 1 and lines[0].startswith("warning: "), proc.stderr
    assert "general.project" in lines[0] and "ends the decay at step 8, past training.steps=6" in lines[0]


def test_wsd_config_trains_through_launch_sh_at_the_formulas_lr(tmp_path):
    """launch.sh, 1 process: each step's lr in metrics.jsonl equals tests/helpers.py's formula."""
    mesh = ["training.device=cpu", "checkpoint.resume=none", f"checkpoint.dir={tmp_path / 'ck'}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    launch = ["bash", "launch.sh", CONFIG, *shrink(*WSD, *mesh), f"logging.run_dir={tmp_path / 'a'}"]
    proc = subprocess.run(launch, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    opt = convert(raw_config(), shrink(*WSD))[0].optimizer
    want = [scheduled_lr(step, opt, 6) for step in range(6)]
    assert [row["lr"] for row in rows] == pytest.approx(want, rel=1e-12, abs=0)
    # warmup, stable, 1-sqrt down, then min_decay_lr held: the WSD shape itself.
    assert want[0] == want[1] == want[2] == want[3] == 3e-4 and want[5] == 3e-5 and 3e-5 < want[4] < 3e-4


# ---------------------------------------------------------------- data_stages (issue 22 item 2)
TINY = str(ROOT / "tests" / "nanotron_configs" / "config_tiny_llama.yaml")


def with_stages(*stages: tuple[int, object]) -> dict:
    """small_llama.yaml with data_stages [(start_training_step, dataset), ...]."""
    raw = raw_config()
    raw["data_stages"] = [
        {"name": f"stage {k}", "start_training_step": start, "data": {"dataset": dataset, "seed": 1}}
        for k, (start, dataset) in enumerate(stages)
    ]
    return raw


def test_data_stages_map_onto_sources_and_stages():
    one = {"dataset_folder": "data/web"}
    mix = {"dataset_folder": {"data/web": 0.3, "data/code": 0.7}}
    listed = {"dataset_folder": ["data/web", "data/math"], "dataset_weights": [1, 3]}
    d = convert(with_stages((1, one)), shrink())[0].data
    assert (d.kind, d.path, d.sources, d.stages) == ("tokens", "data/web", None, None)
    d = convert(with_stages((1, mix), (3, listed)), shrink())[0].data
    assert [(s.name, s.path, s.weight) for s in d.sources] == [("web", "data/web", 0.3), ("code", "data/code", 0.7)]
    assert len(d.stages) == 1 and d.stages[0].start_step == 3
    assert [(s.name, s.weight) for s in d.stages[0].sources] == [("web", 1.0), ("math", 3.0)]
    # Dummy data in every stage: synthetic tokens, as one stage of it was.
    assert convert(with_stages((1, None), (5, None)), shrink())[0].data.kind == "synthetic"
    refusals = [
        (with_stages((1, None), (5, one)), "data_stages.0.data.dataset=None"),
        (with_stages((1, one), (5, {"dataset_folder": ["a", "b"]})), "data_stages.1.data.dataset.dataset_weights"),
        (with_stages((2, one)), "data_stages.0.start_training_step=2"),
        (with_stages((1, one), (4, mix), (3, one)), "data_stages.2.start_training_step=3"),
        (with_stages((1, one), (3, {"dataset_folder": "ids.npy"})), "a mixture reads prepared directories"),
    ]
    for raw, words in refusals:
        with pytest.raises(RecipeError, match="^nanotron config: cannot honour ") as e:
            convert(raw, shrink())
        assert words in str(e.value), str(e.value)


def test_config_tiny_llama_as_published_is_refused_only_for_its_hub_dataset():
    proc = cli_process("validate", TINY, "parallelism.pp=1")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert (
        "data_stages.0.data.dataset=" in lines[0] and "stas/openwebtext-10k" in lines[0] and "prepare-data" in lines[0]
    )
    assert "data_stages'" not in lines[0] and "one data stage per run" not in lines[0]  # the stages themselves map


def test_config_tiny_llama_runs_through_launch_sh_with_its_two_stages(tmp_path):
    """nanotron's config_tiny_llama, its two stages on prepared directories (web, then web 1 :
    math 3 from step 3), 4 steps, at dp 2 x tp 2 (at its pp 2, micro_batch_size 2 x
    batch_accumulation_per_replica 1 gives each dp rank one microbatch, fewer than pp: refused
    at the door for 1F1B): every step's lr is the formula's (decay_steps 13 past the run:
    one warning line), and each stage's sources and shares are in metrics.jsonl."""
    from helpers import prepare_words

    web, math_ = (prepare_words(tmp_path, n, 6, seed, val_fraction=0.0) for n, seed in (("web", 1), ("math", 2)))
    stages = [
        f"data_stages.0.data.dataset={{dataset_folder: {web}}}",
        f"data_stages.1.data.dataset={{dataset_folder: {{{web}: 1, {math_}: 3}}}}",
        "data_stages.1.start_training_step=3",
    ]
    shrink_ = ["tokens.train_steps=4", "model.model_config.vocab_size=264", "parallelism.pp=1"]
    where = [f"checkpoints.checkpoints_path={tmp_path / 'ck'}", f"logging.run_dir={tmp_path / 'run'}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    launch = ["bash", "launch.sh", TINY, *stages, *shrink_, *where, "training.device=cpu"]
    proc = subprocess.run(launch, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    # One line (launch.sh's validate and rank 0 each print it: the same line twice).
    assert len(set(warnings)) == 1 and "ends the decay at step 15, past training.steps=4" in warnings[0], proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    recipe = load_recipe(TINY, [*stages, *shrink_, *where])
    assert [row["lr"] for row in rows] == pytest.approx(
        [scheduled_lr(s, recipe.optimizer, 4) for s in range(4)], rel=1e-12, abs=0
    )
    tokens = [{k: v for k, v in row.items() if k.startswith("tokens/")} for row in rows]
    assert tokens == [{"tokens/web": 1024}] * 2 + [{"tokens/web": 256, "tokens/math": 768}] * 2  # 4 samples of 256
    for row in rows:
        assert all(math.isfinite(row[k]) for k in row if k.startswith("loss"))
        assert row["loss"] == pytest.approx(
            sum(row[f"loss/{k[7:]}"] * v for k, v in row.items() if k.startswith("tokens/")) / 1024, rel=1e-6
        )
