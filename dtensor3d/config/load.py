"""Loading a recipe: YAML (or a nanotron config) plus `section.key=value` overrides ->
`Recipe`, every value coerced to its field's declared type; one `RecipeError` line naming
the key, the value and what is valid."""

from __future__ import annotations

import difflib
import math
import os
import sys
from typing import Any

import yaml

from ..errors import RecipeError, is_rank0
from . import nanotron, nanotron_keys
from .checks import validate
from .data_sources import Source, Stage, data_warning, parse_sources, parse_stages
from .fields import choices_of, unwrap_optional
from .hf_config import hf_model_values, read_config_json
from .lr import decay_past_end
from .schema import _SECTION_CLASSES, ALIASES, ENUMS, EXPERT_ONLY, MLA_ONLY, NON_EMPTY, SECTIONS, TYPES, Recipe


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _kind(tp: Any) -> str:
    """The coercion a field's type asks for: int, float, bool, str (a choice too) or a tuple kind."""
    if choices_of(tp) or tp is str:
        return "str"
    if tp in (int, float, bool):
        return tp.__name__
    kinds = {tuple[float, float]: "tuple[float,float]", tuple[int, ...]: "tuple[int,...]", dict: "dict"}
    kinds[tuple[str, ...]] = "tuple[str,...]"
    return kinds.get(tp) or {tuple[Source, ...]: "sources", tuple[Stage, ...]: "stages"}[tp]


# Optional list keys whose null is not "none": [] is refused with what null means there.
EMPTY_IS_NOT_NULL = {
    "model.moe_layers": "null means every layer has experts; a dense model sets model.num_local_experts: 0",
}


def _coerce(where: str, value: Any, tp: Any) -> Any:
    """Check one value against its field's type; return it in canonical form."""
    base, optional = unwrap_optional(tp)
    ann = _kind(base)
    if (value is None or value == "") and optional:  # an empty value unsets an optional field
        return None
    if optional and ann == "str" and not choices_of(base) and str(value).lower() in ("none", "null"):
        return None  # data.validation=none: a path key's "none" is null, not a directory named none
    if optional and ann not in ("int", "float", "bool", "str", "dict") and value in ([], ()):
        if where in EMPTY_IS_NOT_NULL:  # an empty list that would not mean "none"
            raise RecipeError(f"{where}=[]: an empty list; {EMPTY_IS_NOT_NULL[where]}")
        return None  # data.stages=[]: none, as null
    if ann == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if ann == "float" and not isinstance(value, bool):
        number = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 3e-4 as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise RecipeError(f"{where}={value!r} must be a finite number")
            return number
    if ann == "bool" and isinstance(value, bool):
        return value
    if ann == "str" and isinstance(value, str):
        return value
    if ann == "dict" and isinstance(value, dict):
        return {str(k): v for k, v in value.items()}
    if ann == "tuple[float,float]" and isinstance(value, (list, tuple)) and len(value) == 2:
        return tuple(_coerce(where, v, float) for v in value)
    if ann == "tuple[int,...]" and isinstance(value, (list, tuple)):
        return tuple(_coerce(where, v, int) for v in value)
    if ann == "tuple[str,...]" and isinstance(value, (list, tuple)):
        return tuple(_coerce(where, v, str) for v in value)
    if ann in ("sources", "stages"):  # config/data_sources.py: each entry's keys named in its own error line
        return parse_sources(where, value) if ann == "sources" else parse_stages(where, value)
    raise _wrong_type(where, value, ann, optional)


def _wrong_type(where: str, value: Any, ann: str, optional: bool) -> RecipeError:
    """The one line for a value of the wrong type (an empty value and a non-integer number
    each get their own words: YAML 1.1 reads `1e9` as a string)."""
    expected = {
        "tuple[float,float]": "a list of two numbers",
        "tuple[int,...]": "a list of integers",
        "tuple[str,...]": "a list of strings",
        "dict": "a mapping",
    }
    want = expected.get(ann, ann) + (" or null" if optional else "")
    if value == "":
        return RecipeError(f"{where}='' is the empty string; expected {want}")
    number = _as_number(value)
    if ann == "int" and number is not None:
        hint = f", e.g. {int(number)}" if math.isfinite(number) and number.is_integer() else ""
        return RecipeError(f"{where}={value} must be an integer (expected int{hint})")
    return RecipeError(f"{where}={value!r} has type {_type_name(value)}; expected {want}")


def _as_number(value: Any) -> float | None:
    """A float, or a string that reads as a number in YAML 1.2 (`1e9`, `3.5`); else None."""
    if isinstance(value, float):
        return value
    if isinstance(value, str) and value.strip() and not value.strip().lstrip("+-").isdigit():
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}valid: {', '.join(valid)}"


