"""On 2 gloo ranks: a dense DeepSeek-V3-tiny (multi-head latent attention) at tp 2, under
ALL_REDUCE and REDUCE_SCATTER, against the same model on one device: the logits and every
parameter's gradient. Prints one JSON line per tp mode from rank 0: the largest relative error
(|a - b| / max |b|) of the logits and over the parameters' gradients, and that of
kv_a_proj_with_mqa's weight (whose shared RoPE columns parallel/tensor.SharedKeyGradient sums)."""

import copy
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dtensor3d.config.schema import ModelConfig, ParallelismConfig
from dtensor3d.models.llama import LlamaForCausalLM
from dtensor3d.parallel.tensor import apply_tp


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
cfg = ModelConfig(
    family="deepseek_v3",
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale_all_dim": 1.0},
)
for mode in ("ALL_REDUCE", "REDUCE_SCATTER"):
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in ref.parameters():  # norm weights off one, as every other tensor
            p.add_(torch.randn_like(p) * 0.1)
    model = apply_tp(copy.deepcopy(ref), mesh, ParallelismConfig(tp=2, tp_mode=mode))
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    w = torch.randn(2, 32, cfg.vocab_size, generator=torch.Generator().manual_seed(2))
    want = ref(ids)
    (want * w).sum().backward()
    got = full(model(ids))
    (got * w).sum().backward()
    grads = {n: rel(full(p.grad), dict(ref.named_parameters())[n].grad) for n, p in model.named_parameters()}
    if dist.get_rank() == 0:
        key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
        line = {"mode": mode, "logits": rel(got, want), "grads": max(grads.values()), "kv_a": grads[key]}
        print(json.dumps(line | {"params": len(grads)}), flush=True)
dist.destroy_process_group()
