"""The library's recipe entry point, `from dtensor3d.recipe import load_recipe` (the contract
in DESIGN.md): a re-export of `dtensor3d.config.schema`, where the recipe is defined."""

from .config.schema import *  # noqa: F403
from .config.schema import load_recipe  # noqa: F401  (named for readers and linters)