def _build_section(name: str, raw: Any) -> Any:
    cls = _SECTION_CLASSES[name]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{name}={raw!r} must be a mapping of keys to values")
    types = TYPES[name]
    valid = sorted(list(types) + [alias for (s, alias) in ALIASES if s == name])
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {}  # canonical name -> the spelling the recipe used
    for key, value in raw.items():
        key = str(key)
        canon = ALIASES.get((name, key), key)
        if canon not in types:
            raise RecipeError(f"{name}.{key}: unknown key; {_suggest(key, valid)}")
        where = f"{name}.{key}"
        value = _coerce(where, value, types[canon])
        if (name, canon) in ENUMS and value is not None:
            choices = ENUMS[(name, canon)]
            match = [c for c in choices if c.lower() == value.lower()]
            if not match:
                raise RecipeError(f"{where}={value!r} is not a valid choice; valid: {', '.join(choices)}")
            value = match[0]
        elif value == "":  # a non-optional string that is no choice: run_dir, resume
            raise RecipeError(f"{where}='' is the empty string; expected {NON_EMPTY.get(where, 'a non-empty str')}")
        if canon in values and values[canon] != value:
            raise RecipeError(
                f"{where}={value!r} conflicts with {name}.{spelled[canon]}={values[canon]!r} "
                f"(aliases of one setting); give one of them"
            )
        values[canon] = value
        spelled[canon] = key
    return cls(**values)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'parallelism.tp=4' -> (['parallelism', 'tp'], 4); the value is read as a YAML scalar."""
    if "=" not in text:
        raise RecipeError(f"override {text!r} has no '='; expected key.path=value, e.g. parallelism.tp=2")
    path, _, raw = text.partition("=")
    keys = path.strip().split(".")
    if len(keys) != 2 or not all(keys):
        raise RecipeError(f"override {text!r}: key {path!r} must be section.key, e.g. training.steps=20")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""  # `key=`: the empty string (unsets an optional key)
    except yaml.YAMLError:
        raise RecipeError(f"override {text!r}: value {raw!r} is not a YAML scalar") from None
    return keys, value


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: str) -> dict[str, Any]:
    if os.path.isdir(path):
        raise RecipeError(f"recipe {path!r} is a directory; pass the path of a YAML recipe, e.g. recipes/3d.yaml")
    if not os.path.isfile(path):
        raise RecipeError(f"recipe {path!r}: no such file; pass the path of a YAML recipe, e.g. recipes/3d.yaml")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise RecipeError(f"recipe {path!r} is not UTF-8 text (byte {e.start}); pass a YAML recipe") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(f"recipe {path!r}{line}: YAML error: {problem}") from None
    if raw is None:
        raise RecipeError(f"recipe {path!r} is empty; expected sections {', '.join(SECTIONS)}")
    if not isinstance(raw, dict):
        raise RecipeError(
            f"recipe {path!r} must be a mapping of sections ({', '.join(SECTIONS)}), not {_type_name(raw)}"
        )
    return raw


def recipe_from_dict(
    raw: dict[str, Any],
    overrides: list[str] | tuple[str, ...] = (),
    strict: bool = False,
    world_size: int | None = None,
) -> Recipe:
    """A Recipe from a YAML mapping and key.path=value overrides. `strict` (a user's recipe, not
    a saved record): settings given that cannot apply to this model are refused too.
    `world_size` resolves `parallelism.dp: auto` (elastic jobs)."""
    raw = {str(k): v for k, v in raw.items()}
    for section in raw:
        if section not in SECTIONS:
            raise RecipeError(f"{section}: unknown section; {_suggest(section, list(SECTIONS))}")
    raw = _resolve_auto_dp(_model_from_hf(_apply_overrides(raw, overrides)), world_size)
    recipe = Recipe(**{name: _build_section(name, raw.get(name)) for name in SECTIONS})
    if strict:
        _check_applicable(raw, recipe)
    return recipe


AUTO = "auto"


def dp_is_auto(raw: dict[str, Any]) -> bool:
    """`parallelism.dp: auto`: dp is the world size over ep*pp*cp*tp, whatever the world is."""
    par = raw.get("parallelism")
    return isinstance(par, dict) and isinstance(par.get("dp"), str) and par["dp"].strip().lower() == AUTO


def _resolve_auto_dp(raw: dict[str, Any], world_size: int | None) -> dict[str, Any]:
    """raw with `parallelism.dp: auto` replaced by world_size / (ep*pp*cp*tp)."""
    if not dp_is_auto(raw):
        return raw
    if world_size is None:
        raise RecipeError(
            "parallelism.dp=auto: the data-parallel size comes from the world size, unknown here; launch it "
            "elastic (NNODES=MIN:MAX and NPROC_PER_NODE with bash launch.sh), give `plan --world N`, or set a number"
        )
    others = _build_section("parallelism", {**raw["parallelism"], "dp": 1}).world_size
    if world_size % others:
        raise RecipeError(
            f"parallelism.dp=auto: the world size {world_size} is not divisible by ep*pp*cp*tp = {others}; "
            f"give a world size that is a multiple of {others}"
        )
    return {**raw, "parallelism": {**raw["parallelism"], "dp": world_size // others}}


def read_recipe_raw(path: str, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The recipe file's mapping with the overrides applied, nothing resolved or checked (a
    nanotron config: its mapping as read; its dp is always a number)."""
    raw = _read_yaml(path)
    if nanotron_keys.is_nanotron(raw):
        return raw
    return _apply_overrides({str(k): v for k, v in raw.items()}, overrides)


