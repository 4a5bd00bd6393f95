"""nanotron's `data_stages` as a recipe's data section (nanotron.py calls `data_fields`).

Every stage dummy (`dataset: null`): synthetic tokens, whatever the stage count (the stages
would switch one synthetic stream for the same one). Otherwise each stage is a mixture: its
`dataset.dataset_folder` as nanotron's Nanoset reads it (one folder; a list with
`dataset_weights`; a mapping folder -> weight), a token file (.npy / .bin) only alone. One
stage of one folder is `data.path`; more are `data.sources`, and the stages after the first
`data.stages` at their `start_training_step` (both count steps from 1). Refused: dummy and
real stages mixed, a Hugging Face dataset (prepare it with prepare-data), a list without
weights (nanotron weighs it by size), a stage at another sequence length, stages out of order.
Never imports torch.
"""

from __future__ import annotations

from typing import Any

from .nanotron_keys import Refusal

HOW = "give prepared directories: python -m dtensor3d prepare-data, then dataset_folder: DIR or {DIR: weight, ...}"


def _sources(k: int, dataset: Any) -> list[dict] | None:
    """Stage k's sources as recipe values ({path, weight}), None for dummy data."""
    where = f"data_stages.{k}.data.dataset"
    if dataset is None:
        return None
    folder = dataset.get("dataset_folder") if isinstance(dataset, dict) else None
    if isinstance(folder, str):
        return [{"path": folder, "weight": 1.0}]
    if isinstance(folder, dict) and folder:
        return [{"path": str(path), "weight": weight} for path, weight in folder.items()]
    weights = dataset.get("dataset_weights") if isinstance(dataset, dict) else None
    if isinstance(folder, list) and len(folder) == 1 and not weights:
        return [{"path": str(folder[0]), "weight": 1.0}]
    if isinstance(folder, list) and folder and isinstance(weights, list) and len(weights) == len(folder):
        return [{"path": str(path), "weight": w} for path, w in zip(folder, weights)]
    if isinstance(folder, list) and folder:
        raise Refusal(f"{where}.dataset_weights", weights, "give one weight per dataset_folder entry")
    raise Refusal(where, dataset, HOW)


def _stages(r) -> list[tuple[int, list[dict] | None]]:
    """(start step, sources or None) of each stage, checked."""
    out = []
    for k in range(len(r.get("data_stages"))):
        seq = r.get(f"data_stages.{k}.sequence_length")
        if seq is not None and seq != r.get("tokens.sequence_length"):
            raise Refusal(f"data_stages.{k}.sequence_length", seq, "every stage trains at tokens.sequence_length")
        start = r.get(f"data_stages.{k}.start_training_step", 1)
        if (k == 0 and start != 1) or (out and start <= out[-1][0]):
            why = "the first stage starts at step 1" if k == 0 else "stages in the order they begin"
            raise Refusal(f"data_stages.{k}.start_training_step", start, why)
        out.append((start, _sources(k, r.get(f"data_stages.{k}.data.dataset"))))
    return out


def data_fields(r) -> dict[str, tuple[Any, str]]:
    """The recipe's data fields of a nanotron config (module docstring), with where each came from."""
    if not r.get("data_stages"):
        return {"data.kind": ("synthetic", "data_stages unset: synthetic tokens (nanotron: dummy data)")}
    stages = _stages(r)
    dummy = [s is None for _, s in stages]
    if all(dummy):
        why = f"data_stages: dummy data (dataset null) in {'every stage' if len(stages) > 1 else 'the stage'}"
        return {"data.kind": ("synthetic", f"{why}: synthetic tokens")}
    if any(dummy):
        k = dummy.index(True)
        raise Refusal(f"data_stages.{k}.data.dataset", None, "dummy data in one stage and files in another; " + HOW)
    first = stages[0][1]
    out = {"data.kind": ("tokens", "data_stages: files")}
    if len(stages) == 1 and len(first) == 1:
        folder = first[0]["path"]
        return out | {"data.path": (folder, "data_stages.0.data.dataset.dataset_folder")}
    if any(s["path"].endswith((".npy", ".bin")) for _, sources in stages for s in sources):
        raise Refusal("data_stages", [s for _, s in stages], "a mixture reads prepared directories; " + HOW)
    out["data.sources"] = (first, "data_stages.0.data.dataset.dataset_folder (a mixture)")
    if len(stages) > 1:
        later = [{"start_step": start, "sources": sources} for start, sources in stages[1:]]
        out["data.stages"] = (later, "data_stages.1.. (start_training_step: the stage's first step)")
    return out
