"""generate: sample text from a checkpoint in one process, with a KV cache.

    python -m dtensor3d generate CKPT --prompt TEXT [--max-new-tokens N] [--temperature T]
        [--top-k K] [--top-p P] [--seed S] [--tokenizer PATH] [--chat]

CKPT: a step directory, a checkpoint directory (its newest step) or a Hugging Face
directory. The tokenizer: --tokenizer, else the tokenizer.json in the step directory, the
checkpoint directory or the Hugging Face directory. The prompt runs once (prefill); each
new token then runs alone against the cache. Text goes to stdout as it is produced;
tokens/s to stderr. Temperature 0 is greedy (argmax). Generation stops at the tokenizer's
end-of-document token or after N tokens. With --chat the prompt is one user turn of the
tokenizer's chat template (chat_template.jinja or tokenizer_config.json beside tokenizer.json)
followed by the assistant's header (add_generation_prompt), only the reply is printed, and
generation also stops at any end-of-turn token the vocabulary holds (<|im_end|>, <|eot_id|>, ...)
or, for a tokenizer that spells the template's end-of-turn text in plain tokens, at that text.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .errors import CheckpointError, DataError, RecipeError

if TYPE_CHECKING:
    import torch


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint (one process, KV cache)")
    p.add_argument("ckpt", help="a step directory, a checkpoint directory (its newest) or a Hugging Face directory")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set of tokens of this mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="a tokenizer.json or a directory holding one (default: beside CKPT)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn in the chat template")


def prompt_ids(tok, tokenizer_path: str, text: str, chat: bool) -> tuple[list[int], str]:
    """The prompt's ids: the text, or with `chat` its rendering as one user turn with the
    assistant's header after it (the template's special tokens recognised); and with `chat`
    the end-of-turn text the template writes after a reply ("" without)."""
    if not chat:
        return tok.encode(text, add_special_tokens=False).ids, ""
    from .datasets.chat import Renderer, find_template

    render = Renderer(find_template(tokenizer_path, what="generate --chat"))
    prompt = render([{"role": "user", "content": text}], add_generation_prompt=True)
    probe = "\x00reply\x00"  # a reply no template alters: what follows it is the end of the turn
    turn = render([{"role": "user", "content": text}, {"role": "assistant", "content": probe}])
    end = turn[turn.index(probe) + len(probe) :].strip() if probe in turn else ""
    return tok.encode(prompt, add_special_tokens=False).ids, end


def visible(text: str, end: str) -> tuple[str, bool]:
    """The part of a reply to print: the text before the end-of-turn text `end` (then True:
    the turn is over), holding back a tail that may be the start of `end`."""
    if not end:
        return text, False
    if end in text:
        return text[: text.index(end)], True
    for k in range(min(len(end) - 1, len(text)), 0, -1):
        if end.startswith(text[-k:]):
            return text[:-k], False
    return text, False


class TextStream:
    """Incremental decoding for streaming (the tokenizers library's DecodeStream): a piece of
    text is written only once its characters are whole, so a UTF-8 character whose bytes come
    in several tokens prints whole, never as U+FFFD; with `end` (generate --chat) a tail that
    may begin the end-of-turn text is held back and the reply stops before that text."""

    def __init__(self, tok, end: str = "", out=None):
        from tokenizers.decoders import DecodeStream

        self.tok, self.end, self.out = tok, end, sys.stdout if out is None else out
        self.decoder, self.text, self.shown = DecodeStream(skip_special_tokens=True), "", ""

    def step(self, token: int) -> bool:
        """Take one token; True when the end-of-turn text is complete (the turn is over)."""
        piece = self.decoder.step(self.tok, token)
        if piece is None:  # an incomplete character (or a skipped special token): wait
            return False
        self.text += piece
        text, over = visible(self.text, self.end)
        self.out.write(text[len(self.shown) :])
        self.out.flush()
        self.shown = text
        return over


def stop_ids(tok, chat: bool) -> set[int]:
    """The end-of-document token (the first of KNOWN_EOS the vocabulary holds); with `chat`
    every one it holds (end-of-turn tokens included)."""
    from .datasets.tokenizer import KNOWN_EOS

    found = [tok.token_to_id(t) for t in KNOWN_EOS if tok.token_to_id(t) is not None]
    return set(found if chat else found[:1])


def find_tokenizer(ckpt: str, given: str | None) -> str:
    """The tokenizer.json to use (see the module docstring)."""
    from .datasets.tokenizer import tokenizer_file

    if given:
        return tokenizer_file(given)
    folders = [ckpt, os.path.dirname(os.path.abspath(ckpt))]
    if os.path.isfile(os.path.join(ckpt, "latest")):
        with open(os.path.join(ckpt, "latest")) as f:
            folders.insert(0, os.path.join(ckpt, f.read().strip()))
    for folder in folders:
        if os.path.isfile(os.path.join(folder, "tokenizer.json")):
            return os.path.join(folder, "tokenizer.json")
    raise DataError(f"generate: no tokenizer.json in or beside {ckpt!r}; pass --tokenizer PATH")


def check_args(args) -> None:
    """The numeric arguments alone (before anything is read)."""
    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise RecipeError(
            "generate: need --max-new-tokens >= 0, --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1 (got "
            f"{args.max_new_tokens}, {args.temperature}, {args.top_k}, {args.top_p})"
        )
    if not os.path.exists(args.ckpt):
        raise CheckpointError(
            f"generate: {args.ckpt!r}: no such checkpoint; give a step, checkpoint or Hugging Face directory"
        )


def check_fit(args, cfg, tok, prompt_len: int) -> None:
    """The tokenizer and the prompt against the model's config (before the weights load)."""
    from .datasets.tokenizer import vocab_size

    if vocab_size(tok) > cfg.vocab_size:
        raise DataError(
            f"generate: the tokenizer has {vocab_size(tok)} tokens, more than the model's vocab_size={cfg.vocab_size}; "
            "give the tokenizer the model was trained with (--tokenizer)"
        )
    if prompt_len == 0:
        raise RecipeError("generate: --prompt is empty after tokenizing; give some text")
    if prompt_len + args.max_new_tokens > cfg.max_position_embeddings:
        raise RecipeError(
            f"generate: {prompt_len} prompt tokens + --max-new-tokens {args.max_new_tokens} exceed the model's "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )


def pick(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> int:
    """The next token from last-position logits [vocab]: argmax at temperature 0, else a
    sample from softmax(logits / T) restricted to the top k and then to the top-p mass."""
    import torch

    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        mass = sorted_logits.softmax(-1).cumsum(-1)
        drop = mass - sorted_logits.softmax(-1) >= top_p  # keep the tokens until the mass reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=gen))


def generate_ids(
    model, prompt: list[int], max_new: int, temperature=0.0, top_k=0, top_p=1.0, seed=0, eos=None
) -> Iterator[int]:
    """Yield up to `max_new` tokens after `prompt`, stopping after `eos` (an id or a set of
    ids); one KV cache."""
    import torch

    from .models.layers import KVCache

    stops = {eos} if isinstance(eos, int) else set(eos or ())
    cache, gen = KVCache(), torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt])
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(ids, cache)[0, -1]
        _drop_moe_records(model)
        token = pick(logits, temperature, top_k, top_p, gen)
        yield token
        if token in stops:
            return
        ids = torch.tensor([[token]])


