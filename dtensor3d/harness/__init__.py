"""Downstream evaluation: lm-evaluation-harness on a checkpoint (`eval`), with dtensor3d's own model.

    python -m dtensor3d eval CKPT --tasks T1,T2 [--include-path DIR] [--limit N]
        [--batch-size B] [--num-fewshot K] [--output PATH] [--tp N] [--pp N]

CKPT: a step directory, a checkpoint directory (its newest step) or a Hugging Face directory
of a supported family; its tokenizer must be in or beside it. The harness's model class
`dtensor3d` (Dtensor3dLM, registered with lm_eval's registry) scores requests with the
single-device model: loglikelihood and loglikelihood_rolling batched (right-padded, so the
causal model's real positions see no padding), generate_until greedy, batched with a KV cache
(generate.greedy_batch: left-padded, per-row positions and masks). Tokenization is
transformers.AutoTokenizer's, exactly as lm_eval's HFLM does it on the export, so the two score
the same token ids. Under torchrun the harness splits the requests over the data-parallel
ranks (its own rank/world_size) and gathers the results on rank 0; --tp and --pp shard the
model (live.sharded_model), so one too big for a device can be evaluated.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

from ..errors import CheckpointError, DataError, RecipeError


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="lm-evaluation-harness tasks on a checkpoint (dtensor3d's model)")
    p.add_argument("ckpt", help="a step directory, a checkpoint directory (its newest) or a Hugging Face directory")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", help="a directory of extra task YAML files")
    p.add_argument("--limit", type=float, help="at most this many documents per task (a fraction if < 1)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="requests per forward (loglikelihood; generation: per batch, with one KV cache)",
    )
    p.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--output", help="write the harness's results JSON here")
    p.add_argument("--tp", type=int, default=1, help="under torchrun: tensor-parallel size (dp = world / (tp pp))")
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="under torchrun: pipeline stages (the trainer's split; each rank loads only its stage's weights)",
    )


def check_eval_args(args):
    """Every argument checked before the model loads; returns (task names, TaskManager)."""
    if importlib.util.find_spec("lm_eval") is None:
        raise RecipeError("eval: lm-evaluation-harness is not installed; pip install 'dtensor3d[eval]'")
    if not os.path.exists(args.ckpt):
        raise CheckpointError(f"eval: CKPT={args.ckpt!r}: no such checkpoint; give a step, checkpoint or HF directory")
    if args.include_path and not os.path.isdir(args.include_path):
        raise DataError(f"eval: --include-path={args.include_path!r}: no such directory; give a folder of task YAMLs")
    if args.batch_size < 1 or (args.limit is not None and args.limit <= 0):
        raise RecipeError(f"eval: need --batch-size >= 1 and --limit > 0 (got {args.batch_size}, {args.limit})")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp < 1 or world % args.tp:
        raise RecipeError(f"eval: --tp={args.tp} must divide the world size {world} (dp = world / (tp pp))")
    if args.pp < 1 or world % (args.tp * args.pp):
        raise RecipeError(
            f"eval: --pp={args.pp} must be >= 1 with tp x pp = {args.tp} x {args.pp} dividing the world size "
            f"{world} (dp = world / (tp pp))"
        )
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    manager = task_manager(args.include_path, tasks)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown or not tasks:
        where = f" or under --include-path={args.include_path!r}" if args.include_path else ""
        raise RecipeError(
            f"eval: --tasks={args.tasks!r}: unknown task {', '.join(unknown) or '(none given)'}; "
            f"give names lm-eval knows{where} (`lm-eval ls tasks` lists them)"
        )
    return tasks, manager


def task_manager(include_path: str | None, tasks):
    """lm-eval's task index. Indexing lm-eval's own tasks takes ~7 s a process (each rank builds
    one), so when every task named is a plain task (not a group or tag, which may pull lm-eval's
    own) under `include_path`, the index holds that folder alone; else lm-eval's and the folder's
    (where a name is in both, the folder's wins in either)."""
    from lm_eval.tasks import TaskManager

    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if tasks and set(tasks) <= set(own.all_subtasks):
            return own
    return TaskManager(include_path=include_path)


def check_recipe_eval(recipe) -> None:
    """The recipe's `eval` section at the door (config/eval_checks.py did the rest): every task
    known to lm-eval (its index, and eval.include_path's), and a tokenizer.json with the data."""
    if not recipe.eval.tasks:
        return
    from ..generate import find_tokenizer
    from .live import data_tokenizer_dir

    e = recipe.eval
    known = task_manager(e.include_path, e.tasks).all_tasks
    unknown = [t for t in e.tasks if t not in known]
    if unknown:
        where = f" or under eval.include_path={e.include_path!r}" if e.include_path else ""
        raise RecipeError(
            f"eval.tasks={list(e.tasks)}: unknown task {', '.join(unknown)}; give names lm-eval knows{where} "
            "(`lm-eval ls tasks` lists them)"
        )
    path = data_tokenizer_dir(recipe)
    try:
        find_tokenizer(path, None)
    except DataError:
        raise DataError(
            f"eval.tasks: the data {path!r} has no tokenizer.json in or beside it; the harness needs the data's "
            "tokenizer (prepare-data writes one)"
        ) from None


def evaluate(lm, tasks, manager, limit=None, num_fewshot=None, log_samples=False) -> dict | None:
    """The harness on `lm` (a Dtensor3dLM): its results dict on rank 0, None on the others."""
    from lm_eval import simple_evaluate

    from . import lm as _registered  # noqa: F401  (the model class `dtensor3d` in lm_eval's registry)

    limit = int(limit) if limit is not None and limit >= 1 else limit
    return simple_evaluate(
        model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot, log_samples=log_samples
    )


def _model_class(args, tokenizer):
    """One process: the whole model (LocalRunner). Under torchrun (WORLD_SIZE > 1): the model
    sharded over a (pp, dp = world / (tp pp), tp) mesh, FSDP over dp; the dp ranks split the
    requests, the tp ranks of each run them together and the pp ranks in turn through their
    stages (stages.StageChain), every forward in lockstep (live.MeshRunner)."""
    import contextlib

    from .lm import Dtensor3dLM

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return Dtensor3dLM(pretrained=args.ckpt, tokenizer=tokenizer, batch_size=args.batch_size)
    from .live import MeshRunner, sharded_model

    state = sharded_model(args.ckpt, args.tp, args.pp)
    runner = MeshRunner(state, contextlib.nullcontext)
    length = state.recipe.model.max_position_embeddings
    return Dtensor3dLM(runner=runner, tokenizer=tokenizer, batch_size=args.batch_size, max_length=length)


def run_eval(args) -> None:
    from lm_eval.utils import handle_non_serializable, make_table

    tasks, manager = check_eval_args(args)
    from .lm import hf_tokenizer

    tokenizer = hf_tokenizer(args.ckpt)  # before the weights: a checkpoint without one says so at once
    lm = _model_class(args, tokenizer)
    results = evaluate(lm, tasks, manager, args.limit, args.num_fewshot, log_samples=bool(args.output))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if results is None:  # not rank 0
        return
    print(make_table(results))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=handle_non_serializable)
        print(f"wrote {args.output}", file=sys.stderr)
