"""What `prepare-data --chat` tells the user about its loss masks: the fraction of training
tokens that count, and, at the sequence length they will train at (`--sequence-length L`),
the rows (conversations) whose counted tokens do not all fit in one sample of L + 1 tokens
from the row's start, and those with none there. Training windows are packed (tokens.py):
a window that holds no counted token adds nothing, and a step whose whole global batch holds
none is skipped (training/skip.py).

Read from the prepared directory's files (the training split's masks and document offsets),
a block of documents at a time, so memory stays bounded whatever the corpus.
"""

from __future__ import annotations

import numpy as np

from .tokens import TokenStream

BLOCK = 1 << 24  # tokens read at a time (at least one whole document)


def _offsets(stream: TokenStream) -> np.ndarray:
    return np.memmap(stream.docs_file, dtype="<i8", mode="r")


def mask_counts(path: str, meta: dict, length: int | None) -> dict:
    """{"tokens", "counted", "rows", "beyond", "none_within"} of the training split; "beyond":
    rows with a counted token past their first length + 1 tokens, "none_within": rows with
    none inside them (both 0 without a length)."""
    stream = TokenStream(path, meta, "train")
    offsets = _offsets(stream)
    rows = len(offsets) - 1
    out = {"tokens": stream.tokens, "counted": 0, "rows": rows, "beyond": 0, "none_within": 0}
    d = 0
    while d < rows:
        end = max(d + 1, int(np.searchsorted(offsets, offsets[d] + BLOCK, side="right")) - 1)
        end = min(end, rows)
        start, stop = int(offsets[d]), int(offsets[end])
        counted = np.flatnonzero(stream.read(start, stop - start, masks=True)) + start
        out["counted"] += len(counted)
        if length is not None and len(counted):
            doc = np.searchsorted(offsets, counted, side="right") - 1
            rel = counted - np.asarray(offsets)[doc]
            firsts = np.r_[True, doc[1:] != doc[:-1]]
            lasts = np.r_[doc[1:] != doc[:-1], True]
            out["beyond"] += int((rel[lasts] > length).sum())
            out["none_within"] += int((rel[firsts] > length).sum())
        d = end
    return out


def mask_report(path: str, meta: dict, length: int | None) -> str:
    """The line prepare-data --chat prints after its summary."""
    c = mask_counts(path, meta, length)
    line = (
        f"chat: {c['counted'] / max(c['tokens'], 1):.1%} of the training tokens count in the loss "
        f"({c['counted']:,} of {c['tokens']:,}, in {c['rows']:,} rows)"
    )
    if length is None:
        return line + (
            "; give --sequence-length L (the training.sequence_length you will train at) to count the rows whose "
            "counted tokens do not fit in one sample"
        )
    return line + (
        f"; at --sequence-length {length}, {c['beyond']:,} rows have counted tokens beyond their first "
        f"{length + 1} tokens (one sample), {c['none_within']:,} of them none within it"
        + (
            ": a packed window may hold no counted token, and a step with none in its whole batch is skipped"
            if c["beyond"]
            else ""
        )  # fmt: skip
    )
