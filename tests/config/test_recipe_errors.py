"""A wrong recipe or argument: exit status 2, one `error:` line naming the key (and the bad
value), no traceback, nothing started. Every case goes through the real command line
(`python -m dtensor3d validate|plan|train`, `bash launch.sh`); the positive cases at the end
call `load_recipe` / `validate` directly.

"Nothing started" is observed, not timed: every Python process the command runs records at
exit (a sitecustomize.py put on PYTHONPATH, see `probe_dir`) whether torch, dtensor3d.train or
a process group was ever loaded or initialised, and launch.sh's Python calls are logged to show
that torchrun was never run."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from helpers import PARITY, ROOT, cli, one_error_line, prepare_packed

from dtensor3d.config.checks import validate
from dtensor3d.config.load import load_recipe, parse_override, recipe_from_dict
from dtensor3d.config.schema import ParallelismConfig, Recipe
from dtensor3d.errors import RecipeError

REPO = Path(__file__).resolve().parents[2]
RECIPES = {"3d": REPO / "recipes" / "3d.yaml", "debug": REPO / "recipes" / "debug.yaml"}
DIST_ENV = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NNODES",
    "NODE_RANK",
    "PYTHON",
)


@dataclass
class Case:
    id: str
    expect: tuple[str, ...]  # substrings the one error line must contain
    base: str | None = "3d"  # recipe the case starts from (None: `text` is the file)
    edit: dict = field(default_factory=dict)  # {"section.key": value}, applied to the base
    text: str | None = None  # the file's raw contents (for YAML-level errors)
    overrides: tuple[str, ...] = ()
    command: str = "validate"  # validate | plan | train | launch
    args: tuple[str, ...] = ()  # extra command-line arguments after the recipe
    env: dict = field(default_factory=dict)
    path: str | None = None  # pass this path instead of the written recipe
    raw_bytes: bytes | None = None  # the file's raw bytes
    reaches_python: bool = True  # launch.sh: whether it gets as far as `dtensor3d validate`
    imports_torch: bool = False  # the check itself asks torch (about CUDA); else torch is never imported
    files: dict = field(default_factory=dict)  # {name: text}: files written in the working directory first


LAUNCHER = "-m dtensor3d train"  # in the one call that starts the ranks (torchrun or its wrapper)
NO_CUDA = {"CUDA_VISIBLE_DEVICES": ""}  # no CUDA device, on any machine
NOTES = {"notes.txt": "a file the user keeps\n"}
DENSE_TOPK = {"model.num_experts_per_tok": 2}  # the default value, but given: refused as well

CASES = [
    # -- the world size: ep*pp*dp*cp*tp against the processes there are
    Case("world-plan", ("parallelism", "16", "8"), command="plan", args=("--world", "8")),
    Case("world-train-env", ("parallelism", "16", "world size is 8"), command="train", env={"WORLD_SIZE": "8"}),
    Case("world-train-unset", ("parallelism", "16", "launch.sh"), command="train"),
    Case(
        "world-train-debug", ("parallelism", "world size is 2"), base="debug", command="train", env={"WORLD_SIZE": "2"}
    ),
    Case("world-env-not-int", ("WORLD_SIZE", "abc"), command="train", env={"WORLD_SIZE": "abc"}),
    Case("nnodes-not-divisor", ("NNODES=3", "16"), command="launch", env={"NNODES": "3", "MASTER_PORT": "29500"}),
    Case("nnodes-not-int", ("NNODES", "abc"), command="launch", env={"NNODES": "abc"}, reaches_python=False),
    Case(
        "node-rank-out-of-range",
        ("NODE_RANK", "2", "0..1"),
        command="launch",
        env={"NNODES": "2", "NODE_RANK": "2"},
        reaches_python=False,
    ),
    Case("rank-env-not-int", ("nope.yaml", "no such file"), base=None, path="nope.yaml", env={"RANK": "x"}),
    # -- model shapes against tp / pp
    Case("heads-not-div-tp", ("num_attention_heads=4", "tp=3"), edit={"parallelism.tp": 3}),
    Case(
        "kv-heads-not-div-tp",
        ("num_key_value_heads=2", "tp=4"),
        edit={"model.num_attention_heads": 8, "parallelism.tp": 4},
    ),
    Case("hidden-not-div-heads", ("hidden_size=66", "num_attention_heads=4"), edit={"model.hidden_size": 66}),
    Case(
        "heads-not-div-kv",
        ("num_key_value_heads=3", "num_attention_heads=4"),
        base="debug",
        edit={"model.num_key_value_heads": 3},
    ),
    Case("layers-fewer-than-pp", ("num_hidden_layers=1", "pp=2"), edit={"model.num_hidden_layers": 1}),
    Case("pp-layers-bad-sum", ("pp_layers", "[1, 1]"), edit={"parallelism.pp_layers": [1, 1]}),
    # 3d.yaml has pp 2: a stage keeps its parameters gathered for the step.
    Case(
        "fsdp-reshard-always-pp",
        ("fsdp_reshard_after_forward=always", "pp > 1", "default or never"),
        edit={"parallelism.fsdp_reshard_after_forward": "always"},
    ),
    Case("ep-without-experts", ("ep=2", "num_local_experts=0"), edit={"parallelism.expert_parallel_size": 2}),
    Case("experts-negative", ("num_local_experts", "-1"), edit={"model.num_local_experts": -1}),
    Case("rms-eps-negative", ("rms_norm_eps", "-1"), edit={"model.rms_norm_eps": -1.0}),
    # -- model families (config/families.py): key, value and what is supported, in one line
    Case(
        "family-unknown",
        ("model.family='gpt2'", "llama, qwen2, qwen3, mistral, mixtral"),
        edit={"model.family": "gpt2"},
    ),
    Case("hidden-act-gelu", ("model.hidden_act='gelu'", "valid: silu"), edit={"model.hidden_act": "gelu"}),
    Case(
        "rope-type-dynamic",
        ("model.rope_scaling", "rope_type='dynamic'", "default, linear, llama3, yarn"),
        edit={"model.rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    ),
    Case(
        "layer-types-length",
        ("model.layer_types", "sliding_attention", "num_hidden_layers=4"),
        edit={"model.family": "mistral", "model.sliding_window": 32, "model.layer_types": ["full_attention"]},
    ),
    Case("sliding-window-zero", ("model.sliding_window=0", ">= 1"), edit={"model.sliding_window": 0}),
    Case("nope-llama", ("model.nope_layers", "'llama'", "smollm3"), edit={"model.nope_layers": [1]}),
    Case(
        "nope-range",
        ("model.nope_layers=[4]", "valid: 0 to 3"),
        edit={"model.family": "smollm3", "model.nope_layers": [4]},
    ),
    Case(
        "partial-rotary-llama",
        ("model.partial_rotary_factor=0.5", "'llama'", "glm4_moe"),
        edit={"model.partial_rotary_factor": 0.5},
    ),
    Case(
        "gemma3-sequence-parallel",
        ("parallelism.tp_mode=REDUCE_SCATTER", "'gemma3_text'", "ALL_REDUCE"),
        edit={"model.family": "gemma3_text", "parallelism.tp": 2, "parallelism.tp_mode": "REDUCE_SCATTER"},
    ),
    Case(
        "olmo2-sequence-parallel",
        ("parallelism.tp_mode=REDUCE_SCATTER", "'olmo2'", "ALL_REDUCE"),
        edit={"model.family": "olmo2", "parallelism.tp": 2, "parallelism.tp_mode": "REDUCE_SCATTER"},
    ),
    Case(
        "window-mla",
        ("model.sliding_window=8", "deepseek_v3"),
        edit={"model.family": "deepseek_v3", "model.num_key_value_heads": 4, "model.sliding_window": 8},
    ),
    Case(
        "swiglu-limit-dense",
        ("model.swiglu_limit=7.0", "num_local_experts=0", "null"),
        edit={"model.family": "gpt_oss", "model.swiglu_limit": 7.0},
    ),
    Case(
        "mlp-bias-qwen2", ("model.mlp_bias", "'qwen2'", "llama"), edit={"model.family": "qwen2", "model.mlp_bias": True}
    ),
    # -- batch and sequence against dp / pp / cp / tp
    Case(
        "gbs-not-div", ("global_batch_size=12", "micro_batch_size*dp*ep", "8"), edit={"training.global_batch_size": 12}
    ),
    Case(
        "microbatches-fewer-than-pp",
        ("global_batch_size=8", "1 microbatches", "pp=2", "1f1b"),
        edit={"training.global_batch_size": 8},
    ),
    Case(
        "seq-not-div-2cp",
        ("sequence_length=66", "2*cp", "4"),
        edit={"parallelism.context_parallel_size": 2, "training.sequence_length": 66},
    ),
    Case(
        "seq-not-div-tp-reduce-scatter",
        ("sequence_length=63", "REDUCE_SCATTER"),
        edit={"parallelism.tp_mode": "REDUCE_SCATTER", "training.sequence_length": 63},
    ),
    # -- unknown names
    Case("unknown-key-model", ("model.hiden_size", "did you mean 'hidden_size'"), edit={"model.hiden_size": 64}),
    Case(
        "unknown-key-parallelism",
        ("parallelism.recompute_layers", "did you mean 'recompute_layer'"),
        edit={"parallelism.recompute_layers": True},
    ),
    Case(
        "unknown-key-training",
        ("training.sequence_len", "did you mean 'sequence_length'"),
        edit={"training.sequence_len": 64},
    ),
    Case("unknown-section-typo", ("modle", "unknown section", "did you mean 'model'"), edit={"modle.hidden_size": 64}),
    Case("unknown-section", ("tokenizer", "unknown section", "valid: model"), edit={"tokenizer.name": "gpt2"}),
    # -- wrong types
    Case("type-str-for-int", ("parallelism.tp='2'", "expected int"), edit={"parallelism.tp": "2"}),
    Case("type-float-for-int", ("model.hidden_size=64.5", "expected int"), edit={"model.hidden_size": 64.5}),
    Case("type-bool-for-int", ("training.steps=True", "expected int"), edit={"training.steps": True}),
    Case(
        "type-list-for-bool",
        ("parallelism.recompute_layer=[True]", "expected bool"),
        edit={"parallelism.recompute_layer": [True]},
    ),
    Case("type-str-for-float", ("optimizer.lr='fast'", "expected float"), edit={"optimizer.lr": "fast"}),
    Case("type-number-for-list", ("optimizer.betas=0.9", "list of two numbers"), edit={"optimizer.betas": 0.9}),
    Case("type-null-for-str", ("parallelism.pp_engine=None", "expected str"), edit={"parallelism.pp_engine": None}),
    Case("section-not-mapping", ("training=5", "mapping"), edit={"training": 5}),
    Case("lr-nan", ("optimizer.lr", "nan"), edit={"optimizer.lr": float("nan")}),
    # -- non-positive sizes
    Case("tp-zero", ("parallelism.tp=0", "positive"), edit={"parallelism.tp": 0}),
    Case("dp-negative", ("parallelism.dp=-1", "positive"), edit={"parallelism.dp": -1}),
    Case("mbs-zero", ("training.micro_batch_size=0", "positive"), edit={"training.micro_batch_size": 0}),
    Case("layers-zero", ("model.num_hidden_layers=0", "positive"), edit={"model.num_hidden_layers": 0}),
    # -- enums
    Case("enum-pp-engine", ("pp_engine='zigzag'", "1f1b", "afab"), edit={"parallelism.pp_engine": "zigzag"}),
    Case("enum-tp-mode", ("tp_mode='ALL_GATHER'", "REDUCE_SCATTER"), edit={"parallelism.tp_mode": "ALL_GATHER"}),
    Case("enum-dp-mode", ("dp_mode='zero3'", "shard", "replicate"), edit={"parallelism.dp_mode": "zero3"}),
    Case("enum-dtype", ("dtype='float16'", "bfloat16"), edit={"training.dtype": "float16"}),
    Case("enum-decay", ("decay='exponential'", "cosine"), edit={"optimizer.decay": "exponential"}),
    Case(
        "decay-start-past-steps",
        ("optimizer.decay_start=10000", "training.steps"),
        edit={"optimizer.decay_start": 10000},
    ),
    Case("decay-steps-zero", ("optimizer.decay_steps=0", ">= 1"), edit={"optimizer.decay_steps": 0}, command="launch"),
    Case("enum-device", ("device='gpu'", "cuda"), edit={"training.device": "gpu"}),
    # -- Muon (training/muon.py)
    Case("muon-ns-steps-zero", ("optimizer.muon_ns_steps=0", "1 to 99"), edit={"optimizer.muon_ns_steps": 0}),
    Case(
        "enum-muon-adjust-lr",
        ("muon_adjust_lr='rms'", "original", "match_rms_adamw"),
        edit={"optimizer.name": "muon", "optimizer.muon_adjust_lr": "rms"},
    ),
    Case("enum-optimizer-name", ("name='sgd'", "adamw", "muon"), edit={"optimizer.name": "sgd"}),
    Case(
        "enum-muon-ns-dtype",
        ("muon_ns_dtype='float16'", "bfloat16", "float32"),
        edit={"optimizer.name": "muon", "optimizer.muon_ns_dtype": "float16"},
    ),
    Case("muon-momentum-one", ("optimizer.muon_momentum=1.0", "[0, 1)"), edit={"optimizer.muon_momentum": 1.0}),
    # -- nanotron's long names against the short ones
    Case(
        "cp-alias-conflict",
        ("context_parallel_size=2", "cp=1"),
        edit={"parallelism.cp": 1, "parallelism.context_parallel_size": 2},
    ),
    Case(
        "ep-alias-conflict",
        ("expert_parallel_size=1", "ep=2"),
        edit={"parallelism.ep": 2, "parallelism.expert_parallel_size": 1},
    ),
    # -- the file itself
    Case("missing-file", ("no/such/recipe.yaml", "no such file"), base=None, path="no/such/recipe.yaml"),
    Case("empty-file", ("recipe.yaml", "empty"), base=None, text=""),
    Case("comments-only", ("recipe.yaml", "empty"), base=None, text="# nothing here\n"),
    Case(
        "yaml-bad-indent",
        ("recipe.yaml", "line 3", "YAML"),
        base=None,
        text="model:\n  hidden_size: 64\n   vocab_size: 256\n",
    ),
    Case(
        "yaml-unclosed-bracket",
        ("recipe.yaml", "line 3", "YAML"),
        base=None,
        text="model:\n  hidden_size: 64\noptimizer: {betas: [0.9, 0.95}\n",
    ),
    Case("yaml-tab", ("recipe.yaml", "line 2", "YAML"), base=None, text="model:\n\thidden_size: 64\n"),
    Case(
        "yaml-duplicate-key",
        ("recipe.yaml", "line 3", "hidden_size", "twice"),
        base=None,
        text="model:\n  hidden_size: 64\n  hidden_size: 128\n",
    ),
    Case("recipe-is-a-directory", ("recipes", "directory"), base=None, path=str(REPO / "recipes")),
    Case("yaml-python-tag", ("recipe.yaml", "line 1"), base=None, text="model: !!python/object:os.system ls\n"),
    Case("top-level-list", ("recipe.yaml", "mapping", "list"), base=None, text="- model\n- training\n"),
    Case("not-utf8", ("recipe.yaml", "UTF-8"), base=None, raw_bytes=b"model:\n  hidden_size: \xff\xfe\n"),
    # -- overrides
    Case("override-no-equals", ("parallelism.tp", "'='"), overrides=("parallelism.tp",)),
    Case(
        "override-unknown-key", ("model.hiden_size", "did you mean 'hidden_size'"), overrides=("model.hiden_size=64",)
    ),
    Case("override-unknown-section", ("trainig", "did you mean 'training'"), overrides=("trainig.steps=3",)),
    Case("override-too-deep", ("model.hidden.size", "section.key"), overrides=("model.hidden.size=64",)),
    Case("override-bad-enum", ("pp_engine='zigzag'", "1f1b"), overrides=("parallelism.pp_engine=zigzag",)),
    Case("override-bad-type", ("training.steps='many'", "expected int"), overrides=("training.steps=many",)),
    Case("override-not-yaml", ("parallelism.dp=[1", "YAML"), overrides=("parallelism.dp=[1",)),
    Case("override-empty-value", ("training.steps=''", "empty string", "expected int"), overrides=("training.steps=",)),
    Case("override-breaks-check", ("parallelism.tp=3", "num_attention_heads=4"), overrides=("parallelism.tp=3",)),
    # -- the other commands
    Case(
        "train-bad-override",
        ("parallelism.tp=0", "positive"),
        base="debug",
        command="train",
        overrides=("parallelism.tp=0",),
    ),
    Case(
        "train-unknown-key",
        ("model.hiden_size", "hidden_size"),
        base="debug",
        command="train",
        edit={"model.hiden_size": 64},
    ),
    Case("plan-bad-world-arg", ("--world", "abc"), command="plan", args=("--world", "abc")),
    Case(
        "launch-bad-override",
        ("parallelism.pp_engine='zigzag'",),
        command="launch",
        overrides=("parallelism.pp_engine=zigzag",),
    ),
    Case("launch-missing-file", ("nope.yaml", "no such file"), base=None, path="nope.yaml", command="launch"),
    Case("launch-bad-recipe", ("num_hidden_layers=1", "pp=2"), command="launch", edit={"model.num_hidden_layers": 1}),
    Case(
        "launch-no-args", ("no recipe", "launch.sh RECIPE"), base=None, command="launch", path="", reaches_python=False
    ),
    # -- settings that cannot apply: expert settings given on a dense model (their defaults are fine)
    Case("experts-per-tok-on-dense", ("model.num_experts_per_tok=2", "num_local_experts=0"), edit=DENSE_TOPK),
    Case(
        "aux-coef-on-dense-override",
        ("model.router_aux_loss_coef=0.1", "dense", "num_local_experts > 0"),
        command="launch",
        overrides=("model.router_aux_loss_coef=0.1",),
    ),
    Case(
        "shared-expert-on-dense-train",
        ("model.shared_expert_intermediate_size=32", "num_local_experts=0"),
        base="debug",
        command="train",
        overrides=("model.shared_expert_intermediate_size=32",),
    ),
    # -- torch.compile against what it cannot run (config/checks.py's _validate_recompute)
    Case(
        "compile-zbv",
        ("training.compile=true", "pp_engine zbv", "1f1b, afab or interleaved_1f1b"),
        edit={"parallelism.pp_engine": "zbv", "training.compile": True},
    ),
    Case(
        "compile-dualpipev-launch",
        ("training.compile=true", "pp_engine dualpipev", "compile: false"),
        command="launch",
        edit={"training.global_batch_size": 32},  # the 4 microbatches dualpipev needs at pp 2
        overrides=("parallelism.pp_engine=dualpipev", "training.compile=true"),
    ),
    Case(
        "selective-compile-experts",
        ("parallelism.recompute=selective", "training.compile=true", "experts", "recompute none or full"),
        edit={"model.num_local_experts": 4, "parallelism.recompute": "selective", "training.compile": True},
    ),
    # -- multi-node: MASTER_PORT
    Case(
        "nnodes-without-master-port",
        ("MASTER_PORT", "NNODES=2"),
        command="launch",
        env={"NNODES": "2"},
        reaches_python=False,
    ),
    Case(
        "master-port-not-a-port",
        ("MASTER_PORT", "70000", "1..65535"),
        command="launch",
        env={"MASTER_PORT": "70000"},
        reaches_python=False,
    ),
    # -- the machine: a device it lacks, a run directory it cannot write
    Case(
        "cuda-without-cuda",
        ("training.device=cuda", "no usable CUDA", "cpu"),
        edit={"training.device": "cuda"},
        env=NO_CUDA,
        imports_torch=True,
    ),
    Case(
        "cuda-without-cuda-train",
        ("training.device=cuda", "no usable CUDA"),
        base="debug",
        command="train",
        overrides=("training.device=cuda",),
        env=NO_CUDA,
        imports_torch=True,
    ),
    Case(
        "cuda-without-cuda-launch",
        ("training.device=cuda", "no usable CUDA"),
        command="launch",
        overrides=("training.device=cuda",),
        env=NO_CUDA,
        imports_torch=True,
    ),
    Case(
        "run-dir-is-a-file",
        ("logging.run_dir='notes.txt'", "existing file"),
        overrides=("logging.run_dir=notes.txt",),
        files=NOTES,
    ),
    Case(
        "run-dir-under-a-file",
        ("logging.run_dir='notes.txt/run'", "notes.txt' is a file"),
        base="debug",
        command="train",
        overrides=("logging.run_dir=notes.txt/run",),
        files=NOTES,
    ),
    Case(
        "run-dir-is-a-file-launch",
        ("logging.run_dir='notes.txt'", "existing file"),
        command="launch",
        overrides=("logging.run_dir=notes.txt",),
        files=NOTES,
    ),
    # -- values that used to surface as tracebacks or odd words
    Case(
        "seed-too-large",
        ("training.seed=99999999999999999999", "0..4294967295"),
        overrides=("training.seed=99999999999999999999",),
    ),
    Case(
        "seed-negative-train",
        ("training.seed=-1", "0..4294967295"),
        base="debug",
        command="train",
        overrides=("training.seed=-1",),
    ),
    Case("steps-1e9", ("training.steps=1e9", "must be an integer", "1000000000"), overrides=("training.steps=1e9",)),
    Case("run-dir-empty", ("logging.run_dir=''", "empty string", "directory"), overrides=("logging.run_dir=",)),
    Case(
        "run-dir-quoted-empty",
        ("logging.run_dir=''", "empty string"),
        command="launch",
        overrides=('logging.run_dir=""',),
    ),
    # -- the command line like the file: a key given twice, aliases that disagree
    Case(
        "override-repeated",
        ("training.steps", "twice on the command line"),
        overrides=("training.steps=3", "training.steps=4"),
    ),
    Case(
        "override-alias-conflict",
        ("parallelism.context_parallel_size=4", "parallelism.cp=2", "aliases"),
        command="launch",
        overrides=("parallelism.cp=2", "parallelism.context_parallel_size=4"),
    ),
    # -- the training-stability guards (issue 37: config/stability_checks.py)
    Case("z-loss-negative", ("training.z_loss=-0.001", ">= 0"), edit={"training.z_loss": -0.001}),
    Case(
        "skip-spikes-window-1",
        ("training.skip_spikes.window=1", ">= 2"),
        overrides=("training.skip_spikes={window: 1, sigma: 6.0}",),
    ),
    Case("skip-spikes-sigma-0", ("training.skip_spikes.sigma=0", "> 0"), edit={"training.skip_spikes": {"sigma": 0}}),
    Case(
        "skip-spikes-unknown-key",
        ("training.skip_spikes.windows", "window, sigma"),
        edit={"training.skip_spikes": {"windows": 50}},
    ),
]


def _write_recipe(case: Case, tmp_path: Path) -> str:
    if case.path is not None:
        return case.path
    target = tmp_path / "recipe.yaml"
    if case.raw_bytes is not None:
        target.write_bytes(case.raw_bytes)
    elif case.text is not None:
        target.write_text(case.text)
    else:
        raw = yaml.safe_load(RECIPES[case.base].read_text())
        raw["logging"]["run_dir"] = str(tmp_path / "run")
        for dotted, value in case.edit.items():
            if "." in dotted:
                section, key = dotted.split(".")
                if not isinstance(raw.get(section), dict):
                    raw[section] = {}
                raw[section][key] = value
            else:
                raw[dotted] = value
        target.write_text(yaml.safe_dump(raw, sort_keys=False))
    return "recipe.yaml"


def _python_logger(tmp_path: Path) -> tuple[Path, Path]:
    """A `python` for launch.sh's $PYTHON that records each call, then runs the real one."""
    log = tmp_path / "python-calls.log"
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> "{log}"\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, log


