"""Command line: python -m dtensor3d {train,plan,validate} RECIPE [key.path=value ...]
                  python -m dtensor3d export-hf CKPT OUT | import-hf DIR OUT
                  python -m dtensor3d convert-nanotron CONFIG [key.path=value ...]

A wrong recipe or argument prints one `error:` line on stderr and exits with status 2,
before torch is imported or any process group starts.
"""

from __future__ import annotations

import argparse
import os
import sys

from .config.checks import validate
from .config.load import load_recipe
from .errors import RecipeError, UserError, is_rank0, say
from .launch.preflight import check_machine
from .plan.float8_door import check_float8_gather
from .plan.state_bytes import check_blocks


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        raise RecipeError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dtensor3d", description="5-D parallel LLM training on PyTorch's own parts")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="train a recipe (run under torchrun; see launch.sh)")
    plan = sub.add_parser("plan", help="print the mesh layout and groups of a recipe")
    plan.add_argument("--world", type=int, default=None, help="check against this world size")
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.add_argument("--gpu", default=None, help="estimate step time on this GPU: A100, H100, H200, B200, L40S, A10G")
    plan.add_argument("--peak-tflops", type=float, default=None, help="estimate step time at this peak TFLOP/s")
    plan.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for the step time (0.4)")
    plan.add_argument("--hardware", default=None, help="predict step time, tokens/s/GPU and the bound on this device")
    plan.add_argument("--nodes", type=int, default=None, help="--hardware: nodes the world spans (default: the fewest)")
    plan.add_argument("--hardware-file", default=None, help="--hardware: a YAML table of your own devices")
    plan.add_argument("--simulate", action="store_true", help="build one rank's model on meta under a fake group")
    plan.add_argument("--rank", type=int, default=None, help="the rank --simulate builds (0)")
    check = sub.add_parser("validate", help="check a recipe; print the processes per node")
    check.add_argument("--nnodes", default="1", help="N, or an elastic range MIN:MAX (launch.sh's NNODES)")
    check.add_argument("--nproc-per-node", type=int, default=0, help="processes per node (NPROC_PER_NODE; 0: unset)")
    check.add_argument(
        "--explain",
        metavar="KEY",
        help="print a recipe field's doc, type, default and valid values (a section name: each of its keys)",
    )
    for p in (train, plan, check):
        p.add_argument("recipe", nargs="?" if p is check else None, help="path of a YAML recipe")
        p.add_argument("overrides", nargs="*", help="key.path=value")
    export = sub.add_parser("export-hf", help="write a checkpoint as a Hugging Face Llama directory")
    export.add_argument("ckpt", help="a step directory, or a checkpoint directory (its newest)")
    export.add_argument("out", help="a new directory")
    export.add_argument("--max-shard-mb", type=float, default=5000.0, help="split model.safetensors above this")
    export.add_argument("--overwrite", action="store_true", help="replace OUT if export-hf wrote it")
    imp = sub.add_parser("import-hf", help="turn a Hugging Face Llama directory into a checkpoint")
    imp.add_argument("hf_dir", help="a directory with config.json and model.safetensors (or shards + index)")
    imp.add_argument("out", help="a new checkpoint directory")
    imp.add_argument("--overwrite", action="store_true", help="replace OUT if import-hf wrote it")
    conv = sub.add_parser("convert-nanotron", help="print the recipe YAML a nanotron config maps to")
    conv.add_argument("recipe", help="a nanotron YAML config")
    conv.add_argument("overrides", nargs="*", help="key.path=value, nanotron or recipe spelling")
    from .datasets.cli import add_prepare_parser

    add_prepare_parser(sub)
    from .generate import add_generate_parser

    add_generate_parser(sub)
    from .harness import add_eval_parser

    add_eval_parser(sub)
    return parser


