"""The recipe's `training` and `optimizer` sections: the loop (how long, on what batches, in
what precision, with which stability guards) and its optimizer and lr schedule. Part of the
schema (config/schema.py re-exports them); no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .fields import knob


@dataclass(frozen=True)
class TrainingConfig:
    """The loop: how long, on what batches, in what precision, on which device."""

    steps: int = knob(10, "optimizer steps to train", positive=True)
    seed: int = knob(42, "the seed of the weights and (unless data.seed) of the sample order")
    sequence_length: int = knob(64, "tokens per sample", positive=True)
    global_batch_size: int = knob(8, "samples per optimizer step, over all ranks", positive=True)
    micro_batch_size: int = knob(1, "samples per forward/backward on one rank", positive=True)
    dtype: Literal["float32", "bfloat16"] = knob("float32", "compute precision (bf16 over fp32 weights and state)")
    device: Literal["auto", "cpu", "cuda"] = knob("auto", "auto: cuda when present, else cpu")
    eval_every: int = knob(0, "steps between validation losses (and at the last step); 0: never")
    eval_batches: int = knob(1, "global batches of validation windows per evaluation", positive=True)
    on_nonfinite: Literal["stop", "skip"] = knob("stop", "a NaN/inf loss or gradient: stop (one error line) or skip")
    max_skipped_steps: int = knob(10, "on_nonfinite=skip: stop after this many consecutive skipped steps")
    timeout_s: float = knob(600.0, "seconds a collective (and the rendezvous of nodes) may take before the run ends")
    compile: bool = knob(False, "torch.compile each decoder block (parameter names unchanged)")
    memory_fraction: float = knob(
        0.9,
        "the share of a device's memory (CPU: available RAM / local ranks) plan's peak may take where "
        "parallelism.fsdp_reshard_after_forward is auto; at most 1",
        positive=True,
    )
    float8: dict | None = knob(
        None,
        "float8 matmuls through torchao (needs dtype: bfloat16): {recipe: tensorwise | rowwise, fsdp_all_gather: "
        "true | false} on the decoder blocks' linears (dims divisible by 16; embedding, head, router and experts "
        "stay bf16); fsdp_all_gather (tensorwise, dp shard): FSDP2 gathers float8 weights; null: off",
    )
    z_loss: float = knob(
        0.0,
        "z-loss coefficient (PaLM, OLMo): adds z_loss * mean(logsumexp(logits)^2) over the counted targets to the "
        "backpropagated loss, vocab-parallel under tp; logged as `z_loss` (`loss` stays the cross-entropy); 0: off",
    )
    skip_spikes: dict | None = knob(
        None,
        "skip a spiking step: {window: 100, sigma: 6.0}; once `window` steps were applied, a step whose loss or "
        "grad norm is more than sigma standard deviations above the mean of the last `window` applied steps is "
        "not applied (no optimizer step, the lr schedule held) and logged skipped; null: off",
    )


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW or Muon, and the learning-rate schedule (config/lr.py)."""

    name: Literal["adamw", "muon"] = knob(
        "adamw",
        "adamw; or muon: every 2-D matrix inside the decoder layers (each expert's alone) on torch.optim.Muon's "
        "update, the rest (embeddings, head, norms, biases, router gate) on AdamW in the same step",
    )
    lr: float = knob(1e-3, "the peak learning rate")
    weight_decay: float = knob(0.1, "AdamW's decoupled weight decay (matrices only)")
    betas: tuple[float, float] = knob((0.9, 0.95), "AdamW's betas")
    eps: float = knob(1e-8, "AdamW's epsilon")
    state_dtype: Literal["float32", "bfloat16", "8bit"] = knob(
        "float32",
        "AdamW's moments and Muon's momentum buffer: float32 (8 B a parameter for AdamW); bfloat16 (4 B, torchao's "
        "AdamW with bf16 moments, rounded to nearest; weights stay fp32); 8bit (about 2 B: torchao's AdamW8bit, "
        "uint8 codes and one fp32 scale per 256-element block, for parameters of >= 4096 elements whose blocks "
        "are runs of the full tensor on every rank, fp32 moments for the rest); checkpoints keep them as they are",
    )
    clip_grad: float = knob(1.0, "clip the global gradient norm to this; 0: no clipping")
    warmup_steps: int = knob(0, "linear warmup steps to lr")
    decay: Literal["cosine", "linear", "1-sqrt", "constant"] = knob(
        "cosine", "the decay's shape (1-sqrt: nanotron's), from decay_start over decay_steps to min_lr"
    )
    min_lr: float = knob(0.0, "the learning rate the decay ends at, held after it")
    decay_start: int | None = knob(None, "the step the decay begins (warmup-stable-decay); null: right after warmup")
    decay_steps: int | None = knob(None, "the decay's length in steps, then min_lr holds; null: to the last step")
    muon_lr: float | None = knob(
        None, "muon: the Muon matrices' peak lr on the same schedule (min_lr scaled alike); null: optimizer.lr"
    )
    muon_momentum: float = knob(0.95, "muon: the momentum of torch.optim.Muon")
    muon_nesterov: bool = knob(True, "muon: Nesterov momentum")
    muon_ns_steps: int = knob(5, "muon: Newton-Schulz iterations (torch's coefficients), 1 to 99")
    muon_ns_dtype: Literal["bfloat16", "float32"] = knob(
        "bfloat16",
        "muon: the dtype Newton-Schulz runs in: bfloat16 (torch.optim.Muon's: its input rounded to bf16, bitwise "
        "torch's) or float32 (torch's iteration, coefficients, normalisation and steps without the rounding; the "
        "owner exchange sends fp32 pieces, twice the bytes). In bf16 a mesh's ~1e-7 different gradient sums flip "
        "single roundings that grow (grad norm 2e-5 to 1e-3 off one process by step 6); in fp32 every mesh stays "
        "within ~2e-7 of one process",
    )
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = knob(
        "original",
        "muon: torch.optim.Muon's adjust_lr_fn: original (lr * sqrt(max(1, out/in))) or match_rms_adamw "
        "(lr * 0.2 * sqrt(max(out, in)), Moonlight's: AdamW's lr and weight decay carry over)",
    )
