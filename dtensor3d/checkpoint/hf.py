"""Hugging Face interop: config.json <-> ModelConfig, tensor names (ours are
LlamaForCausalLM's; Mixtral's experts are stacked here, one Linear each there), and the
commands export-hf and import-hf, and `load_model` for a single-device model.

Only safetensors are read; a directory holding only pickle weights is refused by name."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import tempfile

import torch

from ..config.families import FAMILIES
from ..config.hf_config import hf_model_values, read_config_json
from ..config.load import recipe_from_dict
from ..config.schema import ModelConfig, Recipe
from ..errors import CheckpointError, RecipeError
from ..models import build_on_meta, materialize, stored_name
from ..models.llama import LlamaForCausalLM
from .check import check_checkpoint, expected_shapes, model_config
from .find import resolve
from .format import STATE, check_tensors, publish, read_header, read_json, save_tensors, seal, step_name, write_atomic
from .hf_names import (
    DEEPSEEK_MOE_KEYS,
    HF_INDEX,
    HF_SINGLE,
    LLAMA_KEYS,
    MIXTRAL_DEFAULTS,
    MLA_DEFAULTS,
    PICKLE_SUFFIXES,
    QWEN3_MOE_KEYS,
    HFSlices,
    hf_shapes,
    to_hf_lazy,
)
from .slices import SliceReader, read_into_

# ---------------------------------------------------------------- config.json


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    """A Hugging Face config.json of a supported family as a ModelConfig; what cannot run is refused."""
    values = hf_model_values(hf, where)
    try:
        return recipe_from_dict({"model": values}).model
    except RecipeError as e:
        raise CheckpointError(f"{where}: {e}") from None


# The fields of a config.json that are fixed for every model we write.
_COMMON = {"hidden_act": "silu", "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True}


_TOKEN_DEFAULTS = {
    "smollm3": {"pad_token_id": 128004, "bos_token_id": 128000, "eos_token_id": 128001},
    "phi3": {"pad_token_id": 32000, "bos_token_id": 1, "eos_token_id": 32000},
}


def _family_fields(cfg, name: str) -> dict:
    """What the family's own config class holds beyond Llama's common keys."""
    family, layers = FAMILIES[name], cfg.num_hidden_layers
    out = {key: getattr(cfg, key) for key in family.biases}
    if family.window_switch:
        types = [("full_attention" if cfg.layer_window(i) is None else "sliding_attention") for i in range(layers)]
        first = types.index("sliding_attention") if cfg.sliding_window is not None else layers
        out.update(use_sliding_window=first < layers, sliding_window=cfg.sliding_window, max_window_layers=first)
        out["layer_types"] = types
    elif name in ("mistral", "mixtral", "phi3"):  # one window on every layer
        if len({cfg.layer_window(i) for i in range(layers)}) > 1:
            raise CheckpointError(
                f"model.layer_types={list(cfg.layer_types)}: {family.architecture} windows every layer alike; "
                "export a model whose layer_types is null"
            )
        out["sliding_window"] = cfg.sliding_window
    if family.sandwich_norms:  # Gemma 3: its activation's key and the attention scale
        out.update(hidden_activation=cfg.hidden_act, hidden_act=cfg.hidden_act)
        out.update(query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim)
        out.update(final_logit_softcapping=None, attn_logit_softcapping=None)
    if family.layer_rope:  # OLMo 3, Gemma 3: the window on the sliding layers
        out["sliding_window"] = cfg.sliding_window
        out["layer_types"] = [
            ("full_attention" if cfg.layer_window(i) is None else "sliding_attention") for i in range(layers)
        ]
    if family.nope:  # SmolLM3
        out["no_rope_layers"] = [int(cfg.layer_rope(i)) for i in range(layers)]
    # the class's special-token defaults where the vocabulary holds them (else its embedding refuses)
    tokens = _TOKEN_DEFAULTS.get(name, {})
    out.update({key: (t if t < cfg.vocab_size else None) for key, t in tokens.items()})
    if name == "mixtral":
        out.update({key: getattr(cfg, key) for key in MIXTRAL_DEFAULTS})
        out.update(router_jitter_noise=0.0, output_router_logits=False)
    if name == "qwen3_moe":
        out.update({key: getattr(cfg, key) for key in QWEN3_MOE_KEYS})
        out.update(num_experts=cfg.num_local_experts, mlp_only_layers=list(cfg.mlp_only_layers or ()))
        out.update(moe_intermediate_size=cfg.expert_intermediate_size, output_router_logits=False)
    if name == "glm4_moe":  # DeepSeek-V3's routing keys; no multi-token prediction layers
        out.update({key: getattr(cfg, key) for key in DEEPSEEK_MOE_KEYS}, use_qk_norm=cfg.use_qk_norm)
        out.update(n_routed_experts=cfg.num_local_experts, moe_intermediate_size=cfg.expert_intermediate_size)
        out.update(first_k_dense_replace=_dense_layers(cfg), num_nextn_predict_layers=0, output_router_logits=False)
        out["num_mtp_layers"] = 0
    if name == "deepseek_v3":  # no multi-token prediction layers
        out.update({key: getattr(cfg, key) for key in (*MLA_DEFAULTS, *DEEPSEEK_MOE_KEYS)})
        out.update(n_routed_experts=cfg.num_local_experts, moe_intermediate_size=cfg.expert_intermediate_size)
        out.update(first_k_dense_replace=_dense_layers(cfg), num_nextn_predict_layers=0, output_router_logits=False)
    return out


# What each exported MoE family's transformers class cannot hold: (setting, value it must have).
_NO_DEEPSEEK = {
    "shared_expert_intermediate_size": 0,
    "n_shared_experts": 0,
    "moe_layers": None,
    "scoring_func": "softmax",
    "n_group": 1,
    "routed_scaling_factor": 1.0,
    "router_bias_update_rate": 0.0,  # balancing gives the router a correction bias
    "first_k_dense_replace": 0,
}
_MOE_FIXED = {
    "mixtral": {
        **_NO_DEEPSEEK,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": None,
        "moe_intermediate_size": 0,
    },
    "qwen3_moe": _NO_DEEPSEEK,
    "glm4_moe": {
        "shared_expert_intermediate_size": 0,
        "moe_layers": None,
        "scoring_func": "sigmoid",
        "correction_bias": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": None,
    },
    "deepseek_v3": {
        "shared_expert_intermediate_size": 0,
        "moe_layers": None,
        "scoring_func": "sigmoid",
        "correction_bias": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": None,
    },
}


def _dense_layers(cfg) -> int:
    """DeepSeek-V3's first_k_dense_replace: every layer when the model has no experts."""
    return cfg.first_k_dense_replace if cfg.num_local_experts else cfg.num_hidden_layers


