"""prepare-data through the command line: round trips, worker-count independence, the
split, the output layout, and every bad input (exit 2, one `error:` line, nothing written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT

from dtensor3d.__main__ import main

DOCS = {
    "a.txt": "hello world\n",
    "sub/b.py": "def f(x):\n    return 'héllo wörld 日本'  # <|endoftext|> is text here\n",
    "sub/deep/c.md": "# title\n\nsome text\twith tabs\r\nand CRLF\n" * 20,
    "z.txt": "".join(f"line {i} of a longer document\n" for i in range(300)),
}
ROWS = ["row one", "row two, ünïcode", "", "row four\n"]


@pytest.fixture
def corpus(tmp_path) -> Path:
    root = tmp_path / "in"
    for name, text in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (root / "empty.txt").write_text("")
    (root / "rows.jsonl").write_text("".join(json.dumps({"text": r, "id": i}) + "\n" for i, r in enumerate(ROWS)))
    return root


def prepare(*args: str) -> int:
    return main(["prepare-data", *map(str, args), "--no-progress"])


def documents(out: Path, split: str) -> list[np.ndarray]:
    meta = json.loads((out / "meta.json").read_text())
    shards = [np.fromfile(out / s["file"], dtype=meta["dtype"]) for s in meta["splits"][split]["shards"]]
    stream = np.concatenate([np.zeros(0, meta["dtype"]), *shards])
    offsets = np.fromfile(out / f"{split}_docs.bin", dtype="<i8")
    assert offsets[0] == 0 and offsets[-1] == len(stream) == meta["splits"][split]["tokens"]
    return [stream[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def decoded_texts(out: Path) -> list[str]:
    from tokenizers import Tokenizer

    meta = json.loads((out / "meta.json").read_text())
    tok, eos = Tokenizer.from_file(str(out / "tokenizer.json")), meta["tokenizer"]["eos_id"]
    texts = []
    for split in ("train", "val"):
        for doc in documents(out, split):
            assert doc[-1] == eos and eos not in doc[:-1]
            texts.append(tok.decode(doc[:-1].tolist(), skip_special_tokens=False))
    return texts


@pytest.mark.parametrize("tokenizer", [["--tokenizer", "byte"], ["--train-tokenizer", "300"]])
def test_decode_gives_every_document_back(corpus, tmp_path, tokenizer, capsys):
    out = tmp_path / "out"
    assert prepare(corpus, "--out", out, "--val-fraction", "0.3", *tokenizer) == 0
    meta = json.loads((out / "meta.json").read_text())
    expected = [*DOCS.values(), *(r for r in ROWS if r)]
    assert sorted(decoded_texts(out)) == sorted(expected)
    assert meta["binary_skipped"] == 1 and meta["empty_skipped"] == 2  # empty.txt and the empty row
    assert meta["splits"]["val"]["documents"] > 0 and meta["splits"]["train"]["documents"] > 0
    assert meta["dtype"] == "uint16" and meta["max_token_id"] < meta["vocab_size"]
    assert capsys.readouterr().out.startswith(f"prepared {out}: train ")
    if tokenizer[0] == "--tokenizer":  # the byte tokenizer: id = byte value
        assert meta["vocab_size"] == 257 and meta["tokenizer"]["eos_id"] == 256
        for doc in documents(out, "train"):
            assert doc[:-1].max() < 256 and bytes(doc[:-1].astype(np.uint8)).decode() in expected


def test_output_is_identical_for_any_worker_count(corpus, tmp_path):
    outs = []
    for workers in (1, 2, 3):
        outs.append(tmp_path / f"w{workers}")
        args = ["--train-tokenizer", "320", "--workers", str(workers), "--shard-tokens", "500"]
        assert prepare(corpus, "--out", outs[-1], *args) == 0
    names = sorted(os.listdir(outs[0]))
    assert len([n for n in names if n.startswith("train_0")]) > 2  # several shards
    for other in outs[1:]:
        assert sorted(os.listdir(other)) == names
        for name in names:
            assert (other / name).read_bytes() == (outs[0] / name).read_bytes(), name


def test_split_depends_on_the_document_not_the_order(tmp_path):
    files = []
    for i in range(40):
        files.append(str(tmp_path / f"doc{i:02d}.txt"))
        Path(files[-1]).write_text(f"document number {i}\n")
    a, b = tmp_path / "a", tmp_path / "b"
    prepare(*files, "--out", a, "--tokenizer", "byte", "--val-fraction", "0.5")
    prepare(*reversed(files), "--out", b, "--tokenizer", "byte", "--val-fraction", "0.5")
    val = [sorted(d.tobytes() for d in documents(o, "val")) for o in (a, b)]
    assert val[0] == val[1] and 5 < len(val[0]) < 35


def test_tokenizer_directory_with_its_own_eos_and_globs(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    hub = tmp_path / "hub"
    hub.mkdir()
    tok.save(str(hub / "tokenizer.json"))
    (hub / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    out = tmp_path / "out"
    assert prepare(str(corpus / "*.txt"), "--out", out, "--tokenizer", hub, "--val-fraction", "0") == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"]["eos_token"] == "</s>" and meta["tokenizer"]["eos_id"] == 3
    assert not meta["tokenizer"]["eos_added"] and meta["splits"]["train"]["documents"] == 2  # a.txt, z.txt
    assert documents(out, "train")[0].tolist() == [1, 2, 3]


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["first row", "second row"]}), tmp_path / "d.parquet")
    out = tmp_path / "out"
    assert prepare(tmp_path / "d.parquet", "--out", out, "--tokenizer", "byte", "--text-field", "content") == 0
    assert sorted(decoded_texts(out)) == ["first row", "second row"]


def test_overwrite_replaces_only_what_prepare_data_wrote(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for extra, needle in (([], "--overwrite"), (["--overwrite"], "not a directory prepare-data wrote")):
        assert prepare(corpus, "--out", out, "--tokenizer", "byte", *extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error:") and needle in err
        assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    assert prepare(corpus, "--out", out, "--tokenizer", "byte") == 0  # an empty directory is fine
    assert prepare(corpus, "--out", out, "--train-tokenizer", "300", "--overwrite") == 0  # ours: replaced
    assert json.loads((out / "meta.json").read_text())["tokenizer"]["kind"] == "bpe"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".out")]  # no temporary left


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_out_overlapping_an_input_is_refused_and_nothing_is_touched(tmp_path, capsys):
    """--out equal to, above, or (through a symlink) inside an input: refused with or without
    --overwrite, before anything is written; the input tree is byte for byte what it was."""
    src = tmp_path / "par" / "raw"
    src.mkdir(parents=True)
    for i in (1, 2, 3):
        (src / f"d{i}.txt").write_text(f"doc {i}\n")
    (tmp_path / "link").symlink_to(src)
    before = _tree(tmp_path)
    cases = [
        ([src, "--out", src], "overlaps the input"),
        ([src, "--out", tmp_path / "par"], "overlaps the input"),
        ([tmp_path / "link", "--out", src / "sub"], "overlaps the input"),
        ([str(src / "*.txt"), "--out", src], "holds the input file"),
        ([src / "d1.txt", "--out", src], "overlaps the input"),
    ]
    for args, needle in cases:
        for extra in ([], ["--overwrite"]):
            capsys.readouterr()
            assert prepare(*args, "--tokenizer", "byte", *extra) == 2, args
            lines = capsys.readouterr().err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], (args, lines)
            assert _tree(tmp_path) == before, args


def test_issue_commands_as_a_user_runs_them(tmp_path):
    """The issue's reproductions as real processes (`python -m dtensor3d prepare-data`): --out
    the input directory or its parent with --overwrite, and --out under /proc or /sys: exit 2,
    one `error:` line, no traceback, the input tree byte for byte what it was."""
    src = tmp_path / "par" / "raw"
    src.mkdir(parents=True)
    for i in (1, 2, 3):
        (src / f"d{i}.txt").write_text(f"doc {i}\n")
    before = _tree(tmp_path)
    cases = [
        (src, "overlaps the input"),
        (tmp_path / "par", "overlaps the input"),
        ("/proc/dtensor3d-o", "lies under /proc"),
        ("/sys/dtensor3d-o", "lies under /proc"),
    ]
    for out, needle in cases:
        cmd = [sys.executable, "-m", "dtensor3d", "prepare-data", str(src), "--out", str(out)]
        proc = subprocess.run([*cmd, "--tokenizer", "byte", "--overwrite"], cwd=ROOT, capture_output=True, text=True)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), (out, proc.stderr)
        assert needle in lines[0] and "Traceback" not in proc.stdout + proc.stderr, (out, lines)
        assert _tree(tmp_path) == before, out


def test_latin1_text_is_kept_and_every_skipped_file_is_named(tmp_path, capsys):
    """A Latin-1 file is never silently dropped: the byte tokenizer keeps its raw bytes; a text
    tokenizer decodes it with U+FFFD (default), with --encoding latin-1 exactly, drops it by name
    under --encoding-errors skip, and refuses it under strict."""
    src = tmp_path / "in"
    src.mkdir()
    (src / "latin.txt").write_bytes(b"caf\xe9 au lait\n")
    (src / "ok.txt").write_text("plain text\n")
    (src / "blob.bin").write_bytes(b"\x00\x01")
    (src / "empty.txt").write_text("")
    assert prepare(src, "--out", tmp_path / "b", "--tokenizer", "byte", "--val-fraction", "0") == 0
    docs = sorted(bytes(d[:-1].astype(np.uint8)) for d in documents(tmp_path / "b", "train"))
    assert docs == [b"caf\xe9 au lait\n", b"plain text\n"]
    line = capsys.readouterr().out
    assert f"1 binary ({src / 'blob.bin'})" in line and f"1 empty ({src / 'empty.txt'})" in line
    train = ["--train-tokenizer", "300", "--val-fraction", "0"]
    assert prepare(src, "--out", tmp_path / "r", *train) == 0
    assert "café au lait\n" not in decoded_texts(tmp_path / "r") and "caf\ufffd au lait\n" in decoded_texts(
        tmp_path / "r"
    )
    assert f"1 decoded with U+FFFD replacements (see --encoding) ({src / 'latin.txt'})" in capsys.readouterr().out
    assert prepare(src, "--out", tmp_path / "l", *train, "--encoding", "latin-1") == 0
    assert "café au lait\n" in decoded_texts(tmp_path / "l")
    assert prepare(src, "--out", tmp_path / "s", *train, "--encoding-errors", "skip") == 0
    assert f"1 undecodable ({src / 'latin.txt'})" in capsys.readouterr().out
    assert json.loads((tmp_path / "s" / "meta.json").read_text())["undecodable_skipped"] == 1
    assert prepare(src, "--out", tmp_path / "x", *train, "--encoding-errors", "strict") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "latin.txt" in err[0] and "not valid utf-8" in err[0]
    assert not (tmp_path / "x").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".x.tmp")]


def _bad_cases(corpus: Path, tmp_path: Path) -> list[tuple[list, str]]:
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    (tmp_path / "afile").write_text("x")
    list_jsonl = tmp_path / "list.jsonl"
    list_jsonl.write_text("[1, 2]\n")
    return [
        ([corpus, "--out", tmp_path / "o"], "--tokenizer"),
        ([corpus, "--out", tmp_path / "o", "--tokenizer", "byte", "--train-tokenizer", "300"], "one of"),
        ([tmp_path / "nope", "--out", tmp_path / "o", "--tokenizer", "byte"], "no such file"),
        ([str(tmp_path / "*.nothing"), "--out", tmp_path / "o", "--tokenizer", "byte"], "matches no file"),
        ([corpus, "--out", tmp_path / "o", "--tokenizer", tmp_path / "none.json"], "none.json"),
        ([corpus, "--out", tmp_path / "o", "--tokenizer", tmp_path / "afile"], "cannot be read"),
        ([corpus, "--out", tmp_path / "o", "--tokenizer", "byte", "--val-fraction", "1"], "--val-fraction 1.0"),
        ([corpus, "--out", tmp_path / "o", "--tokenizer", "byte", "--val-fraction", "-0.1"], "--val-fraction -0.1"),
        ([corpus, "--out", tmp_path / "o", "--tokenizer", "byte", "--val-fraction", "nan"], "--val-fraction nan"),
        ([corpus, "--out", tmp_path / "o", "--tokenizer", "byte", "--val-fraction", "half"], "--val-fraction"),
        ([corpus, "--out", tmp_path / "o", "--tokenizer", "byte", "--workers", "0"], "--workers 0"),
        ([corpus, "--out", tmp_path / "o", "--tokenizer", "byte", "--hf-dataset", "x"], "not both"),
        ([corpus, "--out", tmp_path / "o", "--train-tokenizer", "100"], "at least 257"),
        ([corpus, "--out", tmp_path / "afile", "--tokenizer", "byte"], "existing file"),
        ([bad_jsonl, "--out", tmp_path / "o", "--tokenizer", "byte"], "bad.jsonl:2"),
        ([list_jsonl, "--out", tmp_path / "o", "--tokenizer", "byte"], "a JSON list, not an object"),
        ([corpus, "--out", "/proc/dtensor3d-o", "--tokenizer", "byte"], "lies under /proc"),
        ([corpus, "--out", "/sys/dtensor3d-o", "--tokenizer", "byte"], "lies under /proc, /sys"),
        ([corpus, "--out", tmp_path / "o", "--tokenizer", "byte", "--encoding", "utf-9"], "--encoding 'utf-9'"),
        ([corpus, "--out", tmp_path / "o", "--tokenizer", "byte", "--encoding-errors", "ignore"], "valid: replace"),
        ([corpus / "blob.bin", "--out", tmp_path / "o", "--tokenizer", "byte"], "no training text"),
    ]


def test_bad_inputs_one_line_nothing_written(corpus, tmp_path, capsys):
    """Through main() (the command line without a new interpreter per case: ~0.1 s each)."""
    for args, needle in _bad_cases(corpus, tmp_path):
        capsys.readouterr()
        assert main(["prepare-data", *map(str, args)]) == 2, args
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), (args, lines)
        assert needle in lines[0], (needle, lines[0])
        assert not (tmp_path / "o").exists()
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".o.tmp")]


def test_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [f"row {i}: some text, ünïcode" for i in range(50)]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": rows, "n": list(range(50))})}).save_to_disk(
        str(tmp_path / "dd")
    )
    out = tmp_path / "out"
    args = ["--hf-dataset", tmp_path / "dd", "--text-field", "body", "--tokenizer", "byte", "--val-fraction", "0.2"]
    assert prepare("--out", out, *args) == 0
    assert sorted(decoded_texts(out)) == sorted(rows)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["inputs"] == [f"hf:{tmp_path / 'dd'}:train"] and meta["splits"]["val"]["documents"] > 0
    assert prepare("--out", tmp_path / "o2", *args, "--split", "test") == 2
    assert prepare("--out", tmp_path / "o3", *args[:-4], "--text-field", "nope", "--tokenizer", "byte") == 2


def test_tokenizer_files_for_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from dtensor3d.datasets.tokenizer import byte_tokenizer, write_hf_tokenizer

    byte_tokenizer().save(str(tmp_path / "src.json"))
    (tmp_path / "hf").mkdir()
    assert write_hf_tokenizer(str(tmp_path / "src.json"), str(tmp_path / "hf"), 128) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def f(x):\n    return 'héllo'\n"
    assert tok.encode(text, add_special_tokens=False) == list(text.encode())
    assert tok.decode(list(text.encode())) == text and tok.eos_token_id == 256


def _stdlib_text(files: int) -> str:
    import glob
    import sysconfig

    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:files]
    return "".join(Path(p).read_text(encoding="utf-8", errors="replace") for p in paths)


def test_pieces_encoding_equals_one_pass_on_python_source(tmp_path):
    """Issue 43 item 5: a long document encoded in pieces cut at spaces (pieces.py) gives the
    tokens of one-pass encoding, on Python's stdlib source with a byte-level BPE (GPT-2's
    regex); each piece is at most the piece size; text without spaces is cut hard and counted."""
    from dtensor3d.datasets.pieces import cut_bounds, cuts_are_exact, encode_long
    from dtensor3d.datasets.tokenizer import byte_tokenizer, train_bpe

    text = _stdlib_text(40)
    tok = train_bpe([text], 1000)
    tok.encode_special_tokens = True
    one_pass = np.array(tok.encode(text, add_special_tokens=False).ids)
    pieces = encode_long(tok, text, np.dtype("uint16"), size=4096)
    assert len(pieces) > 100 and pieces.hard == 0 and cuts_are_exact(tok.to_str())
    assert np.array_equal(np.concatenate(pieces), one_pass)
    line = text.replace("\n", " ")  # one line
    bounds, hard = cut_bounds(line, 4096)
    sizes = np.diff(bounds)
    assert hard == 0 and len(sizes) > 100 and sizes.max() <= 4096 and sizes[:-1].min() >= 2048
    assert all(line[b] == " " and not line[b - 1].isspace() for b in bounds[1:-1])
    assert cut_bounds("x" * 10000, 4096) == ([0, 4096, 8192, 10000], 2)
    assert cuts_are_exact(byte_tokenizer().to_str())


def test_a_long_one_line_document_through_prepare_data(tmp_path):
    """prepare-data on a one-line file longer than a piece: meta.json and the summary say it was
    encoded in pieces, exactly, and its tokens equal the tokenizer's one-pass encoding."""
    from dtensor3d.datasets.pieces import PIECE
    from dtensor3d.datasets.tokenizer import train_bpe

    line = _stdlib_text(60).replace("\n", " ")
    assert len(line) > 2 * PIECE
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "long.txt").write_text(line, encoding="utf-8")
    tok = train_bpe([line[:200_000]], 500)
    tok.save(str(tmp_path / "tok.json"))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dtensor3d", "prepare-data", str(tmp_path / "in"), "--out", str(out)]
    cmd += ["--tokenizer", str(tmp_path / "tok.json"), "--val-fraction", "0", "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "1 document(s) over 262,144 characters encoded in pieces cut at spaces (tokens as one-pass" in proc.stdout
    meta = json.loads((out / "meta.json").read_text())
    assert meta["pieces"] == {"documents": 1, "piece_chars": PIECE, "hard_cuts": 0, "exact": True}
    from tokenizers import Tokenizer

    written = Tokenizer.from_file(str(out / "tokenizer.json"))
    written.encode_special_tokens = True
    (doc,) = documents(out, "train")
    assert doc[:-1].tolist() == written.encode(line, add_special_tokens=False).ids
