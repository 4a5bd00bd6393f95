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

import torch

from ..config.families import FAMILIES
from ..config.hf_config import hf_model_values, read_config_json
from ..config.load import recipe_from_dict
from ..config.schema import ModelConfig, Recipe
from ..errors import CheckpointError, RecipeError
from ..models import build_on_meta, materialize, stored_name
from ..models.llama import LlamaForCausalLM
from . import hf_gpt_oss
from .check import check_checkpoint, expected_shapes, model_config
from .find import resolve
from .format import STATE, check_tensors, publish, read_header, read_json, save_tensors, seal, step_name, write_atomic
from .hf_fields import hf_config
from .hf_names import (
    HF_INDEX,
    HF_SINGLE,
    PICKLE_SUFFIXES,
    HFSlices,
    hf_shapes,
    to_hf_lazy,
)
from .outdir import check_out, mark, swap_in
from .slices import SliceReader, read_into_

# ---------------------------------------------------------------- config.json


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    """A Hugging Face config.json of a supported family as a ModelConfig; what cannot run is refused."""
    values = hf_model_values(hf, where)
    try:
        return recipe_from_dict({"model": values}).model
    except RecipeError as e:
        raise CheckpointError(f"{where}: {e}") from None


def read_hf_config(hf_dir: str, what: str) -> ModelConfig:
    cfg = config_from_hf(read_config_json(hf_dir, what), os.path.join(hf_dir, "config.json"))
    return _mtp_present(hf_dir, cfg) if cfg.num_nextn_predict_layers else cfg


def _mtp_present(hf_dir: str, cfg: ModelConfig) -> ModelConfig:
    """num_nextn_predict_layers: the MTP layers the directory holds (model.layers.{N+k-1}.eh_proj):
    transformers' save_pretrained writes the config's count (1 by default) and no such tensors."""
    names, n = _weight_map(hf_dir), cfg.num_hidden_layers
    held = next(
        (k for k in range(cfg.num_nextn_predict_layers) if f"model.layers.{n + k}.eh_proj.weight" not in names), None
    )
    return cfg if held is None else dataclasses.replace(cfg, num_nextn_predict_layers=held)


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
    _check_mtp_copies(hf_dir, weight_map, cfg)
    weight_map = {
        n: f
        for n, f in weight_map.items()
        if not n.endswith("rotary_emb.inv_freq")
        and not (cfg.tie_word_embeddings and n == "lm_head.weight")
        and not _prediction_layer(n, cfg)
    }
    check_tensors(hf_dir, weight_map, hf_gpt_oss.mxfp4_expected(hf_shapes(cfg), weight_map))
    return weight_map


def _prediction_layer(name: str, cfg) -> bool:
    """DeepSeek-V3's and GLM-4.5's multi-token prediction layers (model.layers.N.* for N >=
    num_hidden_layers) that the model does not read: those past model.num_nextn_predict_layers
    (transformers reads none), and the read ones' copies of the embedding and the head."""
    parts = name.split(".")
    return (
        FAMILIES[cfg.family].prediction_layers
        and parts[:2] == ["model", "layers"]
        and int(parts[2]) >= cfg.num_hidden_layers
        and (
            int(parts[2]) >= cfg.num_hidden_layers + cfg.num_nextn_predict_layers or ".".join(parts[3:-1]) in MTP_COPIES
        )
    )


# An MTP layer's copies of the embedding and the head (DeepSeek-V3's checkpoint): ours are the main model's.
MTP_COPIES = ("embed_tokens", "shared_head.head")


def _check_mtp_copies(hf_dir: str, weight_map: dict[str, str], cfg) -> None:
    """The read MTP layers' embed_tokens and shared_head.head must equal the main model's (the
    model shares them); one CheckpointError line names those that differ."""
    from safetensors import safe_open

    def get(name: str) -> torch.Tensor:
        with safe_open(os.path.join(hf_dir, weight_map[name]), "pt") as f:
            return f.get_tensor(name)

    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    main = {"embed_tokens": "model.embed_tokens.weight", "shared_head.head": head}
    n, differ = cfg.num_hidden_layers, []
    for i in range(n, n + cfg.num_nextn_predict_layers):
        for part, ours in main.items():
            name = f"model.layers.{i}.{part}.weight"
            if name in weight_map and not torch.equal(get(name), get(ours)):
                differ.append(f"{name} (not {ours})")
    if differ:
        raise CheckpointError(
            f"{hf_dir}: the MTP layers share the main model's embedding and head: {', '.join(differ)}"
        )


