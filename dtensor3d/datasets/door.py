"""Data checks at the door: everything about data.path that can be seen before any process
group starts, each a DataError naming the key or file, the value and what is valid.

A prepared directory: meta.json readable, every shard, loss mask and offsets file there with the size
meta.json records (and, with `hashes`, the sha256 it records for them and for tokenizer.json and
the chat template: validate / launch.sh; a directory an older prepare-data wrote, without some of
those hashes, is one warning line), the offsets sane (0 first, increasing, the token count last), its
vocabulary within model.vocab_size, at least one sample of training tokens, and the
validation windows a run with eval_every > 0 reads. One token file: .npy of an integer
dtype and one dimension, or .bin of uint16; at least one sample; every id in
0..model.vocab_size-1 (a vectorised min/max over the memory map, in blocks). A mixture
(data.sources, data.stages): every source a prepared directory as above, all of one tokenizer.
data.document_masking: only prepared directories (their document offsets).
"""

from __future__ import annotations

import os
import sys

import numpy as np

from ..config.data_sources import unique_sources
from ..errors import DataError
from .tokendir import META, TOKENIZER, docs_name, mask_name, read_meta, sha256_file, window_count

BLOCK = 1 << 24  # tokens per block of the id range check


def _check_ids(path: str, tokens: np.ndarray, vocab: int) -> None:
    """Every id in 0..vocab-1 (no copy of the file beyond one block)."""
    lo, hi = 0, -1
    for start in range(0, len(tokens), BLOCK):
        block = tokens[start : start + BLOCK]
        lo, hi = min(lo, int(block.min())), max(hi, int(block.max()))
    if lo < 0 or hi >= vocab:
        raise DataError(
            f"data.path {path!r} holds token ids in {lo}..{hi}, outside 0..{vocab - 1} (model.vocab_size={vocab}); "
            f"use a model.vocab_size above {hi} or the tokenizer the model was built for"
        )


def _load_npy(path: str) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"data.path {path!r} is not a readable .npy array ({str(e).splitlines()[0]})") from None
    if tokens.ndim != 1:
        raise DataError(f"data.path {path!r} is a {tokens.ndim}-D array {tokens.shape}; a token file is 1-D")
    if tokens.dtype.kind not in "iu":
        raise DataError(
            f"data.path {path!r} has dtype {tokens.dtype}; token ids need an integer dtype (int32, int64, uint16, ...)"
        )
    return tokens


def _load_bin(path: str) -> np.ndarray:
    size = os.path.getsize(path)
    if size % 2:
        raise DataError(f"data.path {path!r}: {size} bytes, an odd count; a .bin token file holds uint16 ids")
    return np.memmap(path, dtype=np.uint16, mode="r") if size else np.zeros(0, np.uint16)


def check_token_file(path: str, sequence_length: int, vocab: int) -> None:
    """One .npy / .bin token file (the single-file form of data.kind tokens)."""
    if path.endswith(".npy"):
        tokens = _load_npy(path)
    elif path.endswith(".bin"):
        tokens = _load_bin(path)
    else:
        raise DataError(
            f"data.path {path!r} is neither a prepared directory nor a token file (.npy, .bin); for text, run "
            f"python -m dtensor3d prepare-data {path} --out DIR --tokenizer byte and give data.path=DIR"
        )
    if window_count(len(tokens), sequence_length) < 1:
        raise DataError(
            f"data.path {path!r} holds {len(tokens)} tokens, fewer than one sample of training.sequence_length + 1 "
            f"= {sequence_length + 1}"
        )
    _check_ids(path, tokens, vocab)


def _expected_files(meta: dict, split: str) -> list[tuple[str, int, str | None]]:
    """(name, bytes, sha256 or None) of each file meta.json lists for a split."""
    entry, itemsize = meta["splits"][split], np.dtype(meta["dtype"]).itemsize
    expected = [(s["file"], s["tokens"] * itemsize, s.get("sha256")) for s in entry["shards"]]
    if "loss_mask" in meta:  # prepare-data --chat: one uint8 per token beside each shard
        expected += [(mask_name(s["file"]), s["tokens"], s.get("mask_sha256")) for s in entry["shards"]]
    docs = entry.get("docs", docs_name(split))
    return [*expected, (docs, (entry.get("documents", 0) + 1) * 8, entry.get("docs_sha256"))]


