"""Long documents encoded in bounded pieces, so prepare-data's memory does not grow with the
longest document (the Rust tokenizer keeps about 175 bytes per character of one encode call).

A document longer than PIECE characters is cut into pieces of PIECE // 2 .. PIECE characters,
encoded BATCH pieces per `encode_batch_fast` call, each piece's ids kept as a numpy array.
Each cut is placed before a space that follows a non-whitespace character and precedes one
(`foo| bar`): every pre-tokenizer that splits text before whitespace (byte-level BPE with
GPT-2's, Llama 3's or Qwen's regex, Metaspace, Whitespace, BERT's) cuts there anyway, so the
pieces' tokens equal one-pass encoding exactly. Where it can't be exact, prepare-data says so
in its summary (meta.json's "pieces" records the counts):
- a piece's window holds no such space (minified text, base64, CJK without spaces): a hard
  cut at a character boundary (never inside a UTF-8 character), where the tokens may differ;
- a tokenizer without a pre-tokenizer (the model sees the whole text, as some SentencePiece
  conversions) or whose normalizer prepends to every input (`Prepend`): every cut may differ.
The byte tokenizer (no merges) is exact at any cut. Not pieced: --chat conversations (their
loss-mask spans are found in one pass) and --train-tokenizer's training pass (the trainer
reads whole documents).
"""

from __future__ import annotations

import json
import re

import numpy as np

PIECE = 1 << 18  # characters per piece at most; longer documents are cut
BATCH = 8  # pieces per encode_batch_fast call
_CUT = re.compile(r"(?<=\S) (?=\S)")  # a space between two non-whitespace characters
# Pre-tokenizers that split before whitespace (a cut before " x" is one they make).
SPLITTING = {"ByteLevel", "Split", "Metaspace", "Whitespace", "WhitespaceSplit", "BertPreTokenizer",
             "Punctuation", "Digits", "UnicodeScripts", "Sequence"}  # fmt: skip


class Pieces(list):
    """One long document's ids: a list of numpy arrays, one per piece; `hard`: its cuts made
    without a space (where the tokens may differ from one-pass encoding)."""

    hard = 0

    def total(self) -> int:
        return sum(len(a) for a in self)


def cut_bounds(text: str, size: int = PIECE) -> tuple[list[int], int]:
    """(piece boundaries 0 = b0 < b1 < ... = len(text), each piece at most `size` characters;
    the number of hard cuts): each cut at the first `_CUT` space in the second half of the
    window, else a hard cut at `size`."""
    bounds, hard, start = [0], 0, 0
    while len(text) - start > size:
        found = _CUT.search(text, start + size // 2, start + size)
        if found is None:
            cut, hard = start + size, hard + 1
        else:
            cut = found.start()
        bounds.append(cut)
        start = cut
    bounds.append(len(text))
    return bounds, hard


def encode_long(tok, text: str, dtype: np.dtype, size: int = PIECE) -> Pieces:
    """`text`'s ids, piece by piece (cut_bounds), BATCH pieces per call: memory bounded by
    BATCH * size characters of the tokenizer's work plus the ids themselves."""
    bounds, hard = cut_bounds(text, size)
    ids = Pieces()
    ids.hard = hard
    spans = list(zip(bounds[:-1], bounds[1:]))
    for i in range(0, len(spans), BATCH):
        batch = [text[a:b] for a, b in spans[i : i + BATCH]]
        for enc in tok.encode_batch_fast(batch, add_special_tokens=False):
            ids.append(np.array(enc.ids, dtype))
    return ids


def _types(node) -> list[str]:
    """Every "type" in a tokenizer.json component (a Sequence's parts included)."""
    if isinstance(node, dict):
        return [*([node["type"]] if isinstance(node.get("type"), str) else []), *_types(list(node.values()))]
    if isinstance(node, list):
        return [t for x in node for t in _types(x)]
    return []


def cuts_are_exact(tokenizer_json: str) -> bool:
    """Whether whitespace cuts give one-pass encoding's tokens with this tokenizer (see above)."""
    spec = json.loads(tokenizer_json)
    pre = _types(spec.get("pre_tokenizer"))
    no_regex = '"use_regex": false' in json.dumps(spec.get("pre_tokenizer")) or not pre
    if no_regex and not (spec.get("model") or {}).get("merges"):
        return True  # no merges (the byte tokenizer): every cut is exact
    return bool(pre) and set(pre) <= SPLITTING and not no_regex and "Prepend" not in _types(spec.get("normalizer"))
