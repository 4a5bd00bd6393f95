"""Downstream evaluation inside the training loop (the recipe's `eval` section): the harness on
the live model, every eval.every steps, on every rank of the mesh, with no checkpoint.

The harness's ranks are the data-parallel ranks (the `dp_cp` view): each scores its share of
the requests. The cp ranks are replicas here: each scores its own requests whole, with the
single-device attention layout for the evaluation (`replica_layout`). The tp ranks of one dp
rank run the same requests through the model together (the same inputs, the logits gathered
off the vocabulary shards), and so do the pp ranks: the requests go through the stages in
turn, point to point, the last stage's logits broadcast back (harness/stages.py). FSDP's
gathers and tp's collectives need every rank in every forward, so the forwards go in lockstep:
before each one the ranks agree (one all-reduce of one number) whether any still has work, and
a rank whose share is done runs a one-row forward while another's is not (MeshRunner.drain).
Generation is batched with a KV cache (generate.greedy_batch; left-padded), each forward
right-padded to a length tp divides, the padding's keys dropped from the cache after it.

Training goes on as if nothing ran: the RNG states (the harness seeds python, numpy and torch)
are saved and put back, the model returns to train mode, and the MoE routing records of the
eval forwards are dropped. The data state is a pure function of the step (untouched).
"""

from __future__ import annotations

import contextlib
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..mesh import mesh_axis


