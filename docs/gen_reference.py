"""The generated reference pages of the documentation site, from the code:

    docs/reference/commands.md   every command and its flags, from the argparse parsers (dtensor3d/__main__.py)
    docs/reference/metrics.md    every key of metrics.jsonl: METRICS below, checked against the keys the code writes
    docs/reference/errors.md     every class of `error:` line, from dtensor3d/errors.py

`python docs/gen_reference.py` writes them; `--check` exits 1 naming a page that drifted
(tests/test_docs.py runs the check). The recipe reference, docs/recipe.md, has its own
generator: `python -m dtensor3d.config.explain > docs/recipe.md`.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ROOT / "docs" / "reference"

# metrics.jsonl's keys: key -> (when it is there, what it means). `<name>`: a data source's name.
METRICS = {
    "step": ("always", "the step just taken, counted from 1"),
    "loss": (
        "always",
        "the training loss of the whole global batch (mean over counted tokens), the same at every mesh; the "
        "cross-entropy, without the z-loss",
    ),
    "z_loss": (
        "`training.z_loss` > 0",
        "z_loss x mean(logsumexp(logits)^2) over the counted tokens, added to the backpropagated loss",
    ),
    "grad_norm": ("always", "the global gradient norm before clipping"),
    "lr": ("always", "the learning rate this step used"),
    "tokens_per_sec": ("always", "tokens of the global batch per second of this step"),
    "ms_per_step": ("always", "this step's wall time, in milliseconds"),
    "peak_mem_gib": ("always", "peak memory so far: CUDA's max allocated, or the process's peak RSS on CPU"),
    "mfu": (
        "always (null on CPU unless `logging.peak_tflops`)",
        "tflops over the device's peak (plan's table of GPUs, or `logging.peak_tflops`)",
    ),
    "tflops": ("always", "model TFLOP/s per rank: plan's FLOPs per token x tokens_per_sec / ranks"),
    "step_ms_max": ("always", "the slowest rank's train-step time this step, in milliseconds (one all-gather)"),
    "step_ms_min": ("always", "the fastest rank's train-step time this step, in milliseconds"),
    "slowest_rank": ("always", "the rank whose step took step_ms_max"),
    "val_loss": ("`training.eval_every` steps", "the validation loss over `training.eval_batches`"),
    "val_ppl": ("`training.eval_every` steps", "exp(val_loss)"),
    "eval/<name>/<name>": (
        "`eval.every` steps (`eval.tasks`)",
        "lm-evaluation-harness's metric of a task on the live model (`eval/<task>/<metric>`, e.g. "
        "`eval/hellaswag/acc_norm`)",
    ),
    "loss/main": (
        "`model.num_nextn_predict_layers` > 0",
        "the main model's loss; `loss/mtp_1` .. `loss/mtp_D` beside it are each MTP depth's (loss = main + "
        "mtp_loss_weight / D x their sum)",
    ),
    "loss/<name>": ("a data mixture", "the loss of that source's samples in the step (token-weighted)"),
    "tokens/<name>": ("a data mixture", "the counted tokens of that source in the step"),
    "aux_loss": ("a model with experts", "the router's auxiliary load-balancing loss"),
    "tokens_per_expert": ("a model with experts", "tokens routed to each expert, summed over the MoE layers"),
    "expert_load_max_over_mean": ("a model with experts", "the worst MoE layer's max / mean tokens per expert"),
    "expert_load_by_layer": ("a model with experts", "each MoE layer's max / mean tokens per expert"),
    "tokens_per_expert_by_layer": ("router bias balancing", "tokens per expert, layer by layer"),
    "router_bias_range": ("router bias balancing", "each MoE layer's correction bias [min, max]"),
    "nonfinite": ("a NaN or inf step", "what was not finite: the loss, or the first parameter whose gradient was"),
    "skipped": ("a skipped step", "true: no optimizer step was taken"),
    "skip_reason": (
        "a skipped step",
        "why the step was skipped: no counted tokens, or (`training.skip_spikes`) a loss spike or a grad-norm spike",
    ),
    "skipped_steps": ("`training.on_nonfinite: skip`", "non-finite steps skipped so far"),
}

# Other one-line messages a command prints, by their first word.
LINE_KINDS = {
    "warning:": "the run goes on; something deserves a look (a stale lock taken over, a broken checkpoint passed over)",
    "note:": "information about a choice the run made for you (an LR schedule recomputed on resume)",
    "preempted:": "SIGTERM or SIGINT: every rank stopped after the same step, saved, and exited 0",
    "restarting": "launch.sh's elastic agent restarts the job (MAX_RESTARTS)",
    "resized:": "an elastic job continues on another number of nodes",
    "done:": "the run finished: where its metrics, loss curve and last checkpoint are",
}


def written_metric_keys() -> set[str]:
    """The keys dtensor3d/training writes into a step's record: `metrics[...] =`, `record[...] =`,
    `out[...] =` (an f-string key as its `<name>` form), `metrics.update(key=...)`, and the string
    keys of a dict literal such a name is given or a function returns."""
    names, keys = {"metrics", "record", "out"}, set()

    def key_of(node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(v.value if isinstance(v, ast.Constant) else "<name>" for v in node.values)
        return None

    live = ROOT / "dtensor3d" / "harness" / "live.py"  # in-loop downstream evaluation's eval/<task>/<metric>
    for path in [*sorted((ROOT / "dtensor3d" / "training").glob("*.py")), live]:
        for node in ast.walk(ast.parse(path.read_text())):
            dicts = [node.value] if isinstance(node, ast.Return) and isinstance(node.value, ast.Dict) else []
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                        if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in names:
                            keys.add(key_of(t.slice))
                        if isinstance(t, ast.Name) and t.id in names and isinstance(node.value, ast.Dict):
                            dicts.append(node.value)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
                if isinstance(node.func.value, ast.Name) and node.func.value.id in names:
                    keys.update(k.arg for k in node.keywords if k.arg)
            for d in dicts:
                keys.update(key_of(k) for k in d.keys if k is not None)
    return keys - {None}


def _table(rows: list[tuple[str, ...]], head: tuple[str, ...]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]


def _flag(action) -> str:
    if not action.option_strings:
        return f"`{action.dest.upper()}`" + (" ..." if action.nargs in ("*", "+") else "")
    spelled = ", ".join(f"`{o}`" for o in action.option_strings)
    return spelled + (f" `{action.metavar or action.dest.upper()}`" if action.nargs != 0 else "")


def _default(action) -> str:
    if not action.option_strings:
        return "optional" if action.nargs in ("*", "?") else "required"
    if action.required:
        return "required"
    if action.default in (None, False, argparse.SUPPRESS):
        return ""
    return f"`{action.default}`"


def commands_page() -> str:
    from dtensor3d.__main__ import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    out = [
        "# Commands",
        "",
        "Generated from the argparse parsers by `python docs/gen_reference.py` (a test checks it is current).",
        "Every command is `python -m dtensor3d COMMAND ...`; `bash launch.sh RECIPE [key=value ...]` checks the",
        "recipe (`validate`) and then runs `train` under torchrun with the recipe's process count.",
        "A wrong argument is one `error:` line and exit status 2.",
    ]
    for name, parser in sub.choices.items():
        rows = [(_flag(a), _default(a), a.help or "") for a in parser._actions if a.help != argparse.SUPPRESS]
        rows = [r for r in rows if r[0] != "`-h`, `--help`"]
        out += ["", f"## `{name}`", "", f"{helps[name]}.", "", *_table(rows, ("argument", "default", "meaning"))]
    return "\n".join(out) + "\n"


def metrics_page() -> str:
    out = [
        "# metrics.jsonl",
        "",
        "Rank 0 writes one JSON object per logged step (`logging.every`) to `<logging.run_dir>/metrics.jsonl`.",
        "Generated by `python docs/gen_reference.py`; a test checks that this table holds exactly the keys",
        "the training code writes.",
        "",
        *_table([(f"`{k}`", when, meaning) for k, (when, meaning) in METRICS.items()], ("key", "present", "meaning")),
    ]
    return "\n".join(out) + "\n"


def errors_page() -> str:
    import dtensor3d.errors as errors

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.UserError)]
    rows = [
        (f"`{c.__name__}`", c.__mro__[1].__name__ if c is not errors.UserError else "ValueError", c.__doc__)
        for c in classes
    ]
    out = [
        "# Errors and other lines",
        "",
        "Generated from `dtensor3d/errors.py` by `python docs/gen_reference.py` (a test checks it is current).",
        "",
        "A mistake you can fix is one line on stderr, `error: ...`, and exit status 2, before any process",
        "starts where it can be found then. The line names the key or the file, the value, and what is valid:",
        "",
        "```",
        "error: parallelism.tp=3: model.num_attention_heads=4 is not divisible by tp; valid tp: 1, 2",
        "```",
        "",
        "Each line comes from one class of `UserError`, by where the mistake is:",
        "",
        *_table(rows, ("class", "base", "what is wrong")),
        "",
        "Other one-line messages, by their first word:",
        "",
        *_table([(f"`{k}`", v) for k, v in LINE_KINDS.items()], ("line", "meaning")),
    ]
    return "\n".join(out) + "\n"


GENERATORS = {"commands.md": commands_page, "metrics.md": metrics_page, "errors.md": errors_page}


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    stale = []
    for name, make in GENERATORS.items():
        path, text = PAGES / name, make()
        if "--check" in argv:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            PAGES.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}: run python docs/gen_reference.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
