"""prepare-data: text files -> a prepared directory (datasets/tokendir.py describes it).

    python -m dtensor3d prepare-data INPUT... --out DIR (--tokenizer PATH|byte | --train-tokenizer V)

Steps: expand the inputs (inputs.py); build the tokenizer (tokenizer.py: trained on the
training documents when asked); encode tasks in order, in this process or in `workers`
spawned processes (encode.py), with at most 2 * workers tasks in flight, so the corpus is
streamed, never held; append each task's tokens to its split's shards (tokendir.py); write
meta.json; rename the temporary directory into place. The output bytes depend only on the
inputs and options, never on `workers` (tasks are cut by size and collected in order).
"""

from __future__ import annotations

import codecs
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import DataError
from . import inputs, tokenizer
from .encode import NAMED, ChatRows, Chunk, Encoder, in_validation, init_worker, run_task, task_texts
from .tokendir import META, SPLITS, TOKENIZER, ShardWriter, sha256_file, token_dtype


@dataclass(frozen=True)
class PrepareOptions:
    inputs: tuple[str, ...]
    out: str
    tokenizer: str | None = None  # a tokenizer.json, a directory holding one, or "byte"
    train_tokenizer: int | None = None  # train a byte-level BPE of this many tokens
    val_fraction: float = 0.005
    workers: int = 1
    text_field: str = "text"
    overwrite: bool = False
    seed: int = 0  # of the validation split's hash
    exclude: tuple[str, ...] = ()
    shard_tokens: int = 1 << 28
    progress: bool = True
    hf_dataset: str | None = None  # see hf_datasets.py
    split: str = "train"
    encoding: str = "utf-8"  # of plain text files
    encoding_errors: str = "replace"  # replace | skip | strict: a file that does not decode
    chat: bool = False  # .jsonl rows of `messages`, rendered with the chat template, with a loss mask
    loss_roles: tuple[str, ...] = ("assistant",)  # --chat: the roles whose tokens count in the loss
    chat_template: str | None = None  # --chat: a template file (default: the tokenizer's own)

    def decoding(self) -> inputs.Decoding:
        return inputs.Decoding(self.encoding, self.encoding_errors, raw_bytes=self.tokenizer == "byte")


def check_options(o: PrepareOptions) -> None:
    """The arguments alone; nothing is read or written."""
    if (o.tokenizer is None) == (o.train_tokenizer is None):
        raise DataError(
            "prepare-data: give one of --tokenizer PATH (a tokenizer.json or 'byte') or --train-tokenizer VOCAB"
        )
    if not 0.0 <= o.val_fraction < 1.0:
        raise DataError(f"--val-fraction {o.val_fraction}: must be in [0, 1) (a fraction of the documents)")
    if o.workers < 1 or o.shard_tokens < 1:
        raise DataError(f"--workers {o.workers}, --shard-tokens {o.shard_tokens}: both must be >= 1")
    if not o.inputs and o.hf_dataset is None:
        raise DataError("prepare-data: no INPUT given; pass files, directories or globs (or --hf-dataset)")
    if o.encoding_errors not in inputs.ENCODING_ERRORS:
        raise DataError(f"--encoding-errors {o.encoding_errors!r}: valid: {', '.join(inputs.ENCODING_ERRORS)}")
    try:
        codecs.lookup(o.encoding)
    except LookupError:
        raise DataError(f"--encoding {o.encoding!r}: not a Python codec name (e.g. utf-8, latin-1, cp1252)") from None
    if (o.chat_template is not None or o.loss_roles != ("assistant",)) and not o.chat:
        raise DataError("--chat-template and --loss-roles apply to --chat only; add --chat")
    if o.chat and (o.hf_dataset is not None or not all(o.loss_roles)):
        raise DataError("--chat reads .jsonl files of conversations (not --hf-dataset) and needs --loss-roles names")


def chat_rows(o: PrepareOptions) -> ChatRows | None:
    """--chat: the template (checked to compile) and the roles, before anything is written."""
    if not o.chat:
        return None
    from .chat import Renderer, find_template

    path = None if o.tokenizer in (None, "byte") else o.tokenizer
    template = find_template(path, o.chat_template)
    Renderer(template)
    return ChatRows(template, o.loss_roles)


SYSTEM_TREES = ("/proc", "/sys", "/dev")  # never a place for a prepared directory


