"""Tokenizers for prepare-data and generate, all as Hugging Face `tokenizers` objects, so
every prepared directory holds a `tokenizer.json` that `transformers` can load.

    byte_tokenizer()        built in: id = byte value (0..255), then the end-of-document token
    train_bpe(texts, V)     a byte-level BPE of V tokens trained on the input itself
    load_tokenizer(PATH)    a `tokenizer.json`, or a directory holding one (as HF models ship)
    with_eos(tok, ...)      the tokenizer's own end-of-document token, else one added

Byte-level tokenizers map the 256 bytes onto 256 printable characters (GPT-2's table: the
printable Latin-1 bytes stand for themselves, the rest are shifted above 255), so decoding
the ids of a text gives the text back exactly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import DataError

EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizers, in the order they are looked for.
KNOWN_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")


@dataclass(frozen=True)
class Eos:
    id: int
    token: str
    added: bool  # True: the tokenizer had none, prepare-data added `token`


def byte_to_char() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2's convention)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def _byte_level(tok):
    from tokenizers import decoders, pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def byte_tokenizer():
    """256 byte tokens (id = byte value) and EOS_TOKEN (id 256); no merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {ch: b for b, ch in byte_to_char().items()}
    tok = _byte_level(Tokenizer(models.BPE(vocab=vocab, merges=[])))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.add_special_tokens([EOS_TOKEN])
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None):
    """A byte-level BPE of `vocab_size` tokens (EOS_TOKEN is id 0) trained on `texts`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if not 257 <= vocab_size <= 2**31:
        raise DataError(
            f"--train-tokenizer {vocab_size}: the vocabulary must hold at least 257 tokens (256 bytes + EOS)"
        )
    # ignore_merges: a word the vocabulary holds whole is one token without replaying merges
    # (as Llama 3's tokenizer.json does); about a third faster on source code.
    tok = _byte_level(Tokenizer(models.BPE(ignore_merges=True)))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=length)
    return tok


def tokenizer_file(path: str) -> str:
    """The tokenizer.json a --tokenizer PATH names (the file, or a directory holding one)."""
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        where = f"directory {path!r} holds no tokenizer.json" if os.path.isdir(path) else f"{path!r}: no such file"
        raise DataError(f"--tokenizer: {where}; give a Hugging Face tokenizer.json, a directory with one, or 'byte'")
    return file


def load_tokenizer(path: str):
    """A Hugging Face tokenizer from a tokenizer.json or a directory holding one."""
    from tokenizers import Tokenizer

    file = tokenizer_file(path)
    try:
        return Tokenizer.from_file(file)
    except Exception as e:  # the Rust side raises a bare Exception with its parse error
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"tokenizer {file!r} cannot be read as a Hugging Face tokenizer.json: {first}") from None


def _configured_eos(path: str | None) -> str | None:
    """eos_token of a tokenizer_config.json beside the tokenizer, if there is one."""
    if not path:
        return None
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


def with_eos(tok, path: str | None = None) -> Eos:
    """The end-of-document token: tokenizer_config.json's eos_token, else a known one the
    vocabulary holds, else EOS_TOKEN added to `tok` (in place) as a special token."""
    for name in (_configured_eos(path), *KNOWN_EOS):
        if name is not None and tok.token_to_id(name) is not None:
            return Eos(tok.token_to_id(name), name, False)
    tok.add_special_tokens([EOS_TOKEN])
    return Eos(tok.token_to_id(EOS_TOKEN), EOS_TOKEN, True)


def vocab_size(tok) -> int:
    """Ids run 0..vocab_size-1 (added tokens included; a gap in the ids counts)."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def write_hf_tokenizer(tokenizer_json: str, out: str, max_length: int | None = None) -> list[str]:
    """Copy `tokenizer_json` into the directory `out` and write the tokenizer_config.json that
    lets `transformers.AutoTokenizer.from_pretrained(out)` load it (a fast tokenizer; its
    end-of-document token as eos_token). For export-hf and for checkpoints; returns the names."""
    import shutil

    tok = load_tokenizer(tokenizer_json)
    eos = next((name for name in KNOWN_EOS if tok.token_to_id(name) is not None), None)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "clean_up_tokenization_spaces": False}
    if max_length:
        config["model_max_length"] = max_length
    shutil.copyfile(tokenizer_file(tokenizer_json), os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
        f.write("\n")
    try:  # a chat template beside the tokenizer (a --chat checkpoint's): where transformers reads it
        from .chat import find_template

        template = find_template(tokenizer_file(tokenizer_json)).source
    except DataError:
        return ["tokenizer.json", "tokenizer_config.json"]
    with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    return ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