PROBE = """\
import atexit, json, os, sys


def _record():  # at exit: what this process loaded and started
    dist = sys.modules.get("torch.distributed")
    started = bool(dist is not None and dist.is_available() and dist.is_initialized())
    with open(os.environ["DTENSOR3D_TEST_PROBE"], "a") as f:
        record = {"argv": sys.argv, "torch": "torch" in sys.modules, "process_group": started}
        record["train"] = "dtensor3d.training.train" in sys.modules
        f.write(json.dumps(record) + "\\n")


if os.environ.get("DTENSOR3D_TEST_PROBE"):
    atexit.register(_record)
"""


@pytest.fixture(scope="session")
def probe_dir(tmp_path_factory) -> Path:
    """A directory holding a sitecustomize.py that records, at each Python process's exit,
    whether torch, dtensor3d.train or a process group was loaded or started."""
    root = tmp_path_factory.mktemp("probe")
    (root / "sitecustomize.py").write_text(PROBE)
    return root


def probe_env(probe_dir: Path, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(probe_dir), *filter(None, [env.get("PYTHONPATH")])])
    env["DTENSOR3D_TEST_PROBE"] = str(tmp_path / "probe.jsonl")
    return env


def probe_records(tmp_path: Path) -> list[dict]:
    path = tmp_path / "probe.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_case(case: Case, tmp_path: Path, probe_dir: Path) -> tuple[subprocess.CompletedProcess, Path | None]:
    recipe = _write_recipe(case, tmp_path)
    for name, text in case.files.items():
        (tmp_path / name).write_text(text)
    env = probe_env(probe_dir, tmp_path)
    env.update(case.env)
    log = None
    if case.command == "launch":
        wrapper, log = _python_logger(tmp_path)
        env["PYTHON"] = str(wrapper)
        argv = ["bash", str(REPO / "launch.sh")] + ([recipe] if recipe else [])
    else:
        argv = [sys.executable, "-m", "dtensor3d", case.command, recipe]
    argv += [*case.overrides, *case.args]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return proc, log


