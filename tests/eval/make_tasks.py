"""Write tests/eval/tasks/*.jsonl from Python's standard-library docstrings (text every machine
has). Run once; the JSONL files are committed so every Python version sees the same items.

    python tests/eval/make_tasks.py
"""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path

MODULES = ("json", "os.path", "string", "textwrap", "shutil", "functools", "itertools", "collections", "heapq")
MODULES += ("bisect",)


def functions() -> list[tuple[str, str]]:
    """(name, first docstring line cut to 50 characters) of the modules' public functions."""
    import importlib

    out = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            obj = getattr(module, attr)
            doc = inspect.getdoc(obj) if callable(obj) and not attr.startswith("_") else None
            line = doc.strip().splitlines()[0][:50] if doc and doc.strip() else ""
            if len(line) > 12 and line.isascii():
                out.append((attr, line))
    return sorted(set(out))


def main() -> None:
    here = Path(__file__).parent / "tasks"
    rng = random.Random(0)
    items = functions()
    rng.shuffle(items)
    items = items[:40]
    names = [n for n, _ in items]
    with open(here / "docstrings.jsonl", "w") as f:
        for name, line in items:
            wrong = rng.sample([n for n in names if n != name], 3)
            choices = wrong + [name]
            rng.shuffle(choices)
            row = {"name": name, "doc": line, "choices": choices, "gold": choices.index(name)}
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