def _check_checkpoints(recipe, hashes: bool, lock: bool = True) -> None:
    """checkpoint.dir (writable, not locked by another run), the checkpoint a run would resume
    from, or its init_from_hf directory (imports torch); logging.run_dir not locked by another run."""
    if lock:  # logging.run_dir: one run at a time writes its metrics.jsonl and loss.svg
        from .checkpoint.lock import check_run_dir_lock

        check_run_dir_lock(recipe)
    c = recipe.checkpoint
    if c.dir or c.resume not in ("auto", "none") or c.init_from_hf:
        from .checkpoint import check_at_door

        check_at_door(recipe, hashes, lock)


def _env_int(name: str) -> int | None:
    """An integer environment variable (unset: None); anything else is a RecipeError."""
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise RecipeError(f"{name}={text!r} is not an integer; torchrun sets it, or unset it") from None


def _plan(args) -> None:
    from .plan.report import format_plan, peak_tflops

    recipe = load_recipe(args.recipe, args.overrides, world_size=args.world)
    peak = peak_tflops(args.gpu, args.peak_tflops, args.mfu)
    perf = _hardware(args, recipe)
    if args.rank is not None and not args.simulate:
        raise RecipeError(f"plan: --rank {args.rank} is the rank --simulate builds; add --simulate")
    if args.simulate:
        from .plan.simulate import check_rank, format_simulate

        check_rank(recipe, args.rank or 0)  # before torch is imported
        print(format_simulate(recipe, args.rank or 0, args.json, peak=peak, mfu=args.mfu, perf=perf))
        return
    print(format_plan(recipe, args.json, peak=peak, mfu=args.mfu, perf=perf))


def _hardware(args, recipe):
    """(Hardware, nodes) for `plan --hardware NAME [--nodes N] [--hardware-file F]`, or None."""
    if args.hardware is None:
        if args.nodes is not None or args.hardware_file is not None:
            flag = "--nodes" if args.nodes is not None else "--hardware-file"
            raise RecipeError(f"plan: {flag} goes with --hardware NAME (the device to predict on)")
        return None
    from .plan.hardware import check_nodes, lookup

    hw = lookup(args.hardware, args.hardware_file)
    return hw, check_nodes(args.nodes, recipe.parallelism.world_size, hw)


def _validate(args) -> None:
    """launch.sh's door: the recipe, NNODES, this machine, the checkpoints; prints the processes per node.
    With --explain KEY: that recipe field's reference instead (config/explain.py)."""
    if args.explain:
        from .config.explain import explain

        print(explain(args.explain))
        return
    if args.recipe is None:
        raise RecipeError("validate: give a RECIPE (a YAML recipe), or --explain section.key")
    from .config.load import dp_is_auto, read_recipe_raw
    from .launch.elastic import check_node_range

    auto = dp_is_auto(read_recipe_raw(args.recipe, args.overrides))
    load = lambda world: load_recipe(args.recipe, args.overrides, world_size=world)  # noqa: E731
    recipe, nproc = check_node_range(load, auto, args.nnodes, args.nproc_per_node)
    check_machine(recipe, local_processes=nproc)
    check_blocks(recipe)  # optimizer.state_dtype: 8bit against the mesh's shards (plan/state_bytes.py)
    check_float8_gather(recipe)  # training.float8's FSDP all-gather against the mesh's shards (plan/float8_door.py)
    from .datasets.door import check_data_at_door
    from .harness import check_recipe_eval

    check_recipe_eval(recipe)  # eval.tasks: lm-eval's task names, the data's tokenizer

    # The data first: refused data leaves nothing behind (the checkpoint check creates checkpoint.dir).
    check_data_at_door(recipe, hashes=True)  # data.path: files, sizes, sha256, ids against vocab_size
    _check_checkpoints(recipe, hashes=True)
    print(nproc)