class MeshRunner:
    """The live model's forward for the harness, in lockstep over the world (see the module docstring)."""

    def __init__(self, state, compute_context):
        view = mesh_axis(state.mesh, "dp_cp")
        self.model, self.device, self.compute_context = state.model, state.device, compute_context
        self.group, self.rank, self.world_size = view.get_group(), view.get_local_rank(), view.size()
        self.divisor = state.recipe.parallelism.tp  # sequence parallelism: a length tp divides
        self.chain = None
        if getattr(state, "schedule", None) is not None or getattr(state, "stages", None):  # pp: harness/stages.py
            from .stages import StageChain

            self.chain = StageChain(state)

    def _agree(self, busy: bool) -> bool:
        flag = torch.tensor([float(busy)], device=self.device)
        dist.all_reduce(flag)
        return flag.item() > 0

    def _forward(self, ids: torch.Tensor, cache=None, last_only: bool = False) -> torch.Tensor:
        """Float logits on the CPU of ids [b, s] (after `cache`'s tokens): [b, s, vocab], or
        the last real position's [b, vocab]. Right-padded to a length tp divides (a causal
        model's real positions see no padding; a cache forgets the padding's keys after)."""
        from torch.distributed.tensor import DTensor

        from ..generate import _drop_moe_records

        width = ids.shape[1]
        extra = -width % self.divisor
        ids = F.pad(ids, (0, extra)).to(self.device)
        with torch.no_grad(), self.compute_context():
            if self.chain is not None:
                out = self.chain.forward(ids, cache, width - 1 if last_only else None)
                last_only = False  # taken already
            else:
                out = self.model(ids) if cache is None else self.model(ids, cache)
        if isinstance(out, DTensor):  # tp: the logits sharded on the vocabulary
            out = out.full_tensor()
        if cache is not None:
            cache.drop_last(extra)
        _drop_moe_records(self.model)
        if last_only:
            out = out[:, width - 1]
        elif out.dim() == 3:  # the chain took position width - 1 already where asked
            out = out[:, :width]
        return out.float().cpu()

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        self._agree(True)
        return self._forward(ids)

    def step(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """Generation: the last position's logits [b, vocab] of ids after `cache`'s tokens."""
        self._agree(True)
        return self._forward(ids, cache, last_only=True)

    def new_cache(self, pad):
        from ..models.layers import KVCache

        return KVCache(None if pad is None else pad.to(self.device), spare=self.divisor - 1)

    def drain(self) -> None:
        """Run one-row forwards while another rank still has requests of this kind."""
        while self._agree(False):
            self._forward(torch.zeros(1, self.divisor, dtype=torch.long))


def data_tokenizer_dir(recipe) -> str:
    """The prepared directory whose tokenizer.json the harness uses: data.path, or the first source's."""
    d = recipe.data
    if d.path:
        return d.path
    sources = d.sources or d.stages[0].sources
    return sources[0].path


@contextlib.contextmanager
def training_untouched(model):
    """Around an evaluation: the RNG states put back, the model back in its mode."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def replica_layout(model):
    """Around an evaluation under cp: each cp rank a replica that scores its own requests whole,
    so the attention modules' context-parallel layout (zig-zag chunks, K/V from the cp group)
    gives way to the single-device one, and comes back after."""
    from ..models.layers import SequenceLayout

    swapped = [
        (m, m.sequence)
        for m in model.modules()
        if isinstance(getattr(m, "sequence", None), SequenceLayout) and type(m.sequence) is not SequenceLayout
    ]
    for m, _ in swapped:
        m.sequence = SequenceLayout()
    try:
        yield
    finally:
        for m, layout in swapped:
            m.sequence = layout


def flat_metrics(results: dict | None) -> dict:
    """The harness's results as `eval/<task>/<metric>` numbers (a filter other than `none`
    joins the name: `exact_match_strict-match`; standard errors, N/A and the harness's own
    counts such as sample_len left out)."""
    out = {}
    for task, values in ((results or {}).get("results") or {}).items():
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            out[f"eval/{task}/{name}"] = float(value)
    return out


class LiveEval:
    """The harness on the live model: one per run (the task index is built once)."""

    def __init__(self, recipe):
        from . import task_manager
        from .lm import hf_tokenizer

        e = recipe.eval
        self.tasks, self.manager = list(e.tasks), task_manager(e.include_path, e.tasks)
        self.tokenizer = hf_tokenizer(data_tokenizer_dir(recipe))

    def run(self, state, compute_context) -> dict:
        """Every rank calls this; rank 0 gets `eval/<task>/<metric>`, the others {}."""
        from . import evaluate
        from .lm import Dtensor3dLM

        e = state.recipe.eval
        with training_untouched(state.model), replica_layout(state.model):
            runner = MeshRunner(state, lambda: compute_context(state))
            lm = Dtensor3dLM(
                runner=runner,
                tokenizer=self.tokenizer,
                batch_size=e.batch_size,
                max_length=state.recipe.model.max_position_embeddings,
            )
            results = evaluate(lm, self.tasks, self.manager, e.limit, e.num_fewshot)
        return flat_metrics(results) if dist.get_rank() == 0 else {}


def quiet_harness() -> None:
    """lm-eval's per-task INFO lines off inside a training run's log (warnings stay)."""
    import logging

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("lm_eval").setLevel(logging.WARNING)


def sharded_model(ckpt: str, tp: int, pp: int = 1):
    """The `eval` command under torchrun: CKPT's model parallelized over a (pp, dp, tp) mesh of
    the world (dp = world / (tp pp), FSDP over dp), each rank building only its pipeline stage
    (the trainer's 1f1b split) and reading only its slices; returns what MeshRunner reads
    (mesh, model, device, recipe; under pp coords and the stages for harness/stages.py)."""
    import types

    from ..checkpoint.hf import load_params, model_source
    from ..config.load import recipe_from_dict
    from ..config.schema import Recipe
    from ..errors import RecipeError
    from ..mesh import build_mesh, init_distributed, mesh_coords
    from ..models import materialize
    from ..parallel.parallelize import parallelize_stages

    cfg, files = model_source(ckpt, "eval")
    if pp > cfg.num_hidden_layers:
        raise RecipeError(
            f"eval: --pp={pp}: more pipeline stages than the model's {cfg.num_hidden_layers} layers; "
            f"valid --pp: 1..{cfg.num_hidden_layers} dividing the world size"
        )
    heads = math.gcd(cfg.num_attention_heads, cfg.num_key_value_heads)
    if heads % tp:  # before any process group forms, as the trainer's door (config/checks.py)
        valid = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        raise RecipeError(
            f"eval: --tp={tp}: the model's {cfg.num_attention_heads} attention heads ({cfg.num_key_value_heads} "
            f"key/value heads) do not split over tp; valid --tp: {valid}"
        )
    device = init_distributed("cuda" if torch.cuda.is_available() else "cpu")
    dp = dist.get_world_size() // (tp * pp)
    seq = max(tp, min(64, cfg.max_position_embeddings) // tp * tp)
    training = {"device": device.type, "global_batch_size": dp * pp, "micro_batch_size": 1, "sequence_length": seq}
    raw = {"model": Recipe(model=cfg).to_dict()["model"], "parallelism": {"dp": dp, "tp": tp, "pp": pp}}
    recipe = recipe_from_dict({**raw, "training": training})
    mesh = build_mesh(recipe.parallelism, device.type)
    coords = mesh_coords(mesh)
    model, parts = parallelize_stages(recipe, mesh, coords, device)
    model = materialize(model, device).eval()  # 1f1b: one stage per rank, `model` is that stage's module
    with files:
        load_params(model, files)
    stages = parts if pp > 1 else None  # MeshRunner: the stages in turn (harness/stages.py)
    return types.SimpleNamespace(mesh=mesh, model=model, device=device, recipe=recipe, coords=coords, stages=stages)