def _same(a, b) -> bool:
    """Equal, floats to a relative 1e-6 (a config.json may hold float32 values: 9.999999747378752e-06)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


def check_hf_init(recipe) -> dict[str, str]:
    """checkpoint.init_from_hf against the recipe's model; returns the tensor index."""
    hf_dir = recipe.checkpoint.init_from_hf
    theirs, m = read_hf_config(hf_dir, "checkpoint.init_from_hf"), recipe.model
    if m.padded_vocab_size != m.vocab_size:  # its tensors have vocab_size rows, not the padded count
        raise CheckpointError(
            f"checkpoint.init_from_hf={hf_dir!r}: model.pad_vocab_to_multiple_of={m.pad_vocab_to_multiple_of} pads "
            f"vocab_size={m.vocab_size} to {m.padded_vocab_size} rows, which the directory's tensors do not hold; "
            "set model.pad_vocab_to_multiple_of: null (starting a padded model from Hugging Face is not supported)"
        )
    for f in dataclasses.fields(ModelConfig):
        if f.name in ("pad_vocab_to_multiple_of", "mtp_loss_weight", "mtp_hidden"):  # not config.json keys
            continue
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


def export_hf(ckpt: str, out: str, max_shard_bytes: float = 5_000_000_000, overwrite: bool = False) -> list[str]:
    """Write config.json and model.safetensors (or shards + index) for transformers; OUT new
    or empty, or with `overwrite` a directory export-hf wrote (outdir.py)."""
    if not max_shard_bytes > 0 or max_shard_bytes == float("inf"):
        raise RecipeError(f"--max-shard-mb={max_shard_bytes / 1e6:g}: must be a positive number of megabytes")
    cfg, source = model_source(ckpt, "CKPT")
    config = hf_config(cfg)
    if cfg.num_nextn_predict_layers and config.get("num_nextn_predict_layers") is None:
        print(
            f"note: the {cfg.num_nextn_predict_layers} MTP layers are written as model.layers."
            f"{cfg.num_hidden_layers}.. (DeepSeek-V3's names); transformers' {config['model_type']} class ignores them",
            flush=True,
        )
    check_out(out, "export-hf", overwrite)
    tmp = f"{out.rstrip(os.sep)}.tmp-export"
    with _writing(out, tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        files = _write_hf(source, tmp, _shard_names(source, int(max_shard_bytes)), config["model_type"])
        write_atomic(os.path.join(tmp, "config.json"), json.dumps(config, indent=1))
        files += _export_tokenizer(source, tmp, cfg)
        mark(tmp, "export-hf")
        swap_in(tmp, out)
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


def import_hf(hf_dir: str, out: str, overwrite: bool = False) -> str:
    """A Hugging Face Llama directory as a dtensor3d checkpoint directory (step 0, no
    optimizer state); returns its step directory. OUT new or empty, or with `overwrite` a
    directory import-hf wrote, replaced once the new one is complete (outdir.py)."""
    cfg = read_hf_config(hf_dir, "DIR")
    index = hf_index(hf_dir, cfg)
    replacing = check_out(out, "import-hf", overwrite)
    target = f"{out.rstrip(os.sep)}.tmp-import" if replacing else out
    if replacing:
        shutil.rmtree(target, ignore_errors=True)
    name = step_name(0)
    tmp = os.path.join(target, f".tmp-{name}")
    created = not os.path.exists(target)
    with _writing(out, target if created else tmp):
        os.makedirs(tmp)
        source = HFSlices(hf_dir, index, cfg.family)
        tensors = {n: (source.dtype(n), source.shape(n), lambda n=n: source.get(n)) for n in expected_shapes(cfg)}
        save_tensors(tensors, os.path.join(tmp, "model-stage00.safetensors"))
        _copy_tokenizer_files(hf_dir, tmp)
        seal(tmp, {"step": 0, "source": os.path.abspath(hf_dir), "recipe": Recipe(model=cfg).to_dict()})
        step_dir = publish(target, tmp, name)
        mark(target, "import-hf")
        if replacing:
            swap_in(target, out)
        return os.path.join(out, os.path.basename(step_dir))
