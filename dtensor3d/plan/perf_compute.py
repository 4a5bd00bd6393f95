"""The performance model's compute: the seconds one microbatch costs a pipeline rank on a
device, split into matmuls, attention and memory-bound ops (forward, backward and what
recompute runs again). Pure Python; plan/perf.py adds communication and the pipeline.

Matmuls. Each projection of a layer is an (M x K) @ (K x N) GEMM with this rank's tp / ep
widths (M: the microbatch's tokens on this rank, all of them under sequence parallelism,
whose gather precedes the matmul; an expert's M: the tokens routed to it, uniform routing).
A GEMM takes (FLOPs / peak + bytes / HBM bandwidth) / MATMUL_EFF: the tensor cores' time and
the time to stream its operands, not overlapped, at the share of peak large GEMMs reach --
so a GEMM's achieved share of peak falls with its arithmetic intensity (a thin expert or a
small tp slice runs further from peak than a square 8K GEMM). The backward runs two GEMMs
of the forward's size (input and weight gradients). With `training.float8` the decoder
layers' linears run at the fp8 peak with 1-byte operands, plus their casts (memory-bound).

Attention is flash attention: causal, so each query sees half the sequence on average
(context parallelism's zig-zag chunks balance it too); 4 FLOPs per query-key pair and head
dimension forward (QK^T and PV), 2.5x that backward (it recomputes the scores), at the
entry's `attention_fraction` of the bf16 peak (fp32 on a CPU entry: `fp32_attention_fraction` of
`fp32_tflops`; a CPU without native bf16 GEMMs runs bf16 matmuls many times slower than fp32).

Memory-bound ops (norms, residual adds, RoPE, SwiGLU's product, layout copies, MoE's token
permutations, the loss over the vocabulary, AdamW's update) are bytes moved at HBM_EFF of the
HBM bandwidth; eager PyTorch runs each op as its own kernel (each reads and writes memory),
training.compile fuses a decoder block's elementwise ops (one read and one write each).
"""

from __future__ import annotations

from .params import Part, sizes

MATMUL_EFF = 0.72  # share of the dense peak large GEMMs reach in training (cuBLAS on Hopper at full power: ~0.75-0.8)
HBM_EFF = 0.80  # share of HBM bandwidth streaming kernels reach
# Bytes moved per element (a: the activation width, 2 in bf16, 4 in fp32), eager / compiled:
NORM_PASSES = (8, 2)  # RMSNorm in fp32 eager: upcast, square, mean, rsqrt-multiply, weight, downcast
ROPE_PASSES = (9, 2)  # x cos + rotate_half(x) sin: negate, concatenate, two products, a sum
SWIGLU_PASSES = (5, 3)  # silu(gate) * up: silu reads and writes, the product reads two and writes
LOSS_BYTES = 36  # per logit, forward and backward (fp32 upcast, log-softmax, its gradient, downcast)
FP8_CAST_BYTES = 5  # per element cast to fp8: read the bf16 tensor twice (amax, scale) and write one byte
# Ops one decoder layer's forward dispatches (each with its backward), eager / compiled: what
# a host pays per op where it cannot run ahead of the device (the CPU: hardware op_overhead_us)
LAYER_OPS = (40, 6)
OUTER_OPS = 12  # the embedding, final norm, head and loss


def float8_on(recipe) -> bool:
    """training.float8 is set (a mapping of its keys, config/low_precision.py; None or false: off)."""
    f8 = getattr(recipe.training, "float8", None)
    return f8 is not None and f8 is not False