def _inside(path: str, folder: str) -> bool:
    """True when `path` is `folder` or lies under it (both already resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_out_apart(out: str, named: list[str], files: list[str]) -> None:
    """--out must not be an input, hold an input, or lie inside an input directory (resolved
    paths, symlinks followed): replacing it would delete the user's text."""
    target = os.path.realpath(out)
    for arg in named:
        src = os.path.realpath(arg)
        if _inside(target, src) or _inside(src, target):
            raise DataError(f"--out {out!r} overlaps the input {arg!r}; write the prepared directory elsewhere")
    for path in files:
        if _inside(os.path.realpath(path), target):
            raise DataError(f"--out {out!r} holds the input file {path!r}; write the prepared directory elsewhere")


def _written_by_us(out: str) -> bool:
    try:
        with open(os.path.join(out, META), encoding="utf-8") as f:
            return json.load(f).get("format") == "dtensor3d-tokens"
    except (OSError, ValueError, AttributeError):
        return False


def check_out(out: str, overwrite: bool) -> None:
    """An existing non-empty --out is refused unless --overwrite, and --overwrite replaces only
    a directory prepare-data wrote (its meta.json says so); the parent must be writable."""
    if any(_inside(os.path.realpath(out), t) for t in SYSTEM_TREES):
        raise DataError(
            f"--out {out!r} lies under {', '.join(SYSTEM_TREES)} (not a place for files); give a directory on a disk"
        )
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(f"--out {out!r} is an existing file; give a directory")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise DataError(f"--out {out!r} exists and is not empty; pass --overwrite to replace it")
    if os.path.isdir(out) and os.listdir(out) and not _written_by_us(out):
        raise DataError(
            f"--out {out!r} is not a directory prepare-data wrote (no dtensor3d meta.json); "
            "--overwrite replaces only those: give a new or empty directory"
        )
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise DataError(f"--out {out!r}: cannot create {parent!r}: {e.strerror}") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DataError(f"--out {out!r}: directory {parent!r} is not writable")


def _training_texts(tasks: Iterator[tuple], o: PrepareOptions, chat: ChatRows | None) -> Iterator[str]:
    for task in tasks:
        for text in task_texts(task, o.text_field, Chunk(), o.decoding(), chat):
            if isinstance(text, str) and text and not in_validation(text, o.val_fraction, o.seed):
                yield text


def build_tokenizer(o: PrepareOptions, tasks, chat: ChatRows | None = None) -> tuple[object, tokenizer.Eos, dict]:
    """(tokenizer, its end-of-document token, meta's "tokenizer" entry)."""
    if o.train_tokenizer is not None:
        tok = tokenizer.train_bpe(_training_texts(tasks(), o, chat), o.train_tokenizer)
        kind = {"kind": "bpe", "trained_vocab": o.train_tokenizer}
    elif o.tokenizer == "byte":
        tok, kind = tokenizer.byte_tokenizer(), {"kind": "byte"}
    else:
        tok, kind = tokenizer.load_tokenizer(o.tokenizer), {"kind": "file", "source": o.tokenizer}
    eos = tokenizer.with_eos(tok, None if o.train_tokenizer or o.tokenizer == "byte" else o.tokenizer)
    entry = {**kind, "file": TOKENIZER, "eos_id": eos.id, "eos_token": eos.token, "eos_added": eos.added}
    return tok, eos, entry


