"""The `prepare-data` subcommand: its arguments and its run (__main__ dispatches here)."""

from __future__ import annotations

import sys
import time

from ..errors import DataError


def add_prepare_parser(sub) -> None:
    p = sub.add_parser("prepare-data", help="tokenize text files into a prepared token directory")
    p.add_argument("inputs", nargs="*", help="files, directories (recursive), globs, .jsonl, .parquet")
    p.add_argument("--out", required=True, help="the directory to write (refused if not empty, see --overwrite)")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer.json, a directory holding one, or 'byte'")
    p.add_argument("--train-tokenizer", type=int, metavar="VOCAB", help="train a byte-level BPE of VOCAB tokens")
    p.add_argument("--val-fraction", type=float, default=0.005, help="documents held out for validation")
    p.add_argument("--workers", type=int, default=1, help="encoding processes")
    p.add_argument("--text-field", default="text", help="the text field of .jsonl/.parquet/HF dataset rows")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--seed", type=int, default=0, help="seed of the validation split's document hash")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB", help="skip paths matching (repeatable)")
    p.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file at most")
    p.add_argument("--hf-dataset", help="a Hugging Face dataset: a save_to_disk directory, a local dataset or a name")
    p.add_argument("--split", default="train", help="the split of --hf-dataset")
    p.add_argument("--encoding", default="utf-8", help="the encoding of plain text files (a Python codec name)")
    p.add_argument(
        "--encoding-errors",
        default="replace",
        help="a file that does not decode: replace (U+FFFD, named in the summary), skip (named), strict (error)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="rows of .jsonl 'messages', rendered with the chat template, with a loss mask",
    )
    p.add_argument(
        "--loss-roles", default="assistant", help="--chat: comma-separated roles whose tokens count in the loss"
    )
    p.add_argument("--chat-template", help="--chat: a Jinja template file (default: the tokenizer's own)")
    p.add_argument(
        "--sequence-length",
        type=int,
        metavar="L",
        help="--chat: the training.sequence_length you will train at; the report after the summary counts the rows "
        "whose counted tokens do not fit in one sample of L + 1 tokens",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (shown only when stderr is a terminal)")


def run_prepare(args) -> None:
    from .prepare import PrepareOptions, prepare, summary

    options = PrepareOptions(
        inputs=tuple(args.inputs + args.overrides),  # overrides: inputs given after an option
        out=args.out,
        tokenizer=args.tokenizer,
        train_tokenizer=args.train_tokenizer,
        val_fraction=args.val_fraction,
        workers=args.workers,
        text_field=args.text_field,
        overwrite=args.overwrite,
        seed=args.seed,
        exclude=tuple(args.exclude),
        shard_tokens=args.shard_tokens,
        progress=not args.no_progress and sys.stderr.isatty(),
        hf_dataset=args.hf_dataset,
        split=args.split,
        encoding=args.encoding,
        encoding_errors=args.encoding_errors,
        chat=args.chat,
        loss_roles=tuple(r.strip() for r in args.loss_roles.split(",")),
        chat_template=args.chat_template,
    )
    if options.hf_dataset is not None and options.inputs:
        raise DataError("prepare-data: give INPUT files or --hf-dataset, not both")
    if args.sequence_length is not None and (not args.chat or args.sequence_length < 1):
        raise DataError(f"--sequence-length {args.sequence_length}: a length >= 1, with --chat (its loss-mask report)")
    start, seconds = time.perf_counter(), {}
    meta = prepare(options, seconds)
    print(summary(args.out, meta, time.perf_counter() - start, seconds.get("tokenizer", 0.0)))
    if args.chat:
        from .chat_report import mask_report

        print(mask_report(args.out, meta, args.sequence_length))