def _refuse_export(cfg, name: str) -> None:
    """One line when the model has a switch the family's transformers class lacks."""
    for key, value in _MOE_FIXED.get(name, {}).items():
        have = getattr(cfg, key)
        if have != value and not (key == "mlp_only_layers" and not have):
            raise CheckpointError(
                f"model.{key}={have!r}: transformers' {FAMILIES[name].architecture} has no such setting "
                f"(it needs {value!r}); this model does not export to Hugging Face as {name}"
            )


def hf_config(cfg) -> dict:
    """config.json for transformers' model class of the family (Mixtral's for a llama with experts)."""
    name = cfg.family if FAMILIES[cfg.family].experts or not cfg.num_local_experts else "mixtral"
    if cfg.num_local_experts:
        _refuse_export(cfg, name)
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    rope |= {"partial_rotary_factor": cfg.partial_rotary_factor} if cfg.partial_rotary_factor != 1.0 else {}
    layer_rope = FAMILIES[name].layer_rope
    return {
        "architectures": [FAMILIES[name].architecture],
        "model_type": FAMILIES[name].model_type,
        **{key: getattr(cfg, key) for key in LLAMA_KEYS},
        "head_dim": cfg.head_dim,
        **_COMMON,
        "hidden_act": cfg.hidden_act,
        **_family_fields(cfg, name),
        "rope_parameters": {"full_attention": rope, "sliding_attention": cfg.sliding_rope or rope}
        if layer_rope
        else rope,
        "torch_dtype": "float32",
    }


def read_hf_config(hf_dir: str, what: str) -> ModelConfig:
    return config_from_hf(read_config_json(hf_dir, what), os.path.join(hf_dir, "config.json"))


# ---------------------------------------------------------------- a Hugging Face directory's tensors


def _weight_map(hf_dir: str) -> dict[str, str]:
    """Tensor name -> file, from the index or the single file; pickle weights are refused."""
    if os.path.isfile(os.path.join(hf_dir, HF_INDEX)):
        weight_map = read_json(os.path.join(hf_dir, HF_INDEX), "index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) and os.path.basename(f) == f and f.endswith(".safetensors") for f in weight_map.values()
        ):
            raise CheckpointError(
                f"{os.path.join(hf_dir, HF_INDEX)}: weight_map must map names to safetensors "
                f"files in the same directory"
            )
        return weight_map
    if os.path.isfile(os.path.join(hf_dir, HF_SINGLE)):
        return {name: HF_SINGLE for name in read_header(os.path.join(hf_dir, HF_SINGLE))}
    pickles = sorted(f for f in os.listdir(hf_dir) if f.endswith(PICKLE_SUFFIXES))
    also = f"; {', '.join(pickles)} (pickle) is never loaded: convert it to safetensors" if pickles else ""
    raise CheckpointError(f"{hf_dir}: no {HF_SINGLE} or {HF_INDEX}{also}")


