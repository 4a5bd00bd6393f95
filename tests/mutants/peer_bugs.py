"""The silent bugs of other trainers' trackers (issue 43), put back one at a time into a
throwaway git worktree of this checkout's HEAD, each with the test that must catch it: every
one must make its test fail. Nothing in the working tree this runs from is touched.

    python tests/mutants/peer_bugs.py            # all of them (about 5 minutes on 2 cores)
    python tests/mutants/peer_bugs.py lr_reset   # some, by name

Prints, per bug, CAUGHT (the test failed; its first assertion line) or MISSED, and exits 1
if any was missed. A mutant whose anchor text is gone (the code moved) is reported as STALE."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# name: (peer issue, file, text in the file, its replacement, the pytest node that must fail)
MUTANTS = {
    "tp_cp_loss_halved": (
        "torchtitan #3280: with tp on, the logged loss is not summed over cp",
        "dtensor3d/training/train.py",
        "torch.stack([loss_sum * reports_loss, grad_sq])",
        'torch.stack([loss_sum * reports_loss * (recipe.parallelism.tp == 1 or state.coords["cp"] == 0), grad_sq])',
        "tests/data/test_documents.py::test_document_masking_parity_across_meshes",
    ),
    "ep_grads_doubled": (
        "pytorch #160285: expert gradients ep times their size",
        "dtensor3d/training/train.py",
        "    expert.sum_tp_grads(state.model, recipe.parallelism, state.mesh)\n",
        "    expert.sum_tp_grads(state.model, recipe.parallelism, state.mesh)\n"
        "    for m in expert.moe_modules(state.model):\n"
        "        for q in m.experts.parameters():\n"
        "            local(q.grad).mul_(recipe.parallelism.ep)\n",
        "tests/parallel/test_moe_parity.py::test_moe_parity[ep4]",
    ),
    "aux_grad_cut": (
        "NeMo Automodel #1412: the aux loss's gradient does not flow",
        "dtensor3d/models/moe.py",
        "return g, torch.full_like(aux_loss, ctx.scale), None",
        "return g, torch.zeros_like(aux_loss), None",
        "tests/models/test_moe.py::test_aux_loss_reaches_the_router_through_the_gradient",
    ),
    "aux_grad_over_dp": (
        "NeMo Automodel #1412: the aux loss's gradient divided by dp",
        "dtensor3d/parallel/parallelize.py",
        "aux_loss_scale=aux_loss_scale(recipe),",
        "aux_loss_scale=aux_loss_scale(recipe) / p.dp,",
        "tests/checkpoint/test_moe_checkpoint.py::test_ep_checkpoint_resumes_at_one_process",
    ),
    "aux_second_stage": (
        "torchtitan #2061: a rank's second stage (zbv, interleaved) loses its aux gradient",
        "dtensor3d/parallel/parallelize.py",
        'parallelize_stage(recipe, mesh, s, hooks)) for s in local_stages(coords["pp"], recipe.parallelism)]',
        "parallelize_stage(recipe, mesh, s, hooks if i == 0 else __import__('dataclasses').replace(hooks, "
        'aux_loss_scale=0.0))) for i, s in enumerate(local_stages(coords["pp"], recipe.parallelism))]',
        "tests/parallel/test_moe_parity.py::test_moe_parity[pp2_zbv]",
    ),
    "pp_averages": (
        "torchtitan #1733: pipeline microbatch gradients averaged, not summed",
        "dtensor3d/parallel/pipeline.py",
        "loss_fn=loss_fn, scale_grads=False)",
        "loss_fn=loss_fn, scale_grads=True)",
        "tests/parallel/test_parity.py::test_parity[pp2_uneven_layers]",
    ),
    "uneven_vocab_resume": (
        "torchtitan #1136: an uneven piece's start read as rank x (rows // ranks) on resume",
        "dtensor3d/checkpoint/slices.py",
        "            piece = files.read(name, gstart, size)",
        "            if is_dtensor(dst) and dst.shape[0] % dst.device_mesh.size() and gstart[0] > 0:\n"
        "                gstart = (gstart[0] - 1, *gstart[1:])\n"
        "            piece = files.read(name, gstart, size)",
        "tests/checkpoint/test_checkpoint.py::test_uneven_vocabulary_shards_resume_exactly",
    ),
    "optimizer_bf16": (
        "nanotron #245: the optimizer state restored in bf16",
        "dtensor3d/checkpoint/resume.py",
        '                read_into_(entry[key], f"{name}.{key}", files)\n',
        '                read_into_(entry[key], f"{name}.{key}", files)\n'
        "                entry[key] = entry[key].to(torch.bfloat16).to(p.dtype)\n",
        "tests/checkpoint/test_checkpoint.py::test_exact_resume_one_process",
    ),
    "lr_reset": (
        "nanotron #245: the lr schedule restarts at the resumed step",
        "dtensor3d/training/train.py",
        "lr = lr_at(state.step, recipe.optimizer",
        "lr = lr_at(state.step - getattr(state, 'lr_origin', 0), recipe.optimizer",
        "tests/checkpoint/test_checkpoint.py::test_exact_resume_one_process",
    ),
}
# lr_reset's second half: resume records where the schedule restarts.
LR_ORIGIN = ("dtensor3d/checkpoint/resume.py", '    state.step = int(record["step"])\n')


def apply(tree: Path, name: str) -> bool:
    """Put mutant `name` into `tree`; False if an anchor is not there exactly once."""
    _, path, old, new, _ = MUTANTS[name]
    edits = [(path, old, new)]
    if name == "lr_reset":
        edits.append((LR_ORIGIN[0], LR_ORIGIN[1], LR_ORIGIN[1] + "    state.lr_origin = state.step\n"))
    for path, old, new in edits:
        text = (tree / path).read_text()
        if text.count(old) != 1:
            return False
        (tree / path).write_text(text.replace(old, new))
    return True


def run(tree: Path, node: str) -> tuple[bool, str]:
    """(failed, its first assertion line) of `node` run in `tree` against tree's package."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-x", "-p", "no:cacheprovider", node]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln[1:].strip() for ln in proc.stdout.splitlines() if ln.startswith("E ")]
    shown = lines[:1] + [ln for ln in lines if ln.startswith("Greatest absolute")]  # assert_close's numbers
    return proc.returncode != 0, " ".join(shown) if lines else proc.stdout.strip().splitlines()[-1]


def main(names: list[str]) -> int:
    missed = 0
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "mut"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), "HEAD"], check=True)
        try:
            for name in names or list(MUTANTS):
                peer, node = MUTANTS[name][0], MUTANTS[name][4]
                if not apply(tree, name):
                    print(f"STALE  {name}: its anchor text is gone ({peer})", flush=True)
                    missed += 1
                    continue
                failed, line = run(tree, node)
                missed += not failed
                print(f"{'CAUGHT' if failed else 'MISSED'} {name} ({peer})\n  {node}\n  {line}", flush=True)
                subprocess.run(["git", "-C", str(tree), "checkout", "-q", "--", "."], check=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
