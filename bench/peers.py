"""dtensor3d side by side with what a user would pick instead, in one session (issue 25):

    python bench/peers.py [--rounds 3] [--steps 6] [--quick] [--only 'tp 2']

Rows (the same model shape and global batch on both sides, one thread per rank, fp32, CPU):
  world 1   plain transformers LlamaForCausalLM + torch AdamW    vs dtensor3d world 1
  dp 2      plain DDP loop / plain FSDP2 loop (fully_shard per layer) over the transformers
            model                                                  vs dp_mode replicate / shard
            (shard also with fsdp_reshard_after_forward never, and with fsdp_bucket_layers 4,
            against the FSDP2 loop with reshard_after_forward=False)
  tp 2      transformers' from_pretrained(tp_plan="auto") (where it cannot run on CPU/gloo,
            its error is printed and parallelize_module with transformers' own
            base_model_tp_plan is used)                            vs tp 2 ALL_REDUCE / REDUCE_SCATTER
            (each with tp_linear_async_communication off and on)
  generate  tokens/s of greedy generation after start-up, and the seconds of a whole
            one-token process: transformers' from_pretrained + generate vs dtensor3d generate
Each round runs one torchrun job per world size; in it each row's peer and dtensor3d are
built side by side in the same processes and stepped in turn, step by step (peer, ours, ours,
peer, ...), so both sides see the machine in the same seconds; each side's median step after
the first. Parallel efficiency (dp 2 rows): dtensor3d's tokens/s at twice the global batch
(each rank doing world 1's work), each in a fresh 2-rank job between two fresh world 1 jobs,
against twice their mean. Ratio = dtensor3d / peer (above
1: dtensor3d faster). `--quick`: tiny shapes, one round (the suite runs it; it checks every
row has a number, no time asserted).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

from common import ROOT, line, scratch

FULL = dict(vocab=2048, hidden=256, inter=688, layers=4, heads=8, kv=4, seq=256, batch=8, micro=2)
QUICK = dict(vocab=256, hidden=64, inter=128, layers=2, heads=4, kv=2, seq=32, batch=4, micro=2)
ASYNC = "parallelism.tp_linear_async_communication=true"
SHARD = ["parallelism.dp=2", "parallelism.dp_mode=shard"]
NEVER = "parallelism.fsdp_reshard_after_forward=never"
ROWS = [  # (name, ranks, peer worker, dtensor3d overrides or None: the row's peer only)
    ("world 1", 1, "plain", []),
    ("dp 2 replicate", 2, "ddp", ["parallelism.dp=2", "parallelism.dp_mode=replicate"]),
    ("dp 2 shard", 2, "fsdp", SHARD),
    ("dp 2 shard, reshard never", 2, "fsdp_never", [*SHARD, NEVER]),
    ("dp 2 shard, never, bucket 4", 2, "fsdp_never", [*SHARD, NEVER, "parallelism.fsdp_bucket_layers=4"]),
    ("tp 2 ALL_REDUCE", 2, "tp", ["parallelism.tp=2", "parallelism.tp_mode=ALL_REDUCE"]),
    ("tp 2 ALL_REDUCE async", 2, "tp", ["parallelism.tp=2", "parallelism.tp_mode=ALL_REDUCE", ASYNC]),
    ("tp 2 REDUCE_SCATTER", 2, "tp", ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"]),
    ("tp 2 REDUCE_SCATTER async", 2, "tp", ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER", ASYNC]),
]


def hf_config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["inter"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"], max_position_embeddings=max(shape["seq"], 64),
        tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip


def recipe_for(shape: dict, overrides: list[str]):
    from dtensor3d.config.checks import validate
    from dtensor3d.config.load import recipe_from_dict

    raw = {
        "model": dict(
            vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["inter"],
            num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv"], max_position_embeddings=max(shape["seq"], 64),
        ),
        "training": dict(
            sequence_length=shape["seq"], global_batch_size=shape["batch"], micro_batch_size=shape["micro"],
            steps=1000, eval_every=0, device="cpu",
        ),
        "optimizer": dict(lr=1e-4, warmup_steps=0, decay="constant"),
        "logging": {"run_dir": scratch("peers-")},
    }  # fmt: skip
    recipe = recipe_from_dict(raw, overrides)
    validate(recipe)
    return recipe


def ours(shape: dict, overrides: list[str], steps: int) -> list[float]:
    """One rank of dtensor3d's own setup and train_step: each step's seconds."""
    return list(itertools.islice(ours_steps(shape, overrides), steps))


def ours_steps(shape: dict, overrides: list[str]):
    """dtensor3d's setup, then one train_step per next(): its seconds."""
    from dtensor3d.datasets.sources import make_source
    from dtensor3d.training.train import rank_batch, setup, train_step

    state = setup(recipe_for(shape, overrides))
    source = make_source(state.recipe)
    for step in itertools.count():
        batch = rank_batch(state, source, step)
        start = time.perf_counter()
        train_step(state, batch)
        yield time.perf_counter() - start