def hf_index(hf_dir: str, cfg) -> dict[str, str]:
    """Tensor name -> safetensors file of a Hugging Face directory, checked against `cfg`."""
    weight_map = _weight_map(hf_dir)
    for file in sorted(set(weight_map.values())):
        if not os.path.isfile(os.path.join(hf_dir, file)):
            raise CheckpointError(f"{os.path.join(hf_dir, file)} is missing (a shard listed in {HF_INDEX})")
    weight_map = {
        n: f
        for n, f in weight_map.items()
        if not n.endswith("rotary_emb.inv_freq")
        and not (cfg.tie_word_embeddings and n == "lm_head.weight")
        and not _prediction_layer(n, cfg)
    }
    check_tensors(hf_dir, weight_map, hf_shapes(cfg))
    return weight_map


def _prediction_layer(name: str, cfg) -> bool:
    """DeepSeek-V3's multi-token prediction layers (model.layers.N.* for N >= num_hidden_layers),
    which transformers' DeepseekV3ForCausalLM does not load either."""
    parts = name.split(".")
    return cfg.mla and parts[:2] == ["model", "layers"] and int(parts[2]) >= cfg.num_hidden_layers


def _same(a, b) -> bool:
    """Equal, floats to a relative 1e-6 (a config.json may hold float32 values: 9.999999747378752e-06)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


def check_hf_init(recipe) -> dict[str, str]:
    """checkpoint.init_from_hf against the recipe's model; returns the tensor index."""
    hf_dir = recipe.checkpoint.init_from_hf
    theirs = read_hf_config(hf_dir, "checkpoint.init_from_hf")
    for f in dataclasses.fields(ModelConfig):
        if not _same(getattr(theirs, f.name), getattr(recipe.model, f.name)):
            raise CheckpointError(
                f"checkpoint.init_from_hf={hf_dir!r}: config.json has {f.name}="
                f"{getattr(theirs, f.name)!r} but the recipe has model.{f.name}="
                f"{getattr(recipe.model, f.name)!r}; set model.{f.name}: {getattr(theirs, f.name)!r}"
            )
    return hf_index(hf_dir, recipe.model)


def load_params(model: torch.nn.Module, files: SliceReader) -> None:
    """Every parameter of `model` from `files`: this rank reads only the regions its piece
    covers (a tied head's copy on the last pipeline stage reads the embedding)."""
    for name, p in model.named_parameters():
        read_into_(p, stored_name(model.cfg, name), files)


def model_source(path: str, what: str) -> tuple[ModelConfig, SliceReader]:
    """(config, its tensors by our names) of a Hugging Face directory or a dtensor3d
    checkpoint (step directory, or checkpoint directory meaning its newest); fully checked."""
    if os.path.isfile(os.path.join(path, "config.json")):
        cfg = read_hf_config(path, what)
        return cfg, HFSlices(path, hf_index(path, cfg), cfg.family)
    step_dir = resolve(path, what)
    record = check_checkpoint(step_dir, None, hashes=True)
    return model_config(record, os.path.join(step_dir, STATE)), SliceReader(step_dir, record["tensors"]["model"])


