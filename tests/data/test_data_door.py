"""Data errors at the door, through the real command line: validate (what launch.sh runs),
train and launch.sh each print one `error:` line, exit 2, start nothing, write nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import PARITY, ROOT, one_error_line

from dtensor3d.__main__ import main

NO_EVAL = "training.eval_every=0"


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


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


def test_a_token_file_of_exactly_one_sample_is_valid(tmp_path):
    """Issue 43 item 19: sequence_length + 1 = 33 tokens is one sample: validate passes (.npy and
    .bin) and the sampler reads that window; the door and the sampler count samples with one
    definition (tokens.window_count), so at every file length they agree."""
    from dtensor3d.datasets.door import check_token_file
    from dtensor3d.datasets.sources import TokenFile
    from dtensor3d.errors import DataError

    ids = np.arange(33, dtype=np.int32) * 7 % 256
    np.save(tmp_path / "one.npy", ids)
    ids.astype(np.uint16).tofile(tmp_path / "one.bin")
    for name in ("one.npy", "one.bin"):
        args = [PARITY, "data.kind=tokens", f"data.path={tmp_path / name}", NO_EVAL]
        proc = run(sys.executable, "-m", "dtensor3d", "validate", *args)
        assert proc.returncode == 0, proc.stderr
        assert TokenFile(str(tmp_path / name), 32).sample(5).tolist() == ids.tolist()  # the one window, every time
    for n in range(20, 120):
        path = tmp_path / f"{n}.npy"
        np.save(path, np.arange(n, dtype=np.int32) % 256)
        try:
            check_token_file(str(path), 32, 256)
            door = True
        except DataError:
            door = False
        assert door == (n >= 33), n
        if door:
            tf = TokenFile(str(path), 32)
            assert tf.windows == (n - 1) // 32
            assert all(len(tf.sample(i)) == 33 for i in range(2 * tf.windows)), n


def test_a_single_token_file_has_no_validation_split(tmp_path):
    np.save(tmp_path / "ok.npy", np.arange(4096, dtype=np.int64) % 256)
    assert "training.eval_every" in refused(tmp_path / "ok.npy", commands=("validate",))


def test_data_path_with_synthetic_data_is_refused(tmp_path):
    proc = run(sys.executable, "-m", "dtensor3d", "validate", PARITY, f"data.path={tmp_path / 'x.npy'}")
    assert "data.kind is 'synthetic'" in one_error_line(proc)


@pytest.fixture(scope="module")
def prepared_once(tmp_path_factory):
    """One prepared directory (byte tokenizer: vocabulary 257; 30 documents, 7,030 training
    tokens, none held out at --val-fraction 0.005) that each case below copies and breaks."""
    root = tmp_path_factory.mktemp("prepared")
    (root / "in").mkdir()
    for i in range(30):
        (root / "in" / f"{i}.txt").write_text(f"document {i} " * 20)
    out = root / "data"
    assert main(["prepare-data", str(root / "in"), "--out", str(out), "--tokenizer", "byte", "--no-progress"]) == 0
    return out


def _flip_last_byte(path):
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, other bytes


def _flip_byte(path, at: int):
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def _write(name: str, text: str):
    return lambda d: (d / name).write_text(text)


def _truncate(name: str):
    return lambda d: (d / name).write_bytes((d / name).read_bytes()[:-2])


VOCAB = "model.vocab_size=264"
# Issue 10 item 2, one failure at a time: (id, how to break the copy, overrides, words of the
# error line, the key or file it must name ("{d}": the directory), the commands that refuse).
# The sha256 is only read by validate (and launch.sh, which runs it); train checks sizes.
LAUNCH, CHECKS = ("validate", "train", "launch.sh"), ("validate", "launch.sh")
DIR_CASES = [
    ("dir_missing", "missing", [VOCAB, NO_EVAL], "no such file or directory", "data.path '{d}'", LAUNCH),
    ("meta_missing", lambda d: (d / "meta.json").unlink(), [VOCAB, NO_EVAL], "no meta.json", "{d}", LAUNCH),
    ("meta_bad_json", _write("meta.json", "{not json"), [VOCAB, NO_EVAL], "unreadable", "{d}/meta.json", LAUNCH),
    (
        "meta_no_splits",
        _write("meta.json", '{"vocab_size": 257, "dtype": "uint16"}'),
        [VOCAB, NO_EVAL],
        "unreadable (KeyError",
        "{d}/meta.json",
        LAUNCH,
    ),
    (
        "shard_size",
        _truncate("train_00000.bin"),
        [VOCAB, NO_EVAL],
        "bytes, but meta.json records",
        "{d}/train_00000.bin",
        LAUNCH,
    ),
    (
        "offsets_size",
        _truncate("train_docs.bin"),
        [VOCAB, NO_EVAL],
        "bytes, but meta.json records",
        "{d}/train_docs.bin",
        LAUNCH,
    ),
    (
        "shard_missing",
        lambda d: (d / "train_00000.bin").unlink(),
        [VOCAB, NO_EVAL],
        "train_00000.bin is missing",
        "{d}",
        LAUNCH,
    ),
    (
        "shard_sha256",
        lambda d: _flip_last_byte(d / "train_00000.bin"),
        [VOCAB, NO_EVAL],
        "sha256 differs",
        "{d}/train_00000.bin",
        CHECKS,
    ),
    (
        "offsets_not_increasing",
        lambda d: _flip_last_byte(d / "train_docs.bin"),  # the last offset's high byte
        [VOCAB, NO_EVAL],
        "corrupt document offsets (the last is",
        "{d}/train_docs.bin",
        LAUNCH,
    ),
    (
        "offsets_sha256",
        lambda d: _flip_byte(d / "train_docs.bin", 8 * 5),  # offset 5's low bit: still increasing
        [VOCAB, NO_EVAL],
        "sha256 differs",
        "{d}/train_docs.bin",
        CHECKS,
    ),
    (
        "tokenizer_sha256",
        lambda d: (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text() + " "),
        [VOCAB, NO_EVAL],
        "sha256 differs",
        "{d}/tokenizer.json",
        CHECKS,
    ),
    ("vocab_too_large", None, [NO_EVAL], "257 tokens, more than model.vocab_size=256", "model.vocab_size", LAUNCH),
    (
        "fewer_than_one_sample",
        None,
        [VOCAB, NO_EVAL, "training.sequence_length=8192", "model.max_position_embeddings=100000"],
        "holds 7030 training tokens, fewer than one sample",
        "training.sequence_length",
        LAUNCH,
    ),
    ("no_validation_windows", None, [VOCAB], "fewer validation tokens", "data.validation", CHECKS),
]


def refuse_each(data, extra, commands, run_dir, capsys) -> str:
    """Each command's one error line (all equal): validate and train in this process, launch.sh
    as users run it. The run directory, holding an earlier run's metrics.jsonl, is left as it
    was; launch.sh prints nothing on stdout (no process count, so no torchrun)."""
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    ckpt = run_dir.parent / "ck"  # refused data creates no checkpoint directory either
    args = [PARITY, "data.kind=tokens", f"data.path={data}", f"logging.run_dir={run_dir}", f"checkpoint.dir={ckpt}"]
    args += extra
    lines = set()
    for command in commands:
        if command == "launch.sh":
            proc = run("bash", "launch.sh", *args)
            lines.add(one_error_line(proc))
            assert proc.stdout == "", proc.stdout[-2000:]
        else:
            capsys.readouterr()
            assert main([command, *args]) == 2, command
            captured = capsys.readouterr()
            err = captured.err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("error: ") and captured.out == "", (command, captured)
            lines.add(err[0])
        assert os.listdir(run_dir) == ["metrics.jsonl"] and not ckpt.exists(), command
        assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'
    assert len(lines) == 1, lines
    return lines.pop()


@pytest.mark.parametrize("name,breaks,extra,needle,names,commands", DIR_CASES, ids=[c[0] for c in DIR_CASES])
def test_prepared_directory_problem(prepared_once, tmp_path, capsys, name, breaks, extra, needle, names, commands):
    data = tmp_path / "data"
    if breaks != "missing":
        shutil.copytree(prepared_once, data)
        if breaks is not None:
            breaks(data)
    before = {p.name: p.read_bytes() for p in data.iterdir()} if data.exists() else None
    line = refuse_each(data, extra, commands, tmp_path / "run", capsys)
    assert needle in line and names.format(d=data) in line, line
    after = {p.name: p.read_bytes() for p in data.iterdir()} if data.exists() else None
    assert after == before  # the data directory is only read


def test_meta_records_what_the_door_reads(prepared_once):
    meta = json.loads((prepared_once / "meta.json").read_text())
    assert meta["max_token_id"] < meta["vocab_size"] == 257
    assert meta["splits"]["train"]["tokens"] == 7030 and meta["splits"]["val"]["tokens"] == 0


def test_every_prepared_file_is_hashed_and_an_older_directory_is_one_warning(prepared_once, tmp_path, capsys):
    """Issue 43 item 3: meta.json records the sha256 of every file prepare-data writes (shards,
    offsets, tokenizer.json); a directory an older prepare-data wrote, without the offsets' and
    the tokenizer's hashes, passes validate with one warning line naming them."""
    meta = json.loads((prepared_once / "meta.json").read_text())
    recorded = {meta["splits"][s]["docs"]: meta["splits"][s]["docs_sha256"] for s in ("train", "val")}
    recorded.update(meta["files"])
    recorded.update({sh["file"]: sh["sha256"] for s in ("train", "val") for sh in meta["splits"][s]["shards"]})
    from dtensor3d.datasets.tokendir import sha256_file

    assert sorted(recorded) == sorted(set(os.listdir(prepared_once)) - {"meta.json"})
    assert all(sha256_file(prepared_once / name) == digest for name, digest in recorded.items())
    old = tmp_path / "old"
    shutil.copytree(prepared_once, old)
    for s in ("train", "val"):
        del meta["splits"][s]["docs_sha256"]
    del meta["files"]
    (old / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    args = [PARITY, "data.kind=tokens", f"data.path={old}", VOCAB, NO_EVAL, f"logging.run_dir={tmp_path / 'run'}"]
    assert main(["validate", *args]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "train_docs.bin" in warnings[0] and "tokenizer.json" in warnings[0], warnings


def test_validate_names_a_changed_offsets_or_mask_file_of_a_real_prepare_data(tmp_path):
    """Issue 43 item 3, as a user runs it: prepare-data --chat (shards, offsets, masks, the
    template), then one flipped bit in the offsets file or in a loss mask: `python -m dtensor3d
    validate` prints one error line naming the file; an offset moved below the one before it is
    named as corrupt offsets; the untouched directory validates."""
    from helpers import CHATML

    (tmp_path / "in").mkdir()
    turns = [
        [{"role": "user", "content": f"q{i} " * 9}, {"role": "assistant", "content": f"a{i} " * 9}] for i in range(40)
    ]
    rows = [{"messages": t} for t in turns]
    (tmp_path / "in" / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "t.jinja").write_text(CHATML)
    out = tmp_path / "data"
    prep = [sys.executable, "-m", "dtensor3d", "prepare-data", str(tmp_path / "in"), "--out", str(out), "--chat"]
    prep += [
        "--chat-template",
        str(tmp_path / "t.jinja"),
        "--tokenizer",
        "byte",
        "--val-fraction",
        "0",
        "--no-progress",
    ]
    assert run(*prep).returncode == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["train"]["docs_sha256"] and meta["splits"]["train"]["shards"][0]["mask_sha256"]
    validate = [sys.executable, "-m", "dtensor3d", "validate", PARITY, "data.kind=tokens", VOCAB, NO_EVAL]
    assert run(*validate, f"data.path={out}").returncode == 0
    for name, at, needle in [
        ("train_docs.bin", 8 * 7, "sha256 differs"),  # offset 7's low bit: still increasing
        ("train_00000.mask", 100, "sha256 differs"),
        ("train_docs.bin", 8 * 7 + 6, "corrupt document offsets (offset 8 "),  # a high byte: 7 above 8
    ]:
        broken = tmp_path / f"broken_{at}_{name}"
        shutil.copytree(out, broken)
        _flip_byte(broken / name, at)
        line = one_error_line(run(*validate, f"data.path={broken}"))
        assert needle in line and str(broken / name) in line, line
