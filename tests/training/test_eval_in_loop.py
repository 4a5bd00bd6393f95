"""In-loop downstream evaluation (the recipe's `eval` section, harness/live.py) and W&B
(logging.wandb), on one pair of short 1-process runs on byte-tokenized prepared data:

- with `eval.every: 2`, `eval/<task>/<metric>` at steps 2 and 4 equal `dtensor3d eval` on the
  checkpoints of those steps (metrics.jsonl and W&B), and loss.svg gets a second panel;
- the losses and gradient norms equal the same run without evals, bitwise;
- at pp 2 (the requests through the stages, point to point; harness/stages.py) the same
  metrics (accuracies exact, perplexities to 1e-6) and the world-1 run's losses, bitwise;
- W&B offline: the run's history (read back from its .wandb file with wandb's own protobuf
  classes) holds every step's loss equal to metrics.jsonl, its config is the resolved recipe,
  loss.svg is among its files, and a resume from the step-4 checkpoint continues the same run id.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from helpers import PARITY, cli, one_error_line, prepare_words, torchrun

from dtensor3d.__main__ import main

pytest.importorskip("lm_eval")
wandb = pytest.importorskip("wandb")

TASKS_DIR = str(Path(__file__).parents[1] / "eval" / "tasks")
TASKS = "d3d_doc_mc,d3d_doc_ppl,d3d_doc_gen"
BASE = ["model.vocab_size=257", "data.kind=tokens", "training.micro_batch_size=2"]
BASE += ["training.eval_every=0"]
EVAL = ["eval.tasks=[d3d_doc_mc, d3d_doc_ppl, d3d_doc_gen]", "eval.every=2", "eval.limit=6"]
EVAL += [f"eval.include_path={TASKS_DIR}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(root, with evals and W&B, without evals, the resumed W&B run's records, with evals at pp 2)."""
    root = tmp_path_factory.mktemp("inloop")
    prepare_words(root, "words", 12, 3)
    saved = {k: os.environ.get(k) for k in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_SILENT")}
    os.environ.update(WANDB_DIR=str(root / "wb"), WANDB_CONFIG_DIR=str(root / "wbc"), WANDB_CACHE_DIR=str(root / "wbc"))
    os.environ["WANDB_SILENT"] = "true"
    try:
        wb = ["logging.wandb={project: d3d, mode: offline, tags: [test]}"]
        ck = [f"checkpoint.dir={root / 'ck'}", "checkpoint.interval=2", "checkpoint.keep=3"]
        run = root / "with"
        common = ["-m", "dtensor3d", "train", PARITY, f"data.path={root / 'words'}", *BASE, f"logging.run_dir={run}"]
        torchrun(1, [*common, "training.steps=4", *EVAL, *wb, *ck])
        first = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        torchrun(1, [*common, "training.steps=5", *wb, *ck])  # resumes step 4, no evals: one more step
        resumed = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        plain = root / "without"
        args = [PARITY, f"data.path={root / 'words'}", *BASE, "training.steps=4", f"logging.run_dir={plain}"]
        torchrun(1, ["-m", "dtensor3d", "train", *args])
        without = [json.loads(line) for line in (plain / "metrics.jsonl").read_text().splitlines()]
        pp2 = root / "pp2"
        args = [PARITY, f"data.path={root / 'words'}", *BASE, "training.steps=4", *EVAL, "parallelism.pp=2"]
        torchrun(2, ["-m", "dtensor3d", "train", *args, f"logging.run_dir={pp2}"])
        piped = [json.loads(line) for line in (pp2 / "metrics.jsonl").read_text().splitlines()]
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return root, first, without, resumed, piped


def test_in_loop_evals_equal_the_eval_command_on_those_steps_checkpoints(runs):
    root, first, *_ = runs
    evals = {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in first}
    assert [s for s, e in evals.items() if e] == [2, 4], evals
    for step in (2, 4):
        out = root / f"eval{step}.json"
        ck = str(root / "ck" / f"step_{step:08d}")
        assert (
            main(["eval", ck, "--tasks", TASKS, "--include-path", TASKS_DIR, "--limit", "6", "--output", str(out)]) == 0
        )
        results = json.loads(out.read_text())["results"]
        expected = {
            f"eval/{task}/{key.split(',')[0]}": value
            for task, values in results.items()
            for key, value in values.items()
            if "," in key and "_stderr" not in key and isinstance(value, float)
        }
        assert set(expected) == set(evals[step]), (expected, evals[step])
        for key, value in expected.items():  # the same logits: accuracies exact, perplexities to rounding
            assert evals[step][key] == pytest.approx(value, rel=1e-6, abs=0), (step, key)
            if key.endswith(("/acc", "/acc_norm", "/exact_match")):
                assert evals[step][key] == value
    svg = (root / "with" / "loss.svg").read_text()
    assert svg.count("<polyline") == 1 + len(evals[2]) and ">eval/d3d_doc_mc/acc</text>" in svg  # the second panel


def test_in_loop_evals_leave_training_bitwise_unchanged(runs):
    _, first, without, *_ = runs
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in first] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in without
    ]