def peer_model(kind: str, shape: dict, ckpt: str):
    """The transformers model as the peer `kind` prepares it on this rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "plain":
        return LlamaForCausalLM(hf_config(shape))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(LlamaForCausalLM(hf_config(shape)))
    if kind in ("fsdp", "fsdp_never"):
        from torch.distributed.fsdp import fully_shard

        model, reshard = LlamaForCausalLM(hf_config(shape)), kind == "fsdp"
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return tp_peer(shape, ckpt, mesh)


def tp_peer(shape: dict, ckpt: str, mesh):
    """transformers' own tensor parallelism: tp_plan="auto", else its base_model_tp_plan
    through torch's parallelize_module (the error printed once, by rank 0)."""
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaForCausalLM

    try:
        return LlamaForCausalLM.from_pretrained(ckpt, tp_plan="auto", attn_implementation="sdpa")
    except Exception as e:  # noqa: BLE001 -- reported, then the documented fallback
        if dist.get_rank() == 0:
            print(f"TP_AUTO_ERROR {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}", flush=True)
    model = LlamaForCausalLM.from_pretrained(ckpt, attn_implementation="sdpa")
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {k: styles[v]() for k, v in model.config.base_model_tp_plan.items() if v in styles}
    parallelize_module(model.model, mesh, plan)
    return model


