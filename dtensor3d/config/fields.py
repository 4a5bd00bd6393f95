"""How a recipe field is declared: once, in its section's dataclass (config/schema.py).

    pp_engine: Literal["1f1b", "afab"] = knob("1f1b", "the pipeline schedule")
    steps: int = knob(10, "optimizer steps to train", positive=True)

A field's type (a `Literal[...]` for a choice), default, bounds (`positive`), aliases
(nanotron's long names) and one-line doc live in that one declaration; loading, coercion,
the error lines, `validate --explain KEY` and docs/recipe.md are all derived from it.
Pure Python: no torch, nothing of dtensor3d.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

DOC, POSITIVE, ALIASES, EXPECTED = "doc", "positive", "aliases", "expected"


def knob(
    default: Any,
    doc: str,
    *,
    positive: bool = False,
    aliases: tuple[str, ...] = (),
    expected: str | None = None,
) -> Any:
    """A recipe field: its default, one-line doc, `positive` (must be > 0), `aliases` (other
    spellings a recipe may use) and `expected` (what to say a value should look like)."""
    meta = {DOC: doc, POSITIVE: positive, ALIASES: aliases, EXPECTED: expected}
    if isinstance(default, (list, dict, set)):
        raise TypeError("a recipe default must be immutable (a tuple, not a list)")
    return dataclasses.field(default=default, metadata=meta)


def field_types(cls: type) -> dict[str, Any]:
    """Each field's resolved type (the annotation itself, not its text)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(the type without `| None`, whether None is allowed)."""
    args = typing.get_args(tp)
    if (typing.get_origin(tp) in (typing.Union, types.UnionType)) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def choices_of(tp: Any) -> tuple[str, ...] | None:
    """The choices of a `Literal[...]` field (optional or not), else None."""
    base, _ = unwrap_optional(tp)
    return tuple(typing.get_args(base)) if typing.get_origin(base) is Literal else None


def type_text(tp: Any) -> str:
    """A field's type as a reader writes it: int, float, bool, str, a list of ..., one of ..."""
    base, optional = unwrap_optional(tp)
    choices = choices_of(base)
    if choices:
        text = "one of " + ", ".join(choices)
    elif base in (int, float, bool, str):
        text = base.__name__
    elif base == tuple[float, float]:
        text = "a list of two numbers"
    elif base == tuple[int, ...]:
        text = "a list of integers"
    elif base is dict:
        text = "a mapping"
    elif typing.get_origin(base) is tuple and dataclasses.is_dataclass(typing.get_args(base)[0]):
        keys = ", ".join(f.name for f in dataclasses.fields(typing.get_args(base)[0]))
        text = f"a list of {{{keys}}}"
    else:
        text = str(base)
    return text + (" or null" if optional else "")


def plain(value: Any) -> Any:
    """Tuples as lists, all the way down (YAML's safe dumper writes no tuple)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