def chunks(tasks: Iterator[tuple], encoder_args: tuple, workers: int) -> Iterator[Chunk]:
    """Encoded tasks in task order: here (workers 1: groups of tasks, the Rust tokenizer's own
    threads) or in a pool of `workers` spawned processes (one task each, one Rust thread each)."""
    if workers == 1:
        yield from Encoder(*encoder_args).stream(tasks)
        return
    with multiprocessing.get_context("spawn").Pool(workers, init_worker, (encoder_args,)) as pool:
        pending: deque = deque()
        for task in tasks:
            pending.append(pool.apply_async(run_task, (task,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _progress(o: PrepareOptions, total: int | None):
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="prepare-data",
        file=sys.stderr,
        disable=not o.progress,
        mininterval=0.5,
    )


def write_splits(o: PrepareOptions, tmp: str, tasks, encoder_args: tuple, total: int | None) -> dict:
    """Encode every task into the shards under `tmp`; the counts meta.json records."""
    writers = {s: ShardWriter(tmp, s, encoder_args[2], o.shard_tokens, masked=o.chat) for s in SPLITS}
    counts = {"bytes": 0, "binary_skipped": 0, "undecodable_skipped": 0, "empty_skipped": 0, "replaced": 0}
    counts.update(max_token_id=-1, named={}, long_documents=0, hard_cuts=0)
    with _progress(o, total) as bar:
        for chunk in chunks(tasks(), encoder_args, o.workers):
            for s in SPLITS:
                writers[s].write(chunk.tokens[s], chunk.lengths[s], chunk.masks.get(s))
                if len(chunk.tokens[s]):
                    counts["max_token_id"] = max(counts["max_token_id"], int(chunk.tokens[s].max()))
            counts["bytes"] += chunk.bytes_read
            _add_counts(counts, chunk)
            bar.update(chunk.bytes_read)
            tokens = writers["train"].tokens + writers["val"].tokens
            rate = tokens / max(bar.format_dict["elapsed"], 1e-9)
            bar.set_postfix_str(f"{writers['train'].documents + writers['val'].documents:,} docs, {rate:,.0f} tokens/s")
    return {"splits": {s: w.close() for s, w in writers.items()}, **counts}


def _add_counts(counts: dict, chunk: Chunk) -> None:
    """A chunk's skipped and replaced files into meta's counts (NAMED files of each kind by name)."""
    counts["binary_skipped"] += chunk.binary
    counts["undecodable_skipped"] += chunk.undecodable
    counts["empty_skipped"] += chunk.empty
    counts["replaced"] += chunk.replaced
    counts["long_documents"] += chunk.long_documents
    counts["hard_cuts"] += chunk.hard_cuts
    for kind, names in chunk.named.items():
        kept = counts["named"].setdefault(kind, [])
        kept.extend(names[: NAMED - len(kept)])


def _publish(tmp: str, out: str) -> None:
    """Rename the finished temporary directory to `out` (replacing an old one only now)."""
    old = None
    if os.path.isdir(out):
        old = f"{tmp}.old"
        os.rename(out, old)
    os.rename(tmp, out)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _task_source(o: PrepareOptions):
    """(a function returning a fresh task iterator, the input list for meta, total bytes or None),
    after checking that --out stays apart from every input."""
    if o.hf_dataset is not None:
        from .hf_datasets import hf_tasks

        local = [o.hf_dataset] if os.path.exists(o.hf_dataset) else []
        check_out_apart(o.out, local, [])
        return (lambda: hf_tasks(o.hf_dataset, o.split, o.text_field)), [f"hf:{o.hf_dataset}:{o.split}"], None
    files = inputs.expand_inputs(list(o.inputs), list(o.exclude))
    check_out_apart(o.out, [a for a in o.inputs if os.path.exists(a)], files)
    return (lambda: inputs.plan_tasks(files, o.text_field)), list(o.inputs), inputs.total_bytes(files)


def _make_tmp(out: str) -> str:
    """The temporary directory beside `out` that becomes it at the end."""
    parent, base = os.path.split(os.path.abspath(out))
    tmp = os.path.join(parent, f".{base}.tmp-{os.getpid()}")
    try:
        os.makedirs(tmp)
    except OSError as e:
        raise DataError(f"--out {out!r}: cannot write in {parent!r}: {e.strerror}") from None
    return tmp


def prepare(o: PrepareOptions, seconds: dict | None = None) -> dict:
    """Write the prepared directory `o.out`; return its meta.json content. `seconds`, if
    given, receives "tokenizer": the time spent building (training) the tokenizer."""
    check_options(o)
    tasks, named_inputs, total = _task_source(o)
    check_out(o.out, o.overwrite)
    chat = chat_rows(o)
    start = time.perf_counter()
    tok, eos, tok_entry = build_tokenizer(o, tasks, chat)
    if seconds is not None:
        seconds["tokenizer"] = time.perf_counter() - start
    vocab = tokenizer.vocab_size(tok)
    dtype = token_dtype(vocab)
    tmp = _make_tmp(o.out)
    try:
        tok.save(os.path.join(tmp, TOKENIZER))
        args = (tok.to_str(), eos.id, dtype, o.val_fraction, o.seed, o.text_field, o.decoding(), chat)
        written = write_splits(o, tmp, tasks, args, total)
        if written["splits"]["train"]["tokens"] == 0:
            raise DataError(
                f"inputs {' '.join(named_inputs)}: no training text (every file binary, undecodable, empty or held out)"
            )
        meta = {"format": "dtensor3d-tokens", "version": 1, "tokenizer": tok_entry, "vocab_size": vocab}
        meta.update({"dtype": dtype, "val_fraction": o.val_fraction, "split_seed": o.seed, "inputs": named_inputs})
        meta.update(written, encoding=o.encoding, encoding_errors=o.encoding_errors)
        _pieces_entry(meta, tok.to_str())
        if chat is not None:
            meta["loss_mask"] = write_template(tmp, chat)
        meta["files"] = _file_hashes(tmp, chat is not None)
        with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        _publish(tmp, o.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _pieces_entry(meta: dict, tokenizer_json: str) -> None:
    """meta.json's "pieces": the documents longer than pieces.PIECE characters, encoded in
    pieces, their cuts made without a space, and whether the tokens equal one-pass encoding."""
    from .pieces import PIECE, cuts_are_exact

    documents, hard = meta.pop("long_documents"), meta.pop("hard_cuts")
    if documents:
        exact = hard == 0 and cuts_are_exact(tokenizer_json)
        meta["pieces"] = {"documents": documents, "piece_chars": PIECE, "hard_cuts": hard, "exact": exact}


def _pieces_note(meta: dict) -> str:
    """The summary's words on documents encoded in pieces ("" when none was)."""
    p = meta.get("pieces")
    if not p:
        return ""
    said = f"; {p['documents']:,} document(s) over {p['piece_chars']:,} characters encoded in pieces cut at spaces"
    if p["exact"]:
        return said + " (tokens as one-pass encoding)"
    if p["hard_cuts"]:
        return (
            said + f", {p['hard_cuts']:,} cut(s) without a space nearby, where tokens may differ from one-pass encoding"
        )
    return said + ": this tokenizer (no whitespace pre-tokenizer, or a prepending normalizer) may differ at the cuts"


def _file_hashes(tmp: str, chat: bool) -> dict:
    """The sha256 of each file beside the token arrays (validate checks them)."""
    names = [TOKENIZER]
    if chat:
        from .chat import TEMPLATE_FILE

        names.append(TEMPLATE_FILE)
    return {name: sha256_file(os.path.join(tmp, name)) for name in names}


def write_template(tmp: str, chat: ChatRows) -> dict:
    """--chat: the template beside tokenizer.json (generate --chat and export-hf find it there);
    meta.json's "loss_mask" entry."""
    from .chat import TEMPLATE_FILE

    with open(os.path.join(tmp, TEMPLATE_FILE), "w", encoding="utf-8") as f:
        f.write(chat.template.source)
    return {"roles": list(chat.roles), "chat_template": TEMPLATE_FILE, "template_origin": chat.template.origin}


def _skipped(meta: dict) -> str:
    """ "skipped 1 binary (a.bin), 0 undecodable, 2 empty (e.txt, f.txt); 1 decoded with U+FFFD (g.txt)"."""
    named = meta.get("named", {})

    def part(count: int, kind: str, label: str) -> str:
        names = named.get(kind, [])
        more = f", +{count - len(names)} more" if count > len(names) else ""
        return f"{count} {label}" + (f" ({', '.join(names)}{more})" if names else "")

    text = "skipped " + ", ".join(
        part(meta[f"{k}_skipped"], k, k) for k in ("binary", "undecodable", "empty") if f"{k}_skipped" in meta
    )
    if meta.get("replaced"):
        text += "; " + part(meta["replaced"], "replaced", "decoded with U+FFFD replacements (see --encoding)")
    return text


def summary(out: str, meta: dict, seconds: float, tokenizer_seconds: float = 0.0) -> str:
    """The one line prepare-data prints at the end; the rates are of the encoding pass alone
    (the whole time less the tokenizer's training, which is shown apart)."""
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    mb, encoding = meta["bytes"] / 1e6, max(seconds - tokenizer_seconds, 1e-9)
    rate = f"{mb / encoding:.2f} MB/s, {(tr['tokens'] + va['tokens']) / encoding:,.0f} tokens/s"
    trained = f"tokenizer trained in {tokenizer_seconds:.1f} s, " if meta["tokenizer"]["kind"] == "bpe" else ""
    return (
        f"prepared {out}: train {tr['documents']:,} documents / {tr['tokens']:,} tokens in {len(tr['shards'])} "
        f"shard(s), validation {va['documents']:,} / {va['tokens']:,}; vocab {meta['vocab_size']:,} "
        f"({meta['dtype']}), EOS {meta['tokenizer']['eos_id']}; {mb:.1f} MB in {seconds:.1f} s ({trained}"
        f"encoding {rate}); {_skipped(meta)}{_pieces_note(meta)}"
    )