def load_model(path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A single-device LlamaForCausalLM (forward(input_ids) -> logits [batch, seq, vocab])
    from a dtensor3d checkpoint (step or checkpoint directory) or a Hugging Face Llama
    directory, on the CPU, in eval mode."""
    return model_from(*model_source(str(path), "load_model"), dtype)


def model_from(cfg: ModelConfig, files: SliceReader, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """The single-device model of `cfg` with its parameters read from `files` (model_source's pair)."""
    model = materialize(build_on_meta(cfg), "cpu")
    with files:
        load_params(model, files)
    return model.to(dtype).eval()


# ---------------------------------------------------------------- export-hf, import-hf


def _new_dir(out: str) -> None:
    """Refuse to write into an existing, non-empty directory (nothing is overwritten), or
    where this process cannot write (OUT, or the nearest directory above it that exists)."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise CheckpointError(f"OUT={out!r} exists and is not empty; nothing was written; give a new directory")
    where = os.path.abspath(out)
    while not os.path.isdir(where):
        where = os.path.dirname(where)
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=where)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"OUT={out!r}: cannot write {where} ({e.strerror or e}); nothing was written; give a writable directory"
        ) from None


@contextlib.contextmanager
def _writing(out: str, tmp: str):
    """Turn a failing write under OUT into one line naming it; the partial `tmp` is removed."""
    try:
        yield
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"OUT={out!r}: cannot write {err.filename or out} ({err.strerror or err}); nothing was written; "
            f"give a writable directory"
        ) from None


def _shard_names(source: SliceReader, max_bytes: int) -> list[list[str]]:
    """Tensor names in groups of at most max_bytes (one tensor per group at least)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in source.index:
        n = math.prod(source.shape(name)) * source.dtype(name).itemsize
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _write_hf(source: SliceReader, tmp: str, shards: list[list[str]], family: str) -> list[str]:
    """The safetensors files (and the index when there are several) of an export, written
    tensor by tensor: one full tensor in memory at a time."""
    files = (
        [HF_SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    with source:
        for file, names in zip(files, shards):
            tensors = {k: v for n in names for k, v in to_hf_lazy(n, source, family).items()}
            save_tensors(tensors, os.path.join(tmp, file))
            weight_map.update(dict.fromkeys(tensors, file))
    if len(files) > 1:
        total = sum(os.path.getsize(os.path.join(tmp, f)) for f in files)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_atomic(os.path.join(tmp, HF_INDEX), json.dumps(index, indent=1))
    return files


def export_hf(ckpt: str, out: str, max_shard_bytes: float = 5_000_000_000) -> list[str]:
    """Write config.json and model.safetensors (or shards + index) for transformers."""
    if not max_shard_bytes > 0 or max_shard_bytes == float("inf"):
        raise RecipeError(f"--max-shard-mb={max_shard_bytes / 1e6:g}: must be a positive number of megabytes")
    cfg, source = model_source(ckpt, "CKPT")
    config = hf_config(cfg)
    _new_dir(out)
    tmp = f"{out.rstrip(os.sep)}.tmp-export"
    with _writing(out, tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        files = _write_hf(source, tmp, _shard_names(source, int(max_shard_bytes)), config["model_type"])
        write_atomic(os.path.join(tmp, "config.json"), json.dumps(config, indent=1))
        files += _export_tokenizer(source, tmp, cfg)
        if os.path.isdir(out):
            os.rmdir(out)
        os.rename(tmp, out)
    return files


def _export_tokenizer(source, out: str, cfg: ModelConfig) -> list[str]:
    """A dtensor3d checkpoint's tokenizer.json (training copies its data's) as tokenizer.json
    and tokenizer_config.json in `out`, for transformers.AutoTokenizer; none: nothing."""
    path = os.path.join(source.root, "tokenizer.json")
    if isinstance(source, HFSlices) or not os.path.isfile(path):
        return []
    from ..datasets.tokenizer import write_hf_tokenizer

    return write_hf_tokenizer(path, out, max_length=cfg.max_position_embeddings)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _copy_tokenizer_files(hf_dir: str, step_tmp: str) -> None:
    """The directory's tokenizer (and chat template, a chat_template.jinja folded into
    tokenizer_config.json) into the step directory, listed in its manifest: `generate` and
    training's checkpoints then find it without --tokenizer."""
    from .save import CHAT_TEMPLATE, template_into_config

    for name in TOKENIZER_FILES:
        if name != CHAT_TEMPLATE and os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(step_tmp, name))
    if os.path.isfile(os.path.join(hf_dir, CHAT_TEMPLATE)):  # JSON only in a step directory
        template_into_config(os.path.join(hf_dir, CHAT_TEMPLATE), step_tmp)


def import_hf(hf_dir: str, out: str) -> str:
    """A Hugging Face Llama directory as a dtensor3d checkpoint directory (step 0, no
    optimizer state); returns its step directory."""
    cfg = read_hf_config(hf_dir, "DIR")
    index = hf_index(hf_dir, cfg)
    _new_dir(out)
    name = step_name(0)
    tmp = os.path.join(out, f".tmp-{name}")
    created = not os.path.exists(out)
    with _writing(out, out if created else tmp):
        os.makedirs(tmp)
        source = HFSlices(hf_dir, index, cfg.family)
        tensors = {n: (source.dtype(n), source.shape(n), lambda n=n: source.get(n)) for n in expected_shapes(cfg)}
        save_tensors(tensors, os.path.join(tmp, "model-stage00.safetensors"))
        _copy_tokenizer_files(hf_dir, tmp)
        seal(tmp, {"step": 0, "source": os.path.abspath(hf_dir), "recipe": Recipe(model=cfg).to_dict()})
        return publish(out, tmp, name)