def test_in_loop_evals_at_pp2_equal_world_1s(runs):
    """pp 2 (1f1b): every request (generation too, batched with a KV cache per stage's layers)
    through both stages, point to point, the logits broadcast back:
    the metrics of world 1 at steps 2 and 4 (accuracies exact; perplexities to 1e-6, the step-4
    weights differing from world 1's in their last bits: pp's gradient norm sums in another
    order), and the losses of world 1's run without evals, bitwise."""
    _, first, without, _, piped = runs
    assert [r["loss"] for r in piped] == [r["loss"] for r in without]
    assert [r["grad_norm"] for r in piped] == pytest.approx([r["grad_norm"] for r in without], rel=1e-6)
    for ours, ref in zip(piped, first, strict=True):
        evals = {k: v for k, v in ref.items() if k.startswith("eval/")}
        assert evals.keys() == {k for k in ours if k.startswith("eval/")}, (ours, ref)
        for key, value in evals.items():
            if key.endswith(("/acc", "/acc_norm", "/exact_match")):
                assert ours[key] == value, (ref["step"], key)
            assert ours[key] == pytest.approx(value, rel=1e-6, abs=0), (ref["step"], key)


def _wandb_records(path: Path):
    """The protobuf records of a .wandb file: its 7-byte header (":W&B", magic, version), then
    LevelDB's log format (32 KiB blocks of records: crc32c, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, chunks = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: zero padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        chunks, pos = chunks + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def _key(item) -> str:
    """An item's name: `key`, or its `nested_key` (W&B writes a name with '/' there)."""
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_history_config_files_and_resume(runs):
    root, first, _, resumed, _ = runs
    files = sorted((root / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2, files  # the first run and the resumed one
    history, ids, config = {}, set(), None
    for path in files:
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                config = config or {_key(i): json.loads(i.value_json) for i in record.run.config.update}
            elif kind == "history":
                items = {_key(i): json.loads(i.value_json) for i in record.history.item}
                history[record.history.step.num] = items
    assert len(ids) == 1, ids  # the resume continued the same W&B run
    state = json.loads((root / "ck" / "step_00000005" / "state.json").read_text())
    assert state["wandb_id"] in ids
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    for r in resumed:
        assert history[r["step"]]["loss/train"] == r["loss"], r["step"]  # every step's loss, exactly
    assert history[2]["eval/d3d_doc_mc/acc"] == first[1]["eval/d3d_doc_mc/acc"]
    assert config["training"]["steps"] == 4 and config["eval"]["every"] == 2  # the first run's resolved recipe
    assert list((root / "wb" / "wandb").glob("offline-run-*/files/loss.svg"))


def test_unknown_task_is_one_error_line_at_the_door(tmp_path):
    prepare_words(tmp_path, "words", 4, 3)
    args = [PARITY, f"data.path={tmp_path / 'words'}", *BASE, "training.steps=4", *EVAL[1:]]
    line = one_error_line(cli("validate", *args, "eval.tasks=[d3d_doc_mc, no_such_task]"))
    assert "eval.tasks=" in line and "unknown task no_such_task" in line, line


def test_wandb_not_installed_is_one_error_line(monkeypatch):
    from dtensor3d.config import eval_checks
    from dtensor3d.config.load import load_recipe
    from dtensor3d.errors import RecipeError

    monkeypatch.setattr(eval_checks, "installed", lambda name: name != "wandb")
    with pytest.raises(RecipeError, match=r"logging.wandb is set but wandb is not installed.*dtensor3d\[wandb\]"):
        load_recipe(PARITY, ["logging.wandb={project: p, mode: offline}"], world_size=1)