def _model_from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    """No `model` section and a `checkpoint.init_from_hf` directory: the model is its config.json."""
    hf_dir = (raw.get("checkpoint") or {}).get("init_from_hf") if isinstance(raw.get("checkpoint"), dict) else None
    if raw.get("model") is not None or not isinstance(hf_dir, str) or not hf_dir:
        return raw
    path = os.path.join(hf_dir, "config.json")
    return {**raw, "model": hf_model_values(read_config_json(hf_dir, "checkpoint.init_from_hf"), path)}


def _apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """raw with each override set; a key given twice on the command line is refused, as in a file."""
    given: dict[tuple[str, str], tuple[str, Any]] = {}  # (section, canonical key) -> (override, value)
    for text in overrides:
        (section, key), value = parse_override(text)
        if section not in SECTIONS:
            raise RecipeError(f"override {text!r}: unknown section {section!r}; {_suggest(section, list(SECTIONS))}")
        canon = ALIASES.get((section, key), key)
        if (section, canon) in given:
            before, old = given[(section, canon)]
            if before.partition("=")[0].strip() == f"{section}.{key}":
                raise RecipeError(
                    f"override {text!r}: {section}.{key} is given twice on the command line; give it once"
                )
            if old != value:
                raise RecipeError(
                    f"override {text!r} conflicts with {before!r} (aliases of one setting); give one of them"
                )
        given[(section, canon)] = (text, value)
        body = raw.get(section)
        body = dict(body) if isinstance(body, dict) else {}
        # An override of an alias replaces whichever spelling the file used.
        for (s, alias), target in ALIASES.items():
            if s == section and target == canon:
                body.pop(alias, None)
        body.pop(canon, None)
        body[key] = value
        raw[section] = body
    return raw


# Model settings that only a mixture of experts uses (model.num_local_experts > 0).


def _check_applicable(raw: dict[str, Any], recipe: Recipe) -> None:
    """Settings the recipe or an override gave that cannot apply (their defaults are not refused)."""
    model = raw.get("model") or {}
    if recipe.model.num_local_experts == 0:
        given = [f"model.{k}={model[k]}" for k in EXPERT_ONLY if k in model]
        if given:
            raise RecipeError(
                f"{', '.join(given)}: expert settings on a dense model (model.num_local_experts=0) cannot "
                f"apply; remove them, or set num_local_experts > 0 for a mixture of experts"
            )
    given = [f"model.{k}={model[k]}" for k in MLA_ONLY if k in model]
    if given and not recipe.model.mla:
        raise RecipeError(
            f"{given[0]}: a multi-head latent attention setting cannot apply to family "
            f"{recipe.model.family!r}; remove it, or set model.family: deepseek_v3"
        )


def load_recipe(path: str, overrides: list[str] | tuple[str, ...] = (), world_size: int | None = None) -> Recipe:
    """Read, override and validate a recipe (or a nanotron config, mapped by nanotron.py).
    Raises RecipeError with one line."""
    raw = _read_yaml(path)
    conv = None
    if nanotron_keys.is_nanotron(raw):
        recipe, conv = _from_nanotron(raw, overrides)
    else:
        recipe = recipe_from_dict(raw, overrides, strict=True, world_size=world_size)
    validate(recipe, world_size)
    _warn(recipe, conv)
    return recipe


def _warn(recipe: Recipe, conv: nanotron.Conversion | None) -> None:
    """One warning line per job (rank 0, or outside torchrun): the nanotron keys ignored or
    approximated, a decay the user wrote that ends past training.steps, and the data section's
    (data_sources.data_warning: a stage past the last step, evaluation without validation)."""
    parts = [nanotron.warning_line(conv) if conv else None, decay_past_end(recipe.optimizer, recipe.training.steps)]
    parts.append(data_warning(recipe.data, recipe.training.steps, recipe.training.eval_every))
    text = "; ".join(part.removeprefix("warning: ") for part in parts if part)
    if text and is_rank0():
        print(f"warning: {text}", file=sys.stderr, flush=True)


def _from_nanotron(raw: dict[str, Any], overrides) -> tuple[Recipe, nanotron.Conversion]:
    conv = nanotron.convert(raw, overrides)
    return recipe_from_dict(conv.fields, conv.recipe_overrides, strict=True), conv


def load_nanotron(path: str, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Recipe, nanotron.Conversion]:
    """`convert-nanotron`: a nanotron config file -> its validated recipe and how each field mapped."""
    raw = _read_yaml(path)
    if not nanotron_keys.is_nanotron(raw):
        raise RecipeError(
            f"{path} is not a nanotron config (no model.model_config, and not two of the sections "
            f"{', '.join(nanotron_keys.NANOTRON_SECTIONS)}); it is a recipe already"
        )
    recipe, conv = _from_nanotron(raw, overrides)
    validate(recipe)
    return recipe, conv
