"""prepare-data --chat: conversations rendered with the tokenizer's own chat template, each
one document, with a per-token loss mask beside the tokens; checked token by token against
transformers' apply_chat_template (its ids, and the assistant mask it derives from the
template's {% generation %} blocks). Bad chat input: one error line naming file and row."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import PARITY, chat_rows, chat_tokenizer_dir, cli, one_error_line, write_jsonl

from dtensor3d.config.load import load_recipe
from dtensor3d.datasets.door import check_prepared_dir
from dtensor3d.datasets.prepare import PrepareOptions, prepare
from dtensor3d.errors import DataError


def _read(out, split: str, dtype: str):
    meta = json.loads((out / "meta.json").read_text())
    entry = meta["splits"][split]
    tokens = np.concatenate([np.fromfile(out / s["file"], dtype=dtype) for s in entry["shards"]])
    masks = np.concatenate([np.fromfile(out / s["mask"], dtype=np.uint8) for s in entry["shards"]])
    return meta, tokens, masks, np.fromfile(out / entry["docs"], dtype="<i8")


def test_chat_tokens_and_mask_match_transformers(tmp_path):
    from transformers import AutoTokenizer

    tok_dir, rows = chat_tokenizer_dir(tmp_path / "tok"), chat_rows(24)
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    options = PrepareOptions((str(data),), str(tmp_path / "out"), tokenizer=str(tok_dir), val_fraction=0.0)
    prepare(PrepareOptions(**{**options.__dict__, "chat": True, "shard_tokens": 500}))
    meta, tokens, masks, offsets = _read(tmp_path / "out", "train", "uint16")
    assert meta["loss_mask"]["roles"] == ["assistant"] and len(meta["splits"]["train"]["shards"]) > 1
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == json.loads(
        (tok_dir / "tokenizer_config.json").read_text()
    )["chat_template"]
    hf = AutoTokenizer.from_pretrained(tok_dir)
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    assert len(offsets) == len(rows) + 1 and meta["tokenizer"]["eos_id"] == eos
    counted = 0
    for k, row in enumerate(rows):  # one document per conversation, in input order
        want = hf.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        doc = slice(offsets[k], offsets[k + 1])
        assert tokens[doc].tolist() == want["input_ids"] + [eos], k
        assert masks[doc].tolist() == want["assistant_masks"] + [0], k
        counted += sum(want["assistant_masks"])
    assert 0 < counted < len(tokens) // 2  # prompts (and the default system turn) are most of it
    # The door checks the masks as it checks the shards: size, then (validate) sha256.
    recipe = load_recipe(PARITY, ["data.kind=tokens", f"data.path={tmp_path / 'out'}", "model.vocab_size=304"])
    check_prepared_dir(str(tmp_path / "out"), recipe, hashes=True)
    mask = tmp_path / "out" / meta["splits"]["train"]["shards"][1]["mask"]
    mask.write_bytes(bytes(1 - b for b in mask.read_bytes()))
    with pytest.raises(DataError, match=f"{mask}: sha256 differs"):
        check_prepared_dir(str(tmp_path / "out"), recipe, hashes=True)
    mask.write_bytes(mask.read_bytes()[:-1])
    with pytest.raises(DataError, match=f"{mask}: .* bytes, but meta.json records"):
        check_prepared_dir(str(tmp_path / "out"), recipe, hashes=False)


def test_chat_loss_roles_and_a_template_file(tmp_path):
    """--loss-roles user counts the user turns instead; --chat-template FILE gives a byte
    tokenizer a template (here one without generation blocks: the prefix rendering alone)."""
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    data = write_jsonl(tmp_path / "c.jsonl", rows)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}")
    prepare(PrepareOptions((str(data),), str(tmp_path / "o"), tokenizer="byte", val_fraction=0.0, chat=True,
                           loss_roles=("user",), chat_template=str(template)))  # fmt: skip
    _, tokens, masks, _ = _read(tmp_path / "o", "train", "uint16")
    text = "<user>hi\n<assistant>yo\n"
    assert bytes(tokens[:-1].tolist()).decode() == text and tokens[-1] == 256
    assert "".join(c for c, m in zip(text, masks) if m) == "<user>hi\n"


def test_bad_chat_input_is_one_error_line_and_writes_nothing(tmp_path):
    tok_dir = chat_tokenizer_dir(tmp_path / "tok")
    good = chat_rows(3)
    no_reply = write_jsonl(tmp_path / "a.jsonl", [*good, {"messages": [{"role": "user", "content": "hi"}]}])
    proc = cli("prepare-data", str(no_reply), "--chat", "--tokenizer", str(tok_dir), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert f"{no_reply}:4: no 'assistant' message" in line, line
    assert not (tmp_path / "o").exists()

    def refused(rows, match, **extra):
        data = write_jsonl(tmp_path / "b.jsonl", rows)
        options = PrepareOptions((str(data),), str(tmp_path / "o"), tokenizer=str(tok_dir), chat=True)
        with pytest.raises(DataError, match=match):
            prepare(PrepareOptions(**{**options.__dict__, **extra}))
        assert not (tmp_path / "o").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".o")] == []

    refused([*good, {"text": "x"}], r"b\.jsonl:4: no 'messages' list .*keys: \['text'\]")
    refused([{"messages": [{"role": "user"}]}], r"b\.jsonl:1: messages\[0\] is not an object")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    refused(good, r"tokenizer '.*plain' has no chat template .*--chat-template FILE", tokenizer=str(tmp_path / "plain"))


def test_sequence_length_is_for_the_chat_report_only(tmp_path):
    """prepare-data --sequence-length L (issue 43 item 2's report) without --chat, or below 1:
    one error line, nothing written."""
    data = write_jsonl(tmp_path / "a.jsonl", chat_rows(3))
    for extra in (["--tokenizer", "byte", "--text-field", "messages"], ["--chat", "--tokenizer", "byte"]):
        length = "32" if "--chat" not in extra else "0"
        line = one_error_line(
            cli("prepare-data", str(data), *extra, "--out", str(tmp_path / "o"), "--sequence-length", length)
        )
        assert f"--sequence-length {length}: a length >= 1, with --chat" in line, line
        assert not (tmp_path / "o").exists()