def _check_files(path: str, meta: dict, split: str, hashes: bool) -> list[str]:
    """Each file there at its recorded size, the offsets sane, and (with `hashes`) each sha256
    as recorded. Returns the names whose sha256 meta.json does not record (a directory an
    older prepare-data wrote)."""
    expected = _expected_files(meta, split)
    for name, size, _ in expected:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise DataError(f"data.path {path!r}: {name} is missing ({META} lists it); prepare the directory again")
        if os.path.getsize(file) != size:
            raise DataError(
                f"{file}: {os.path.getsize(file)} bytes, but {META} records {size}; the file is truncated or "
                "replaced, prepare the directory again"
            )
    _check_offsets(os.path.join(path, expected[-1][0]), meta["splits"][split])
    for name, _, digest in expected if hashes else []:
        if digest and sha256_file(os.path.join(path, name)) != digest:
            file = os.path.join(path, name)
            raise DataError(f"{file}: sha256 differs from {META}'s; the file is corrupt, prepare the directory again")
    return [name for name, _, digest in expected if not digest]


def _check_offsets(file: str, entry: dict) -> None:
    """Document offsets: 0 first, strictly increasing (every document ends with its EOS), the
    last equal to the split's token count. Read as a memory map, in one vectorised pass."""
    offsets = np.memmap(file, dtype="<i8", mode="r") if os.path.getsize(file) else np.zeros(0, "<i8")
    bad = None
    if len(offsets) == 0 or offsets[0] != 0:
        bad = "the first is not 0"
    elif int(offsets[-1]) != entry["tokens"]:
        bad = f"the last is {int(offsets[-1])}, not the split's {entry['tokens']} tokens"
    elif len(offsets) > 1 and not bool(np.all(np.diff(offsets) > 0)):
        at = int(np.argmax(np.diff(offsets) <= 0))
        bad = f"offset {at + 1} ({int(offsets[at + 1])}) is not above offset {at} ({int(offsets[at])})"
    if bad:
        raise DataError(f"{file}: corrupt document offsets ({bad}); prepare the directory again")


def _check_named_files(path: str, meta: dict) -> list[str]:
    """tokenizer.json and the chat template against meta.json's "files" sha256."""
    for name, digest in meta.get("files", {}).items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise DataError(f"data.path {path!r}: {name} is missing ({META} lists it); prepare the directory again")
        if sha256_file(file) != digest:
            raise DataError(f"{file}: sha256 differs from {META}'s; the file is corrupt, prepare the directory again")
    return [] if "files" in meta else [TOKENIZER]