def assert_nothing_started(case: Case, tmp_path: Path, log: Path | None) -> None:
    """Each Python process exited normally having started no process group and loaded no
    trainer (and, unless the check needs it, not even torch); launch.sh never ran torchrun."""
    calls = (log.read_text().splitlines() if log.exists() else []) if log is not None else ["-m dtensor3d"]
    records = probe_records(tmp_path)
    assert len(records) == len(calls), (records, calls)
    for record in records:
        assert not record["process_group"] and not record["train"], record
        assert record["torch"] == (case.imports_torch and "dtensor3d" in record["argv"][0]), record
    if log is not None:
        assert not any(LAUNCHER in c or "torch.distributed.run" in c or "torchrun" in c for c in calls), calls
        validated = any(c.startswith("-m dtensor3d validate") for c in calls)
        assert validated == case.reaches_python, calls


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refused_at_the_door(case: Case, tmp_path, probe_dir):
    proc, log = run_case(case, tmp_path, probe_dir)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("error: ")
    for key in case.expect:
        assert key in line, f"{key!r} not in {line!r}"
    # Nothing started: no output, no run directory, no process group, no torchrun; nothing lost.
    assert proc.stdout == ""
    assert not (tmp_path / "run").exists()
    assert not (tmp_path / "runs").exists()
    for name, text in case.files.items():
        assert (tmp_path / name).read_text() == text
    assert_nothing_started(case, tmp_path, log)


