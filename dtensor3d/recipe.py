"""The library's recipe entry point, `from dtensor3d.recipe import load_recipe` (the contract
in DESIGN.md): a re-export of dtensor3d.config (schema, loading, checks)."""

from .config.checks import validate  # noqa: F401
from .config.load import load_nanotron, load_recipe, parse_override, recipe_from_dict  # noqa: F401
from .config.schema import *  # noqa: F403