def _train(args) -> None:
    if os.environ.get("DTENSOR3D_AGENT_PID"):  # under launch.sh: never outlive the node's supervisor
        from .launch.nodes import die_with_parent

        die_with_parent()
    world = _env_int("WORLD_SIZE")
    recipe = load_recipe(args.recipe, args.overrides, world_size=world)
    if world is None and recipe.parallelism.world_size > 1:
        raise RecipeError(
            f"parallelism: the recipe needs {recipe.parallelism.world_size} processes and "
            f"this is one; run it with: bash launch.sh {args.recipe} ..."
        )
    validate(recipe, world_size=world if world is not None else 1)
    check_machine(recipe, local_processes=_env_int("LOCAL_WORLD_SIZE") or 1)
    check_blocks(recipe)
    check_float8_gather(recipe)
    from .datasets.door import check_data_at_door

    check_data_at_door(recipe, hashes=False)  # sha256: by validate (launch.sh)
    from .harness import check_recipe_eval

    check_recipe_eval(recipe)  # eval.tasks: lm-eval's task names, the data's tokenizer
    if not _env_int("RANK"):  # rank 0, which takes the locks next: a run_dir in use creates no checkpoint.dir
        from .checkpoint.lock import check_run_dir_lock

        check_run_dir_lock(recipe)
    _check_checkpoints(recipe, hashes=False, lock=False)  # sha256: by the ranks; the lock: next
    from .checkpoint import hold
    from .training.train import train

    with hold(recipe, _env_int("RANK") or 0):  # rank 0 holds checkpoint.dir's and logging.run_dir's locks
        train(recipe)
    if os.environ.get("DTENSOR3D_AGENT_PID"):
        _exit_now()


def _exit_now() -> None:
    """A rank whose training finished (every rank passed the final barrier, files closed, the
    process group destroyed) leaves without running C++ static destructors: one of torch's
    threads still joinable at interpreter exit aborted a finished rank now and then
    ("terminate called without an active exception", SIGABRT), and the agent then counted a
    finished job as failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _export_hf(args) -> None:
    from .checkpoint import export_hf

    files = export_hf(args.ckpt, args.out, max_shard_bytes=args.max_shard_mb * 1e6, overwrite=args.overwrite)
    print(f"wrote {args.out}: config.json, {', '.join(files)}")


def _convert_nanotron(args) -> None:
    from .config.load import load_nanotron
    from .config.nanotron import recipe_yaml, warning_line

    recipe, conv = load_nanotron(args.recipe, args.overrides)
    if line := warning_line(conv):
        print(line, file=sys.stderr, flush=True)
    print(recipe_yaml(conv, recipe.to_dict(), args.recipe), end="")


def _import_hf(args) -> None:
    from .checkpoint import import_hf

    print(f"wrote {import_hf(args.hf_dir, args.out, overwrite=args.overwrite)}")


def _generate(args) -> None:
    from .generate import run_generate

    run_generate(args)


def _eval(args) -> None:
    from .harness import run_eval

    run_eval(args)


def _prepare_data(args) -> None:
    from .datasets.cli import run_prepare

    run_prepare(args)


COMMANDS = {
    "plan": _plan,
    "validate": _validate,
    "train": _train,
    "export-hf": _export_hf,
    "convert-nanotron": _convert_nanotron,
    "import-hf": _import_hf,
    "prepare-data": _prepare_data,
    "generate": _generate,
    "eval": _eval,
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = _parser()
    # Overrides may also follow the options (`plan R --json tp=2`): argparse leaves them over.
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = list(getattr(args, "overrides", [])) + extra
    return args


def main(argv: list[str] | None = None) -> int:
    command = None
    try:
        args = _parse(argv)
        command = args.command
        COMMANDS[command](args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
    except UserError as e:
        say(e)  # one line per job, not one per rank
        return 2
    except BrokenPipeError:  # `plan ... | head`: the reader has what it wanted
        if command == "train":
            raise  # not a reader that stopped early
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
    except KeyboardInterrupt:  # Ctrl-C before training's own handler is in place (setup, a check, prepare-data)
        if is_rank0():
            print(
                f"interrupted: {command or 'dtensor3d'} stopped by Ctrl-C before it finished; nothing was saved",
                file=sys.stderr,
            )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