def greedy_batch(step, new_cache, prompts: list[list[int]], max_new: int, done) -> list[list[int]]:
    """Greedy tokens after each of `prompts`, all in one batch with one KV cache: the prompts
    left-padded (KVCache.pad: their positions and masks per row), one forward for them all, then
    one per new token of the rows not `done(i, tokens)` (a finished row leaves the cache).
    `step(ids, cache)` -> the last position's logits [b, vocab]; `new_cache(pad)` -> a KVCache."""
    import torch

    width = max(map(len, prompts))
    pads = [width - len(p) for p in prompts]
    ids = torch.tensor([[0] * pad + p for pad, p in zip(pads, prompts, strict=True)])  # padding: masked
    cache = new_cache(torch.tensor(pads) if any(pads) else None)
    out: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    for _ in range(max_new):
        tokens = step(ids, cache).argmax(-1).tolist()
        keep = []
        for k, i in enumerate(live):
            out[i].append(tokens[k])
            if not done(i, out[i]):
                keep.append(k)
        if not keep:
            break
        if len(keep) < len(live):
            cache.select(torch.tensor(keep))
        live, ids = [live[k] for k in keep], torch.tensor([[tokens[k]] for k in keep])
    return out


def _drop_moe_records(model) -> None:
    """MoE layers keep one statistics record per forward for the trainer; none is wanted here."""
    for module in model.modules():
        if hasattr(module, "take_records"):
            module.take_records(0)


def run_generate(args) -> None:
    from tokenizers import Tokenizer

    from .checkpoint.hf import model_from, model_source

    check_args(args)
    cfg, files = model_source(args.ckpt, "generate")  # first: a directory with no checkpoint says so
    tokenizer_path = find_tokenizer(args.ckpt, args.tokenizer)
    tok = Tokenizer.from_file(tokenizer_path)
    prompt, end = prompt_ids(tok, tokenizer_path, args.prompt, args.chat)
    check_fit(args, cfg, tok, len(prompt))
    model = model_from(cfg, files)
    out, start = [], time.perf_counter()
    sys.stdout.write("" if args.chat else args.prompt)
    stops = stop_ids(tok, args.chat)
    sampling = (args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, stops)
    stream = TextStream(tok, end)
    for token in generate_ids(model, prompt, *sampling):
        out.append(token)
        if stream.step(token):  # the template's end-of-turn text, written as plain tokens
            break
    shown = stream.shown
    seconds = time.perf_counter() - start
    text = tok.decode(out, skip_special_tokens=True)
    sys.stdout.write((text[: text.index(end)] if end and end in text else text)[len(shown) :] + "\n")
    print(
        f"generated {len(out)} tokens in {seconds:.2f} s ({len(out) / max(seconds, 1e-9):.1f} tokens/s)",
        file=sys.stderr,
    )
