"""Data mixtures and stages as recipe values: `data.sources` (a weighted list of prepared
directories) and `data.stages` (mixtures that take over at given steps).

    data:
      kind: tokens
      sources: [{path: data/web, weight: 0.7, name: web}, {path: data/code, weight: 0.3}]
      stages: [{start_step: 900, sources: [{path: data/web, weight: 1}]}]

`parse_sources` / `parse_stages` read the YAML values into frozen `Source` / `Stage` values
(a source's name defaults to its directory's base name, its weight to 1), each mistake one
`RecipeError` line naming the key (`data.sources[1].weight`), the value and what is valid.
`mixture_problem` is the check that needs the whole data section. Pure Python: no torch, no
file access (the files are checked at the door, datasets/door.py).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

from ..errors import RecipeError
from .mixture_weights import weights_problem

SOURCE_KEYS = ("path", "weight", "name")
STAGE_KEYS = ("start_step", "sources")
# The names TensorBoard's loss/<name> tags already use (metrics.TB_TAGS).
RESERVED_NAMES = ("train", "val", "val_ppl")
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class Source:
    """One prepared directory of a mixture, its weight (any positive number; the weights of a
    mixture are its proportions) and its name (metrics' `loss/<name>`)."""

    path: str
    weight: float = 1.0
    name: str = ""


@dataclass(frozen=True)
class Stage:
    """A mixture that takes over at `start_step` (1-based, as metrics.jsonl counts steps)."""

    start_step: int
    sources: tuple[Source, ...]


def _mapping(where: str, value: Any, keys: tuple[str, ...]) -> dict:
    if not isinstance(value, dict):
        raise RecipeError(f"{where}={value!r} must be a mapping with keys {', '.join(keys)}")
    unknown = [str(k) for k in value if str(k) not in keys]
    if unknown:
        raise RecipeError(f"{where}.{unknown[0]}: unknown key; valid: {', '.join(keys)}")
    return {str(k): v for k, v in value.items()}


def _source(where: str, value: Any) -> Source:
    raw = _mapping(where, value, SOURCE_KEYS)
    path = raw.get("path")
    if not isinstance(path, str) or not path:
        raise RecipeError(f"{where}.path={path!r}: give a prepared directory (python -m dtensor3d prepare-data)")
    weight = raw.get("weight", 1.0)
    number = weight if isinstance(weight, (int, float)) and not isinstance(weight, bool) else None
    if isinstance(weight, str):  # YAML 1.1 reads 1e-1 as a string
        try:
            number = float(weight)
        except ValueError:
            number = None
    if number is None or not math.isfinite(number) or number <= 0:
        raise RecipeError(f"{where}.weight={weight!r} must be a positive number (the source's share of the mixture)")
    name = raw.get("name") or os.path.basename(os.path.normpath(path))
    if not isinstance(name, str) or not NAME.match(name) or name in RESERVED_NAMES:
        raise RecipeError(
            f"{where}.name={name!r}: a name is letters, digits, '_', '.' or '-' (it becomes loss/<name>), "
            f"other than {', '.join(RESERVED_NAMES)}"
        )
    return Source(path, float(number), name)


def parse_sources(where: str, value: Any) -> tuple[Source, ...]:
    """A YAML list of {path, weight, name} -> Sources; names unique within the list."""
    if not isinstance(value, (list, tuple)) or not value:
        raise RecipeError(f"{where}={value!r} must be a non-empty list of {{path, weight, name}}")
    sources = tuple(_source(f"{where}[{i}]", v) for i, v in enumerate(value))
    names = [s.name for s in sources]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise RecipeError(
                f"{where}[{i}].name={name!r} is also the name of {where}[{names.index(name)}]; "
                "give each source its own name"
            )
    return sources


def parse_stages(where: str, value: Any) -> tuple[Stage, ...]:
    """A YAML list of {start_step, sources} -> Stages, their start steps strictly increasing."""
    if not isinstance(value, (list, tuple)) or not value:
        raise RecipeError(f"{where}={value!r} must be a non-empty list of {{start_step, sources}}")
    stages = []
    for i, v in enumerate(value):
        raw = _mapping(f"{where}[{i}]", v, STAGE_KEYS)
        start = raw.get("start_step")
        if not isinstance(start, int) or isinstance(start, bool) or start < 1:
            raise RecipeError(f"{where}[{i}].start_step={start!r} must be a step >= 1 (steps count from 1)")
        if stages and start <= stages[-1].start_step:
            raise RecipeError(
                f"{where}[{i}].start_step={start} is not after {where}[{i - 1}].start_step="
                f"{stages[-1].start_step}; list the stages in the order they begin"
            )
        stages.append(Stage(start, parse_sources(f"{where}[{i}].sources", raw.get("sources"))))
    return tuple(stages)


def mixture_problem(data) -> str | None:
    """What is wrong with data.path / data.sources / data.stages together, or None."""
    if data.sources is not None and data.path is not None:
        return f"data.path={data.path!r} and data.sources are both given; give one of them"
    if data.stages and data.path is None and data.sources is None and data.stages[0].start_step != 1:
        return (
            f"data.stages[0].start_step={data.stages[0].start_step}: with neither data.path nor data.sources, "
            "the first stage must start at step 1 (it is the run's first mixture)"
        )
    if (data.sources or data.stages) and data.kind != "tokens":
        return (
            f"data.sources / data.stages read prepared directories, but data.kind is {data.kind!r}; "
            "set data.kind: tokens"
        )
    paths: dict[str, str] = {}  # one name, one directory, in every stage
    for where, sources in mixtures_of(data):
        if problem := weights_problem(where, sources):
            return problem
        for i, s in enumerate(sources):
            if s.name in RESERVED_NAMES:
                return f"{where}: the source name {s.name!r} is taken by loss/{s.name}; name the source otherwise"
            seen = paths.setdefault(s.name, os.path.normpath(s.path))
            if seen != os.path.normpath(s.path):
                return (
                    f"{where}[{i}]: name {s.name!r} is {s.path!r} here and {seen!r} in an earlier mixture; "
                    "a name stands for one directory in every stage"
                )
    return None


def data_warning(data, steps: int, eval_every: int) -> str | None:
    """What the data section asks that will not happen, for load's one warning line: stages
    that begin after the last step, and evaluation without validation windows."""
    parts = []
    stages = enumerate(data.stages or ())
    late = [f"data.stages[{i}].start_step={s.start_step}" for i, s in stages if s.start_step > steps]
    if late:
        parts.append(f"{', '.join(late)} past training.steps={steps}: never begins, its sources are never read")
    if data.kind == "tokens" and data.validation is None and eval_every > 0:
        parts.append(f"data.validation=null: no validation windows, training.eval_every={eval_every} evaluates nothing")
    return "; ".join(parts) or None


def mixtures_of(data) -> list[tuple[str, tuple[Source, ...]]]:
    """(key, sources) of each mixture the data section names, in step order (data.path is a
    mixture of one source, named after its directory)."""
    out = []
    if data.sources is not None:
        out.append(("data.sources", data.sources))
    elif data.path is not None and (data.stages or data.kind == "tokens"):
        out.append(("data.path", (Source(data.path, 1.0, os.path.basename(os.path.normpath(data.path))),)))
    for i, stage in enumerate(data.stages or ()):
        out.append((f"data.stages[{i}].sources", stage.sources))
    return out


def unique_sources(data) -> list[tuple[str, Source]]:
    """(key, source) of every source of every mixture once, by name, in order of first appearance."""
    seen: dict[str, tuple[str, Source]] = {}
    for where, sources in mixtures_of(data):
        for i, s in enumerate(sources):
            seen.setdefault(s.name, (f"{where}[{i}]" if where != "data.path" else where, s))
    return list(seen.values())
