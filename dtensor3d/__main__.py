"""Command line: python -m dtensor3d {train,plan,validate} RECIPE [key.path=value ...]

A wrong recipe or argument prints one `error:` line on stderr and exits with status 2,
before torch is imported or any process group starts.
"""

from __future__ import annotations

import argparse
import os
import sys

from .recipe import RecipeError, load_recipe


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
    check = sub.add_parser("validate", help="check a recipe; print the processes per node")
    check.add_argument("--nnodes", type=int, default=1)
    for p in (train, plan, check):
        p.add_argument("recipe", help="path of a YAML recipe")
        p.add_argument("overrides", nargs="*", help="key.path=value")
    return parser


def _env_int(name: str) -> int | None:
    """An integer environment variable (unset: None); anything else is a RecipeError."""
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise RecipeError(f"{name}={text!r} is not an integer; torchrun sets it, or unset it") from None


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.command == "plan":
            from .plan import format_plan
            recipe = load_recipe(args.recipe, args.overrides, world_size=args.world)
            print(format_plan(recipe, args.json))
        elif args.command == "validate":
            recipe = load_recipe(args.recipe, args.overrides)
            world = recipe.parallelism.world_size
            if args.nnodes < 1 or world % args.nnodes:
                raise RecipeError(f"NNODES={args.nnodes}: the world size {world} is not divisible by it; "
                                  f"valid: a divisor of {world}")
            print(world // args.nnodes)
        elif args.command == "train":
            world = _env_int("WORLD_SIZE")
            recipe = load_recipe(args.recipe, args.overrides, world_size=world if world is not None else 1)
            from .train import train
            train(recipe)
    except RecipeError as e:
        rank = os.environ.get("RANK", "0")
        if not rank.strip().isdigit() or int(rank) == 0:  # one line per job, not one per rank
            print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
