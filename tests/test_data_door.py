"""Data errors at the door, through the real command line: validate (what launch.sh runs),
train and launch.sh each print one `error:` line, exit 2, start nothing, write nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import PARITY, ROOT

from dtensor3d.__main__ import main

NO_EVAL = "training.eval_every=0"


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def refused(path, *extra: str, commands=("validate", "train")) -> str:
    """The one error line of each command (all the same); no run directory is created."""
    lines = set()
    for command in commands:
        run_dir = f"{path}.run"
        args = [PARITY, "data.kind=tokens", f"data.path={path}", f"logging.run_dir={run_dir}", *extra]
        lines.add(one_error_line(run(sys.executable, "-m", "dtensor3d", command, *args)))
        assert not os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
    assert len(lines) == 1, lines
    return lines.pop()


def test_ids_beyond_the_vocabulary_under_tp2_via_launch(tmp_path):
    """Issue 15 item 1: ids up to 999 with vocab_size 256 trained silently at tp 2."""
    np.save(tmp_path / "ids.npy", np.arange(4096, dtype=np.int64) % 1000)
    proc = run(
        "bash",
        "launch.sh",
        PARITY,
        "data.kind=tokens",
        f"data.path={tmp_path / 'ids.npy'}",
        NO_EVAL,
        "parallelism.tp=2",
    )
    line = one_error_line(proc)
    assert "0..999" in line and "model.vocab_size=256" in line, line
    assert "0..999" in refused(tmp_path / "ids.npy", NO_EVAL)


@pytest.mark.parametrize(
    "name,content,needle",
    [
        ("float.npy", np.arange(100) + 0.7, "dtype float64"),
        ("bool.npy", np.ones(100, bool), "dtype bool"),
        ("two.npy", np.zeros((4, 50), np.int64), "2-D"),
        ("empty.npy", np.zeros(0, np.int64), "holds 0 tokens"),
        ("short.npy", np.zeros(32, np.int32), "holds 32 tokens, fewer than one sample"),
        ("neg.npy", np.full(100, -1, np.int64), "-1..-1"),
        ("odd.bin", b"\x01\x00\x02", "odd"),
        ("short.bin", b"\x01\x00" * 10, "holds 10 tokens"),
        ("text.txt", "some text\n" * 100, "prepare-data"),
        ("text.npy", "some text\n" * 100, "not a readable .npy"),
        ("nope.npy", None, "no such file or directory"),
    ],
)
def test_bad_token_files(tmp_path, name, content, needle):
    path = tmp_path / name
    if isinstance(content, np.ndarray):
        np.save(path, content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    line = refused(path, NO_EVAL)
    assert needle in line and str(path) in line, line


def test_a_single_token_file_has_no_validation_split(tmp_path):
    np.save(tmp_path / "ok.npy", np.arange(4096, dtype=np.int64) % 256)
    assert "training.eval_every" in refused(tmp_path / "ok.npy", commands=("validate",))


def test_data_path_with_synthetic_data_is_refused(tmp_path):
    proc = run(sys.executable, "-m", "dtensor3d", "validate", PARITY, f"data.path={tmp_path / 'x.npy'}")
    assert "data.kind is 'synthetic'" in one_error_line(proc)


@pytest.fixture
def prepared(tmp_path):
    (tmp_path / "in").mkdir()
    for i in range(30):
        (tmp_path / "in" / f"{i}.txt").write_text(f"document {i} " * 20)
    out = tmp_path / "data"
    assert main(["prepare-data", str(tmp_path / "in"), "--out", str(out), "--tokenizer", "byte", "--no-progress"]) == 0
    return out


def test_prepared_directory_problems(prepared):
    vocab = "model.vocab_size=264"
    assert "257 tokens, more than model.vocab_size=256" in refused(prepared, NO_EVAL)
    assert "fewer validation tokens" in refused(prepared, vocab, commands=("validate",))  # val-fraction 0.005
    assert "fewer than one sample" in refused(
        prepared, vocab, NO_EVAL, "training.sequence_length=8192", "model.max_position_embeddings=100000"
    )
    shard = prepared / "train_00000.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-2] + bytes([data[-2] ^ 1, data[-1]]))  # same size, other bytes
    assert "sha256" in one_error_line(
        run(
            sys.executable,
            "-m",
            "dtensor3d",
            "validate",
            PARITY,
            "data.kind=tokens",
            f"data.path={prepared}",
            vocab,
            NO_EVAL,
        )
    )
    shard.write_bytes(data[:-2])
    assert "truncated" in refused(prepared, vocab, NO_EVAL)
    shard.unlink()
    assert "train_00000.bin is missing" in refused(prepared, vocab, NO_EVAL)
    (prepared / "meta.json").write_text("{not json")
    assert "meta.json: unreadable" in refused(prepared, vocab, NO_EVAL)
    (prepared / "meta.json").unlink()
    assert "no meta.json" in refused(prepared, vocab, NO_EVAL)


def test_meta_records_what_the_door_reads(prepared):
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["max_token_id"] < meta["vocab_size"] == 257