def _warn_unhashed(path: str, names: list[str]) -> None:
    """An older prepared directory: one warning line, not a refusal."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    print(
        f"warning: data.path {path!r}: {META} records no sha256 for {shown} (written by an older prepare-data); "
        "they are not checked: prepare the directory again to have every file checked",
        file=sys.stderr,
        flush=True,
    )


def check_prepared_dir(path: str, recipe, hashes: bool) -> dict:
    """A prepared directory against the recipe; returns its meta.json content."""
    meta = read_meta(path)
    vocab, length = recipe.model.vocab_size, recipe.training.sequence_length
    if meta["vocab_size"] > vocab:
        fix = f"set model.vocab_size to at least {meta['vocab_size']} (or model.pad_vocab_to_multiple_of for tp)"
        if recipe.model == type(recipe.model)() and not recipe.checkpoint.init_from_hf:
            fix = (
                "the recipe has no `model` section and its model is the built-in default: it takes its model "
                "from a Hugging Face directory, so give checkpoint.init_from_hf=DIR (DIR/config.json is the model)"
            )
        raise DataError(
            f"data.path {path!r}: its tokenizer has {meta['vocab_size']} tokens, more than model.vocab_size={vocab}; "
            + fix
        )
    unhashed = [name for split in ("train", "val") for name in _check_files(path, meta, split, hashes)]
    if hashes:
        unhashed += _check_named_files(path, meta)
        if unhashed:
            _warn_unhashed(path, unhashed)
    tokens = meta["splits"]["train"]["tokens"]
    if window_count(tokens, length) < 1:
        raise DataError(
            f"data.path {path!r} holds {tokens} training tokens, fewer than one sample of "
            f"training.sequence_length + 1 = {length + 1}"
        )
    return meta


def _check_validation(recipe, hashes: bool) -> None:
    d, length = recipe.data, recipe.training.sequence_length
    if d.validation is None:  # no validation (load warns that eval_every is ignored)
        return
    if d.validation != "split":
        if not os.path.isdir(d.validation):
            raise DataError(f"data.validation {d.validation!r}: no such directory; give 'split' or a prepared one")
        meta = check_prepared_dir(d.validation, recipe, hashes)
        if window_count(max(meta["splits"]["val"]["tokens"], meta["splits"]["train"]["tokens"]), length) >= 1:
            return
    elif window_count(read_meta(d.path)["splits"]["val"]["tokens"], length) >= 1:
        return
    where = d.path if d.validation == "split" else d.validation
    raise DataError(
        f"data.validation={d.validation!r}: {where!r} has fewer validation tokens than one sample of "
        f"{length + 1}; prepare it with a larger --val-fraction or set training.eval_every: 0"
    )


def _named(where: str, source) -> str:
    """A mixture source as its errors name it: data.sources[1].path 'DIR' (source 'code')."""
    key = where if where == "data.path" else f"{where}.path"
    return f"{key} {source.path!r} (source {source.name!r})"


def _check_source(where: str, source, recipe, hashes: bool) -> dict:
    """One mixture source checked as data.path is, its errors naming its key and name."""
    if not os.path.isdir(source.path):
        raise DataError(f"{_named(where, source)}: no such directory; give a prepared directory (prepare-data)")
    try:
        return check_prepared_dir(source.path, recipe, hashes)
    except DataError as e:
        text, said = str(e), f"data.path {source.path!r}"
        raise DataError(
            text.replace(said, _named(where, source), 1) if said in text else f"{_named(where, source)}: {text}"
        ) from None


def _check_mixture(recipe, hashes: bool) -> None:
    """data.sources / data.stages: each source a prepared directory (checked as data.path is),
    all with one tokenizer (tokenizer.json's bytes) and one vocabulary; with eval_every > 0
    and data.validation split, at least one validation window among them."""
    first, seen = None, []
    for where, source in unique_sources(recipe.data):
        meta = _check_source(where, source, recipe, hashes)
        file = os.path.join(source.path, TOKENIZER)
        tokenizer = (meta["vocab_size"], sha256_file(file) if os.path.isfile(file) else None)
        if first is None:
            first = (_named(where, source), tokenizer)
        elif tokenizer != first[1]:
            raise DataError(
                f"{_named(where, source)}: its tokenizer ({TOKENIZER}, vocabulary {tokenizer[0]}) differs from "
                f"{first[0]}'s (vocabulary {first[1][0]}); a mixture's sources share one tokenizer: "
                "prepare them with the same --tokenizer"
            )
        seen.append(meta["splits"]["val"]["tokens"])
    if recipe.training.eval_every > 0 and recipe.data.validation == "split":
        if window_count(max(seen), recipe.training.sequence_length) < 1:
            raise DataError(
                f"data.validation=split: no source of the mixture has a validation window of "
                f"{recipe.training.sequence_length + 1} tokens; prepare one with --val-fraction, give a "
                "prepared directory, or set training.eval_every: 0"
            )
    elif recipe.training.eval_every > 0:
        _check_validation(recipe, hashes)


def _check_document_masking(d) -> None:
    """data.document_masking needs document offsets: only a prepared directory has them."""
    if d.kind != "tokens":
        where = f"data.kind={d.kind!r} has no documents"
    elif d.path is not None and not os.path.isdir(d.path):
        where = f"data.path {d.path!r} is a single token file, which records no document boundaries"
    else:
        return
    raise DataError(
        f"data.document_masking=true: {where}; give data.kind=tokens and a prepared directory (prepare-data writes "
        "its document offsets) or set data.document_masking: false"
    )


def check_data_at_door(recipe, hashes: bool = False) -> None:
    """data.path against the recipe (see the module docstring); nothing for synthetic data."""
    d = recipe.data
    if d.document_masking:
        _check_document_masking(d)
    if d.kind != "tokens":
        return
    if d.sources is not None or d.stages is not None:
        _check_mixture(recipe, hashes)
        return
    if not os.path.exists(d.path):
        raise DataError(f"data.path {d.path!r}: no such file or directory; give a prepared directory or a token file")
    if os.path.isdir(d.path):
        check_prepared_dir(d.path, recipe, hashes)
        if recipe.training.eval_every > 0:
            _check_validation(recipe, hashes)
    else:
        if recipe.training.eval_every > 0 and d.validation is not None:
            raise DataError(
                f"data.path {d.path!r} is a single token file, which has no validation split; set "
                "training.eval_every: 0 or data.validation: null (no validation), or prepare a directory with "
                "prepare-data"
            )
        check_token_file(d.path, recipe.training.sequence_length, recipe.model.vocab_size)