def test_cases_cover_every_command():
    commands = {c.command for c in CASES}
    assert commands == {"validate", "plan", "train", "launch"}
    assert len(CASES) >= 30


def test_launch_valid_recipe_reaches_torchrun(tmp_path):
    """The refusal above is specific: with a valid recipe launch.sh does hand over to torchrun
    (replaced here by a stand-in that only records its arguments)."""
    log = tmp_path / "calls.log"
    fake = tmp_path / "fake-python"
    fake.write_text(
        f'#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> "{log}"\n'
        f'case "$*" in *"-m dtensor3d train"*) exit 0;; esac\nexec "{sys.executable}" "$@"\n'
    )
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(PYTHON=str(fake), NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="29511")
    proc = subprocess.run(
        ["bash", str(REPO / "launch.sh"), str(RECIPES["3d"]), "training.steps=2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    run = [c for c in log.read_text().splitlines() if LAUNCHER in c]
    assert len(run) == 1
    for part in (
        "--nnodes=2",
        "--node_rank=1",
        "--nproc_per_node=8",
        "--master_addr=10.0.0.1",
        "--master_port=29511",
        "-m dtensor3d train",
        "training.steps=2",
    ):
        assert part in run[0], (part, run[0])


# ---- positive cases, in process --------------------------------------------------------


def test_shipped_recipes_load():
    r3 = load_recipe(str(RECIPES["3d"]), world_size=16)
    assert r3.parallelism.dims == {"ep": 1, "pp": 2, "dp": 4, "cp": 1, "tp": 2}
    assert r3.parallelism.world_size == 16
    assert r3.num_microbatches == 2  # 16 / (2 * 4 * 1)
    assert r3.optimizer.betas == (0.9, 0.95)
    assert r3.logging.run_dir == "runs/3d"
    rd = load_recipe(str(RECIPES["debug"]), world_size=1)
    assert rd.parallelism.world_size == 1
    assert rd.num_microbatches == 4  # 8 / 2
    assert rd.parallelism.pp_engine == "1f1b" and rd.parallelism.dp_mode == "shard"


def test_recipe_is_frozen():
    r = load_recipe(str(RECIPES["debug"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.training.steps = 3


def test_to_dict_round_trip():
    r = load_recipe(str(RECIPES["3d"]), ["parallelism.pp_layers=[1, 3]"])
    d = r.to_dict()
    assert d["parallelism"]["pp_layers"] == [1, 3]
    assert recipe_from_dict(d) == r
    yaml.safe_dump(d)  # plain YAML types only


def test_aliases_map_to_short_names():
    base = yaml.safe_load(RECIPES["3d"].read_text())
    base["parallelism"].update(dp=1, context_parallel_size=2, expert_parallel_size=2)
    base["model"]["num_local_experts"] = 4
    r = recipe_from_dict(base)
    assert r.parallelism.cp == 2 and r.parallelism.ep == 2
    assert r.parallelism.dims == {"ep": 2, "pp": 2, "dp": 1, "cp": 2, "tp": 2}
    validate(r, world_size=16)
    # Both spellings with the same value are one setting, not a conflict.
    base["parallelism"]["cp"] = 2
    assert recipe_from_dict(base).parallelism.cp == 2


def test_override_of_alias_replaces_the_other_spelling():
    # 3d.yaml says context_parallel_size: 1; overriding the short name must win, not conflict.
    r = load_recipe(str(RECIPES["3d"]), ["parallelism.cp=2", "parallelism.dp=2"], world_size=16)
    assert r.parallelism.cp == 2
    r = load_recipe(
        str(RECIPES["3d"]),
        ["parallelism.expert_parallel_size=2", "parallelism.dp=2", "model.num_local_experts=2"],
        world_size=16,
    )
    assert r.parallelism.ep == 2


def test_overrides_parse_yaml_scalars():
    r = load_recipe(
        str(RECIPES["debug"]),
        [
            "training.steps=20",
            "optimizer.lr=3e-4",
            "optimizer.min_lr=0",
            "parallelism.recompute_layer=true",
            "data.path=null",
            "optimizer.betas=[0.8, 0.9]",
            "parallelism.tp_mode=reduce_scatter",
            "logging.run_dir=out/x=y",
            "training.dtype=bfloat16",
        ],
    )
    assert r.training.steps == 20 and isinstance(r.training.steps, int)
    assert r.optimizer.lr == 3e-4 and isinstance(r.optimizer.lr, float)  # YAML 1.1 reads 3e-4 as a string
    assert r.optimizer.min_lr == 0.0 and isinstance(r.optimizer.min_lr, float)
    assert r.parallelism.recompute_layer is True
    assert r.data.path is None
    assert r.optimizer.betas == (0.8, 0.9)
    assert r.parallelism.tp_mode == "REDUCE_SCATTER"  # enum spelling is canonicalised
    assert r.logging.run_dir == "out/x=y"  # only the first '=' splits
    assert r.training.dtype == "bfloat16"


def test_parse_override():
    assert parse_override("parallelism.tp=4") == (["parallelism", "tp"], 4)
    assert parse_override(" training.seed = 7") == (["training", "seed"], 7)
    assert parse_override("data.path=a.bin") == (["data", "path"], "a.bin")
    with pytest.raises(RecipeError, match="has no '='"):
        parse_override("parallelism.tp")


def test_override_replaces_the_file_value():
    r = load_recipe(str(RECIPES["debug"]), ["training.steps=7"])
    assert r.training.steps == 7


def test_empty_override_unsets_an_optional_key():
    r = load_recipe(str(RECIPES["debug"]), ["data.path=", "checkpoint.dir="])
    assert r.data.path is None and r.checkpoint.dir is None


@pytest.mark.parametrize(
    "gbs,mbs,dp,ep,expected", [(16, 2, 4, 1, 2), (8, 1, 1, 1, 8), (32, 2, 2, 2, 4), (6, 3, 2, 1, 1)]
)
def test_num_microbatches(gbs, mbs, dp, ep, expected):
    r = Recipe(
        parallelism=ParallelismConfig(dp=dp, ep=ep),
        training=dataclasses.replace(Recipe().training, global_batch_size=gbs, micro_batch_size=mbs),
    )
    assert r.num_microbatches == expected


def test_afab_allows_fewer_microbatches_than_pp():
    # 1 microbatch with pp=2 is refused under 1f1b (see the cases above) but fine under afab.
    r = load_recipe(str(RECIPES["3d"]), ["training.global_batch_size=8", "parallelism.pp_engine=afab"], world_size=16)
    assert r.num_microbatches == 1 and r.parallelism.pp_engine == "afab"


def test_validate_world_size():
    r = load_recipe(str(RECIPES["3d"]))
    validate(r, world_size=16)
    validate(r)  # no world size given: not checked
    with pytest.raises(RecipeError, match=r"= 16 but the world size is 32"):
        validate(r, world_size=32)


def test_valid_edge_values_accepted():
    r = load_recipe(
        str(RECIPES["3d"]),
        [
            "parallelism.tp_mode=REDUCE_SCATTER",
            "parallelism.dp=1",
            "parallelism.cp=4",
            "training.sequence_length=64",
            "parallelism.pp_layers=[3, 1]",
        ],
        world_size=16,
    )
    assert r.parallelism.cp == 4 and r.parallelism.pp_layers == (3, 1)
    assert math.isfinite(r.optimizer.lr)


def test_validation_imports_no_torch():
    code = (
        "import sys, dtensor3d.recipe, dtensor3d.plan, dtensor3d.__main__\n"
        "import dtensor3d.checkpoint.lock, dtensor3d.datasets.door  # launch.sh's door without a checkpoint\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_recipe_reference_is_generated_from_the_schema():
    """docs/recipe.md is exactly what the field declarations give (regenerate it with
    `python -m dtensor3d.config.explain > docs/recipe.md`), and it names every field."""
    import dataclasses

    from dtensor3d.config.explain import recipe_markdown
    from dtensor3d.config.schema import _SECTION_CLASSES

    text = (REPO / "docs" / "recipe.md").read_text()
    assert text == recipe_markdown(), "docs/recipe.md is stale: python -m dtensor3d.config.explain > docs/recipe.md"
    for section, cls in _SECTION_CLASSES.items():
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}`" in text, f"{section}.{f.name}"
    assert "docs/recipe.md" in (REPO / "README.md").read_text()


def test_explain_every_key_and_alias(capsys):
    import dataclasses

    from dtensor3d.__main__ import main
    from dtensor3d.config.schema import _SECTION_CLASSES, ALIASES

    keys = [f"{s}.{f.name}" for s, cls in _SECTION_CLASSES.items() for f in dataclasses.fields(cls)]
    keys += [f"{s}.{alias}" for (s, alias) in ALIASES]
    for key in keys:
        assert main(["validate", "--explain", key]) == 0, key
        out = capsys.readouterr().out.splitlines()
        canon = f"{key.split('.')[0]}.{ALIASES.get(tuple(key.split('.')), key.split('.')[1])}"
        assert out[0].startswith(f"{canon}: ") and out[1].startswith("  type: ") and out[2].startswith("  default: ")
    assert main(["validate", "--explain", "optimizer.decay"]) == 0
    assert "type: one of cosine, linear, 1-sqrt, constant" in capsys.readouterr().out
    assert main(["validate", "--explain", "training.stepz"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean 'training.steps'?" in err[0]


def test_explain_a_whole_section_lists_its_keys():
    """Issue 43 item 10: `validate --explain data` (a section, as a user types it) lists every
    key of the section with its one-line doc, as docs/recipe.md does."""
    import dataclasses

    from helpers import cli_process

    from dtensor3d.config.schema import _SECTION_CLASSES

    for section in ("data", "checkpoint"):
        proc = cli_process("validate", "--explain", section)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].startswith(f"{section}: ")
        for f in dataclasses.fields(_SECTION_CLASSES[section]):
            row = next(ln for ln in lines if ln.split()[0] == f"{section}.{f.name}")
            assert f.metadata["doc"] in row, row
    line = one_error_line(cli("validate", "--explain", "dat"))
    assert "a section (model, parallelism" in line and "section.key" in line, line


def test_an_empty_list_is_none_where_null_is_none_and_refused_saying_what_null_is():
    """Issue 43 item 8: a list override that empties a list: [] is null where null means none
    (data.stages, data.sources, logging.profile_steps), and refused, saying what null means,
    where it does not (model.moe_layers: null is every layer)."""
    recipe = load_recipe(PARITY, ["data.stages=[]", "logging.profile_steps=[]"])
    assert recipe.data.stages is None and recipe.logging.profile_steps is None
    line = one_error_line(cli("validate", PARITY, "model.num_local_experts=4", "model.moe_layers=[]"))
    assert "model.moe_layers=[]" in line and "null means every layer" in line, line


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.num_key_value_heads=4"], r"model\.num_key_value_heads=4: multi-head latent attention .* set it to "),
        (["model.head_dim=16"], r"model\.head_dim=16: multi-head latent attention's head_dim is qk_rope_head_dim=8"),
        (["model.qk_rope_head_dim=7", "model.head_dim=7"], r"model\.qk_rope_head_dim=7 must be a positive even"),
        (["model.q_lora_rank=0"], r"model\.q_lora_rank=0 must be > 0, or null"),
        (["model.family=llama", "model.num_key_value_heads=4"], r"model\.q_lora_rank=24: a multi-head latent"),
        (["parallelism.tp=2", "parallelism.tp_linear_async_communication=true"], r"async_communication=true: the"),
    ],
)
def test_mla_settings_refused_with_one_line(overrides, message):
    """DeepSeek-V3's attention settings (tests/recipes/deepseek_parity.yaml) that cannot run, or
    on a family without multi-head latent attention: one RecipeError line naming the key."""
    with pytest.raises(RecipeError, match=message) as e:
        load_recipe(str(REPO / "tests" / "recipes" / "deepseek_parity.yaml"), overrides)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model.n_group=3"], ["model.n_group=3", "valid n_group: 1, 2, 4"]),
        (["model.n_group=8"], ["model.n_group=8", "groups of >= 2 experts"]),
        (["model.n_group=4", "model.topk_group=5"], ["model.topk_group=5", "larger than n_group=4"]),
        (["model.n_group=4", "model.topk_group=1", "model.num_experts_per_tok=3"], ["num_experts_per_tok=3", "only 2"]),
        (["parallelism.ep=3"], ["parallelism.ep=3", "valid ep: 1, 2, 4, 8"]),
        (["model.scoring_func=tanh"], ["model.scoring_func", "softmax, sigmoid"]),
        (["model.routed_scaling_factor=0"], ["model.routed_scaling_factor=0", "> 0"]),
        (["model.router_bias_update_rate=-1"], ["model.router_bias_update_rate=-1", ">= 0"]),
    ],
)
def test_router_options_refused_at_the_door(overrides, words):
    """The MoE router's options (8 experts): one error line naming the key and what is valid."""
    line = one_error_line(cli("validate", str(REPO / "tests" / "recipes" / "moe_parity.yaml"), *overrides))
    assert all(w in line for w in words), line


RECIPE_DIR = REPO / "tests" / "recipes"


@pytest.mark.parametrize(
    "recipe, overrides, words",
    [
        ("moe_parity", ["model.family=qwen2"], ["model.family='qwen2'", "num_local_experts=8", "'mixtral'"]),
        ("parity", ["model.head_dim=7"], ["model.head_dim=7", "positive even number"]),
        ("parity", ["model.intermediate_size=130", "parallelism.tp=4"], ["intermediate_size=130", "tp=4"]),
        ("parity", ["model.vocab_size=258", "parallelism.tp=4"], ["vocab_size=258", "multiple of 4"]),
        ("parity", ["training.sequence_length=128"], ["sequence_length=128", "max_position_embeddings=64"]),
        (
            "parity",
            ["parallelism.recompute_layer=true", "parallelism.recompute=selective"],
            ["recompute=selective", "recompute_layer=true"],
        ),
        ("parity", ["optimizer.min_lr=0.1"], ["optimizer.lr=0.001", "min_lr=0.1", "0 <= min_lr <= lr"]),
        ("parity", ["optimizer.eps=0"], ["optimizer:", "eps > 0"]),
        ("parity", ["optimizer.betas=[0.9, 1.0]"], ["optimizer.betas=[0.9, 1.0]", "[0, 1)"]),
        ("parity", ["data.kind=tokens"], ["data.path is required", "data.kind 'tokens'"]),
        ("parity", ["checkpoint.interval=-1"], ["checkpoint.interval=-1", ">= 0"]),
        ("parity", ["training.eval_every=-1"], ["training.eval_every=-1", ">= 0"]),
        ("parity", ["training.max_skipped_steps=0"], ["training.max_skipped_steps=0", "positive"]),
        ("parity", ["training.timeout_s=0"], ["training.timeout_s=0", "positive number of seconds"]),
        ("parity", ["checkpoint.preempt_timeout_s=-5"], ["checkpoint.preempt_timeout_s=-5", "seconds"]),
        ("parity", ["logging.profile_steps=[4, 2]"], ["logging.profile_steps=[4, 2]", "first <= last"]),
        ("parity", ["eval.every=2"], ["eval.every=2 needs eval.tasks"]),
        ("parity", ["eval.tasks=[arc_easy]"], ["eval.tasks=['arc_easy'] needs eval.every > 0"]),
        (
            "parity",
            ["eval.tasks=[arc_easy]", "eval.every=2", "eval.include_path=/no/such/tasks"],
            ["eval.include_path='/no/such/tasks'", "no such directory"],
        ),
        (
            "parity",  # any mesh may evaluate in the loop (pp: its stages in turn; cp: its ranks as replicas)
            ["eval.tasks=[arc_easy]", "eval.every=2", "parallelism.pp=2"],
            ["eval.tasks=['arc_easy'] needs the data's tokenizer", "got data.kind=synthetic"],
        ),
        ("parity", ["logging.wandb={project: p, mode: cloud}"], ["logging.wandb.mode='cloud'", "online, offline"]),
        ("parity", ["logging.wandb={projects: p}"], ["logging.wandb.projects", "project, entity, name, mode, tags"]),
        ("moe_parity", ["model.num_experts_per_tok=9"], ["num_experts_per_tok=9", "1..num_local_experts=8"]),
        ("moe_parity", ["model.router_aux_loss_coef=-1"], ["router_aux_loss_coef=-1", ">= 0"]),
        ("moe_parity", ["model.mlp_only_layers=[4]"], ["mlp_only_layers=[4]", "0..3"]),
        (
            "deepseek_parity",
            ["model.shared_expert_intermediate_size=32"],
            ["n_shared_experts=", "shared_expert_intermediate_size=32", "not both"],
        ),
    ],
)
def test_the_other_checks_refuse_with_one_line(recipe, overrides, words):
    """The door's remaining checks (config/checks.py, config/moe_checks.py), each on the parity
    recipe it applies to: one error line naming the key, the value and what is valid."""
    line = one_error_line(cli("validate", str(RECIPE_DIR / f"{recipe}.yaml"), *overrides))
    assert all(w in line for w in words), line


def test_smollm2_continue_without_init_from_hf_says_the_recipe_needs_it(tmp_path):
    """Issue 43 item 12: recipes/smollm2_continue.yaml has no `model` section; run without
    checkpoint.init_from_hf on a directory whose tokenizer outgrows the built-in default model,
    the error says to give checkpoint.init_from_hf=DIR (not to raise model.vocab_size)."""
    data = prepare_packed(tmp_path)  # byte tokenizer: 264 tokens > the default model's 256
    recipe = str(ROOT / "recipes" / "smollm2_continue.yaml")
    line = one_error_line(cli("validate", recipe, f"data.path={data}"))
    assert "checkpoint.init_from_hf=DIR" in line and "no `model` section" in line, line