def _linears(recipe, moe: bool) -> list[tuple[int, int, int, int]]:
    """(M, K, N, count) of one decoder layer's forward GEMMs on this rank, one microbatch (an
    MoE layer's router second after attention's: it stays in bf16 under float8)."""
    m, p, z = recipe.model, recipe.parallelism, sizes(recipe)
    T, h, tp = z.tokens, z.hidden, p.tp
    if m.mla:
        heads, qk = z.heads, m.qk_nope_head_dim + m.qk_rope_head_dim
        q = [(T, h, m.q_lora_rank, 1), (T, m.q_lora_rank, heads * qk, 1)] if m.q_lora_rank else [(T, h, heads * qk, 1)]
        kv_b = heads * (m.qk_nope_head_dim + m.v_head_dim)
        kv = [(T, h, m.kv_lora_rank + m.qk_rope_head_dim, 1), (T, m.kv_lora_rank, kv_b, 1)]
        attn = q + kv + [(T, heads * m.v_head_dim, h, 1)]
    else:
        attn = [(T, h, z.q_width + z.kv_pair, 1), (T, z.q_width, h, 1)]
    if not moe:
        return attn + [(T, h, 2 * z.inter, 1), (T, z.inter, h, 1)]
    tokens = -(-T // tp)  # each tp rank routes its share (parallel/expert.py)
    local = m.num_local_experts // p.ep
    per_expert = max(1, tokens * m.num_experts_per_tok * p.ep // m.num_local_experts)
    inter = m.expert_intermediate_size
    ffn = [(tokens, h, m.num_local_experts, 1), (per_expert, h, 2 * inter, local), (per_expert, inter, h, local)]
    if m.shared_intermediate_size:
        ffn += [(tokens, h, 2 * m.shared_intermediate_size, 1), (tokens, m.shared_intermediate_size, h, 1)]
    return attn + ffn


def dense_peak(hw, width: int) -> float:
    """The dense matmul peak, FLOP/s, in the compute dtype (`width` bytes a value): fp32 at the
    entry's fp32_tflops where it gives one (a CPU's), else -- and in bf16 -- at bf16_tflops."""
    return (hw.fp32_tflops if width == 4 and hw.fp32_tflops else hw.bf16_tflops) * 1e12


def attention_rate(hw, width: int) -> float:
    """FLOP/s of the flash-attention kernel in the compute dtype: its share of that dtype's peak."""
    if width == 4 and hw.fp32_tflops:
        return hw.fp32_tflops * 1e12 * (hw.fp32_attention_fraction or hw.attention_fraction)
    return hw.bf16_tflops * 1e12 * hw.attention_fraction


def gemm_seconds(shape, hw, fp8: bool, width: int) -> float:
    """One forward GEMM (times its count) on `hw`: compute plus operand streaming, at MATMUL_EFF."""
    M, K, N, count = shape
    peak = hw.fp8_tflops * 1e12 if fp8 else dense_peak(hw, width)
    e = 1 if fp8 else width
    moved = e * (M * K + K * N) + width * M * N
    return count * (2 * M * K * N / peak + moved / _bandwidth(hw)) / MATMUL_EFF


def _bandwidth(hw) -> float:
    return hw.hbm_gbps * 1e9


def _attention_flops(recipe, layer: int) -> float:
    """Forward flash-attention FLOPs of one layer, one microbatch, this rank (causal)."""
    m, z, t = recipe.model, sizes(recipe), recipe.training
    seen = t.sequence_length / 2
    window = m.layer_window(layer) if hasattr(m, "layer_window") else None
    if window:
        seen = min(seen, window)
    if m.mla:
        width = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
    else:
        width = 2 * m.head_dim
    return 2 * z.tokens * seen * z.heads * width


def _memory_bytes(recipe, moe: bool) -> float:
    """Bytes the memory-bound ops of one decoder layer's forward move, one microbatch."""
    m, z, t = recipe.model, sizes(recipe), recipe.training
    k = 1 if t.compile else 0
    a = z.act
    T, Ts, h = z.tokens, z.seq_tokens, z.hidden
    total = 2 * Ts * h * 4 * NORM_PASSES[k] / (2 if k else 1)  # fp32 eager passes; fused: read + write
    total += 2 * Ts * h * 3 * a  # residual adds
    total += T * (z.q_width + z.kv_width) * a * ROPE_PASSES[k]
    total += T * (2 * z.q_width + z.kv_pair) * 2 * a  # attention's layout copies (q, k, v in; out)
    if not moe:
        return total + T * z.inter * a * SWIGLU_PASSES[k]
    tokens = -(-T // recipe.parallelism.tp)
    routed = tokens * m.num_experts_per_tok
    total += routed * h * a * 5  # permute to the experts and back, weighted sum
    total += routed * m.expert_intermediate_size * a * SWIGLU_PASSES[k]
    return total + tokens * m.shared_intermediate_size * a * SWIGLU_PASSES[k]


def layer_seconds(recipe, hw, layer: int, fp8: bool, sac_matmuls: float = 0.0) -> dict[str, float]:
    """One decoder layer's forward+backward seconds per microbatch by kind, recompute included
    (`sac_matmuls`: the share of matmuls a selective policy recomputes too -- torchtitan's
    per-op policy recomputes every second one, 0.5; ours keeps them all, 0)."""
    m, p, z = recipe.model, recipe.parallelism, sizes(recipe)
    moe = bool(m.num_local_experts) and m.is_moe_layer(layer)
    gemms = _linears(recipe, moe)
    router = len(gemms) - (4 if m.shared_intermediate_size else 2) - 1 if moe else -1
    mm = sum(gemm_seconds(s, hw, fp8 and i != router, z.compute) for i, s in enumerate(gemms))
    attn = _attention_flops(recipe, layer) / attention_rate(hw, z.compute)
    mem = _memory_bytes(recipe, moe) / (_bandwidth(hw) * HBM_EFF)
    if fp8:  # each linear's input and weight cast forward, the output gradient backward
        casts = sum(c * (M * K + K * N + M * N) for M, K, N, c in gemms) * FP8_CAST_BYTES
        mem += casts / (_bandwidth(hw) * HBM_EFF) / 3  # the forward's third; x3 below
    again = {"none": (0, 0, 0), "selective": (sac_matmuls, 0, 1), "full": (1, 1, 1)}[p.recompute]
    sharded = tp_linears(recipe, moe) * (1 + again[2]) if p.tp_enabled else 0
    return {
        "matmul_s": mm * (3 + again[0]),
        "attention_s": attn * (3.5 + again[1]),
        "memory_s": mem * (3 + again[2]),
        "host_s": (layer_host_us(recipe, hw) * (1 + again[2]) + sharded * hw.tp_linear_us) * 1e-6,
    }


def layer_host_us(recipe, hw) -> float:
    """The host time of one decoder layer's forward with its backward: eager, the entry's
    layer_host_us where it gives one (probed: a layer at a shape whose compute is nil), else
    LAYER_OPS ops at op_overhead_us each; compiled, LAYER_OPS' fused kernels."""
    if recipe.training.compile or not hw.layer_host_us:
        return LAYER_OPS[1 if recipe.training.compile else 0] * hw.op_overhead_us
    return hw.layer_host_us


def outer_host_us(hw) -> float:
    """The host time of the embedding, final norm, head and loss, forward with backward: the
    entry's outer_host_us where it gives one, else OUTER_OPS ops at op_overhead_us each."""
    return hw.outer_host_us or OUTER_OPS * hw.op_overhead_us


def tp_linears(recipe, moe: bool) -> int:
    """A decoder layer's tp-sharded linears (parallel/tensor.py's plan): attention's q, k, v
    and o (MLA: q or q_b, kv_b, o), a dense MLP's gate, up and down; a MoE layer's experts
    stay whole per tp rank."""
    return (3 if recipe.model.mla else 4) + (0 if moe else 3)


def rank_seconds(recipe, hw, part: Part, fp8: bool, sac_matmuls: float = 0.0) -> dict[str, float]:
    """One microbatch through every stage of pp rank `part`: matmul, attention and memory
    seconds (forward, backward, recompute), with the embedding, the head and the loss."""
    z = sizes(recipe)
    outer = (part.first + part.last) * hw.tp_linear_us if recipe.parallelism.tp_enabled else 0.0  # embedding, head
    out = {
        "matmul_s": 0.0,
        "attention_s": 0.0,
        "memory_s": 0.0,
        "host_s": (outer_host_us(hw) + outer) * 1e-6,
    }
    for layer in part.layers:
        for key, s in layer_seconds(recipe, hw, layer, fp8, sac_matmuls).items():
            out[key] += s
    bw = _bandwidth(hw) * HBM_EFF
    if part.first:  # the lookup and its gradient's scatter-add
        out["memory_s"] += z.tokens * z.hidden * (z.act + 8) / bw
    if part.last:  # final norm, head GEMM (bf16: torchtitan keeps it out of float8), loss over the vocabulary
        out["matmul_s"] += 3 * gemm_seconds((z.tokens, z.hidden, z.vocab, 1), hw, False, z.compute)
        out["memory_s"] += z.tokens * z.vocab * LOSS_BYTES / bw
    return out


def optimizer_seconds(params: int, hw, dtensors: int = 0) -> float:
    """AdamW over this rank's fp32 parameters: read p, g, m, v and write p, m, v (28 B), the
    gradient norm's read (4 B); on a CPU entry each of `dtensors` DTensor parameters adds its
    ops' dispatch (dtensor_param_us) and the step's gradient bookkeeping before it: placements
    matched, the norm's partial sum, the clip (dtensor_grad_us)."""
    host = dtensors * (hw.dtensor_param_us + hw.dtensor_grad_us) * 1e-6
    return params * 32 / (_bandwidth(hw) * HBM_EFF) + host
