"""The recipe's reference, generated from the field declarations (config/schema.py):
`validate --explain KEY` for one field (`--explain SECTION`: each key of a section), and docs/recipe.md for all of them
(`python -m dtensor3d.config.explain > docs/recipe.md`; a test checks it is current)."""

from __future__ import annotations

import dataclasses
import difflib
import json

from ..errors import RecipeError
from . import fields
from .schema import _SECTION_CLASSES, ALIASES, TYPES


def _default(f: dataclasses.Field) -> str:
    value = f.default
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _field(key: str) -> tuple[str, dataclasses.Field]:
    """(section, field) of `section.key` or an alias of it; a RecipeError naming the valid keys."""
    section, _, name = key.partition(".")
    if section not in _SECTION_CLASSES or not name:
        raise RecipeError(f"--explain {key!r}: expected a section ({', '.join(_SECTION_CLASSES)}) or section.key")
    name = ALIASES.get((section, name), name)
    by_name = {f.name: f for f in dataclasses.fields(_SECTION_CLASSES[section])}
    if name not in by_name:
        valid = sorted(by_name) + sorted(alias for (s, alias) in ALIASES if s == section)
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f"did you mean '{section}.{close[0]}'? " if close else ""
        raise RecipeError(f"--explain {key!r}: unknown key; {hint}valid: {', '.join(valid)}")
    return section, by_name[name]


def explain_section(section: str) -> str:
    """A whole section: its doc, then each key with its type, default and one-line doc."""
    cls = _SECTION_CLASSES[section]
    lines = [f"{section}: {' '.join((cls.__doc__ or '').split())}"]
    width = max(len(f.name) for f in dataclasses.fields(cls))
    for f in dataclasses.fields(cls):
        kind = fields.type_text(TYPES[section][f.name])
        lines.append(f"  {section}.{f.name:<{width}}  {f.metadata[fields.DOC]} ({kind}; default {_default(f)})")
    lines.append(f"validate --explain {section}.KEY prints one key's bounds and other spellings")
    return "\n".join(lines)


def explain(key: str) -> str:
    """A field's doc, type, default, bounds and aliases, a line each; for a section name
    alone, every key of the section (explain_section)."""
    if key in _SECTION_CLASSES:
        return explain_section(key)
    section, f = _field(key)
    meta = f.metadata
    lines = [f"{section}.{f.name}: {meta[fields.DOC]}", f"  type: {fields.type_text(TYPES[section][f.name])}"]
    lines.append(f"  default: {_default(f)}")
    if meta.get(fields.POSITIVE):
        lines.append("  bounds: > 0")
    if meta.get(fields.ALIASES):
        lines.append(f"  also spelled: {', '.join(f'{section}.{a}' for a in meta[fields.ALIASES])}")
    return "\n".join(lines)


def recipe_markdown() -> str:
    """docs/recipe.md: every section's fields as a table."""
    out = [
        "# Recipe reference",
        "",
        "Generated from the field declarations in `dtensor3d/config/schema.py` by",
        "`python -m dtensor3d.config.explain > docs/recipe.md` (a test checks it is current).",
        "`python -m dtensor3d validate --explain section.key` prints one field, `--explain section` them all.",
    ]
    for section, cls in _SECTION_CLASSES.items():
        out += ["", f"## `{section}`", "", (cls.__doc__ or "").strip(), ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            names = " or ".join(f"`{n}`" for n in (f.name, *f.metadata.get(fields.ALIASES, ())))
            kind = fields.type_text(TYPES[section][f.name]) + (", > 0" if f.metadata.get(fields.POSITIVE) else "")
            out.append(f"| {names} | {kind} | `{_default(f)}` | {f.metadata[fields.DOC]} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(recipe_markdown(), end="")