def peer_steps(kind: str, shape: dict, ckpt: str):
    """The peer loop, one step per next() (its seconds): microbatches, summed loss over the
    global tokens, clip, AdamW."""
    import torch
    import torch.distributed as dist

    model = peer_model(kind, shape, ckpt)
    # transformers' tp plan leaves norms and embeddings plain: torch's foreach kernels refuse
    # a mix of DTensors and tensors (AdamW, clip_grad_norm_), so that loop goes per tensor.
    foreach = kind != "tp"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=foreach)
    dp = dist.get_world_size() if kind in ("ddp", "fsdp", "fsdp_never") else 1
    rank = dist.get_rank() if dp > 1 else 0
    gen, tokens = torch.Generator().manual_seed(0), shape["batch"] * shape["seq"]
    while True:
        rows = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1), generator=gen)
        rows = rows.chunk(dp)[rank]
        start = time.perf_counter()
        for mb in rows.split(shape["micro"]):
            logits = model(input_ids=mb[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), mb[:, 1:].flatten(), reduction="sum")
            (loss / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) if foreach else clip_mixed(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield time.perf_counter() - start


def in_turn(runs: dict, steps: int) -> dict[object, list[float]]:
    """{key: step seconds} of step generators stepped in turn, step by step, the order
    rotating each step (for two: a, b, b, a, ...)."""
    times: dict[object, list[float]] = {key: [] for key in runs}
    for step in range(steps):
        keys = list(runs)[step % len(runs) :] + list(runs)[: step % len(runs)]
        for key in keys:
            times[key].append(next(runs[key]))
    return times


def clip_mixed(model, max_norm: float = 1.0) -> None:
    """clip_grad_norm_ over tp-sharded DTensor and plain gradients: the sharded squares summed
    over tp (one all-reduce), the replicated ones counted once."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor) and any(q.is_shard() for q in g.placements)]
    square = torch.zeros(())
    for g in sharded:
        square += g.to_local().pow(2).sum()
    dist.all_reduce(square)
    for g in grads:
        if not any(g is s for s in sharded):
            square += (g.to_local() if isinstance(g, DTensor) else g).pow(2).sum()
    coef = min(1.0, max_norm / (square.sqrt().item() + 1e-6))
    for g in grads:
        g.mul_(coef)


def worker(args) -> None:
    """One rank of a job: each task of args.tasks in turn ([label, kind, overrides]); rank 0
    writes {label: [seconds per step]}."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    shape, times = QUICK if args.quick else FULL, {}
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    for label, kind, overrides in json.loads(args.tasks):
        if kind == "ours_x2":  # twice the global batch (world 1's work per rank at dp 2)
            times[label] = ours({**shape, "batch": 2 * shape["batch"]}, overrides, args.steps)
        elif kind == "ours":  # dtensor3d alone
            times[label] = ours(shape, overrides, args.steps)
        else:  # the row's peer (`kind`) and dtensor3d, stepped in turn: both see the machine in the same seconds
            pair = {f"peer {label}": peer_steps(kind, shape, args.ckpt), label: ours_steps(shape, overrides)}
            times.update(in_turn(pair, args.steps))
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(times, f)
    dist.barrier()
    dist.destroy_process_group()


def run_job(ranks: int, tasks: list, args, ckpt: str) -> dict[str, float]:
    """{label: median seconds per step (after the first)} of one torchrun job running `tasks`
    in order in the same processes."""
    out = os.path.join(scratch("result-"), "out.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", __file__]
    cmd += ["--worker", "--tasks", json.dumps(tasks), "--steps", str(args.steps), "--out", out, "--ckpt", ckpt]
    cmd += ["--quick"] * args.quick
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for text in proc.stdout.splitlines():
        if text.startswith("TP_AUTO_ERROR") and text not in args.seen:
            args.seen.add(text)
            print(f"transformers tp_plan='auto' cannot run here: {text.split(' ', 1)[1]}", flush=True)
    if proc.returncode:
        raise SystemExit(f"{tasks} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return {label: statistics.median(t[1:]) for label, t in json.load(f).items()}


def make_checkpoint(shape: dict) -> str:
    """A transformers checkpoint of the shape (random weights, seed 0) with a byte-level
    tokenizer.json: what both sides of the tp and generate rows load."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaForCausalLM

    path = scratch("peers-ckpt-")
    torch.manual_seed(0)
    LlamaForCausalLM(hf_config(shape)).save_pretrained(path)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.save(os.path.join(path, "tokenizer.json"))
    return path


def shared_checkpoint(shape: dict) -> str:
    """Inside a gloo job: rank 0 makes the checkpoint (`make_checkpoint`), every rank gets
    its path."""
    import torch.distributed as dist

    box = [make_checkpoint(shape) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    return box[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one round, 3 steps (the suite's run)")
    ap.add_argument("--only", help="rows whose name starts with one of these (comma-separated): 'tp 2', 'world 1,dp 2'")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tasks", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.steps = 1, 3
    shape, args.seen = QUICK if args.quick else FULL, set()
    tokens = shape["batch"] * shape["seq"]
    print(f"shape {shape}; {tokens} tokens/step; median step after the first; {args.rounds} round(s)", flush=True)
    ckpt = make_checkpoint(shape)
    results, scaled = train_rows(args, ckpt, tokens)
    peers = {"plain": "transformers + AdamW", "ddp": "DDP loop", "fsdp": "FSDP2 loop", "tp": "transformers tp"}
    peers["fsdp_never"] = "FSDP2 loop, no reshard"
    for name, _, kind, _ in ROWS:
        if name in results:
            print(line(name, peers[kind], *results[name], "tok/s"), flush=True)
    for name, per_round in scaled.items():
        spread = f"  (rounds {min(per_round):.2f}-{max(per_round):.2f})" if len(per_round) > 1 else ""
        eff = statistics.median(per_round)
        print(f"{name}: parallel efficiency (global batch x2: tokens/s / 2 x world 1) {eff:.2f}{spread}", flush=True)
    if any("generate".startswith(p) for p in (args.only or "").split(",")):
        from peers_generate import generate_rows

        generate_rows(args, ckpt)


def train_rows(args, ckpt: str, tokens: int) -> tuple[dict, dict]:
    """{row: ([dtensor3d tok/s per round], [peer tok/s per round])} and, for the dp 2 rows,
    {row: [parallel efficiency per round]} (`efficiencies`). Per round and world size, one
    job runs the rows: each row's peer and dtensor3d stepped in turn in the same processes
    (`in_turn`)."""
    chosen = [r for r in ROWS if r[0].startswith(tuple((args.only or "").split(",")))]
    results: dict[str, tuple[list, list]] = {name: ([], []) for name, *_ in chosen}
    scaled: dict[str, list] = {name: [] for name, *_ in chosen if name.startswith("dp 2") and "world 1" in results}
    for _ in range(args.rounds):
        for ranks in sorted({r[1] for r in chosen}):
            rows = [r for r in chosen if r[1] == ranks]
            got = run_job(ranks, [[name, kind, overrides] for name, _, kind, overrides in rows], args, ckpt)
            for name, *_ in rows:
                results[name][0].append(tokens / got[name])
                results[name][1].append(tokens / got[f"peer {name}"])
        if not scaled:  # no dp 2 row chosen (--only 'tp 2'): no efficiency runs
            continue
        overrides = {name: o for name, _, _, o in chosen if name in scaled}
        for name, eff in efficiencies(args, ckpt, tokens, overrides, results["world 1"][0][-1]).items():
            scaled[name].append(eff)
    return results, scaled


def efficiencies(args, ckpt: str, tokens: int, rows: dict[str, list], world_1: float) -> dict[str, float]:
    """{dp 2 row: dtensor3d's tokens/s at twice the global batch (world 1's work on each
    rank) / 2 x world 1's}, each setup in a 2-rank job of its own (fresh processes, as world 1
    has) between two world 1 jobs, against their mean: the machine's drift over minutes
    (BENCHMARKS.md, "Peers") reaches a ratio only through the seconds between neighbouring
    jobs. `--quick`: one job for every setup, against the round's world 1 (`world_1`)."""
    x2 = [[f"x2 {name}", "ours_x2", o] for name, o in rows.items()]
    if args.quick:
        got = run_job(2, x2, args, ckpt)
        return {label[3:]: 2 * tokens / got[label] / (2 * world_1) for label, _, _ in x2}
    alone = [["alone", "ours", []]]
    before, out = tokens / run_job(1, alone, args, ckpt)["alone"], {}
    for task in x2:
        speed = 2 * tokens / run_job(2, [task], args, ckpt)[task[0]]
        after = tokens / run_job(1, alone, args, ckpt)["alone"]
        out[task[0][3:]], before = speed / (before + after), after
    return out


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
