"""The recipe's schema: eight sections of frozen dataclasses, each field declared once
(type, default, bounds, aliases, doc: config/fields.py), and the named facts about the mesh.

Loading (YAML + overrides) is config/load.py; the checks that need the whole recipe and the
world size are config/checks.py. No torch here: `launch.sh` validates before torchrun starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from . import fields
from .data_sources import Source, Stage
from .families import FAMILIES
from .fields import choices_of, field_types, knob
from .parallelism import V_SCHEDULES, ParallelismConfig, stage_layers  # noqa: F401  (re-exported)
from .training import OptimizerConfig, TrainingConfig  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class ModelConfig:
    """The model, in Hugging Face config names (Mixtral's for a mixture of experts)."""

    vocab_size: int = knob(256, "tokens in the vocabulary (the embedding's and the head's rows)", positive=True)
    pad_vocab_to_multiple_of: int | None = knob(
        None,
        "pad the embedding's and the head's rows up to a multiple of this (Megatron's convention, e.g. 257 "
        "byte tokens at tp 2); the padded logits never count (loss, generate); export-hf writes the padded "
        "size; null: no padding",
        positive=True,
    )
    hidden_size: int = knob(64, "the residual stream's width", positive=True)
    intermediate_size: int = knob(176, "the feed-forward's inner width (SwiGLU)", positive=True)
    num_hidden_layers: int = knob(4, "decoder layers", positive=True)
    num_attention_heads: int = knob(4, "query heads", positive=True)
    num_key_value_heads: int = knob(2, "key/value heads (grouped-query attention)", positive=True)
    rms_norm_eps: float = knob(1e-5, "RMSNorm's epsilon")
    rope_theta: float = knob(10000.0, "RoPE's base")
    max_position_embeddings: int = knob(2048, "the longest sequence the model is for", positive=True)
    tie_word_embeddings: bool = knob(False, "the head shares the embedding's weight")
    num_local_experts: int = knob(0, "experts per MoE layer; 0: dense feed-forward (no experts)")
    num_experts_per_tok: int = knob(2, "experts each token is routed to (top-k)")
    router_aux_loss_coef: float = knob(0.001, "weight of Mixtral's load-balancing loss")
    shared_expert_intermediate_size: int = knob(0, "a shared expert's inner width; 0: no shared expert")
    moe_layers: tuple[int, ...] | None = knob(None, "the layers with experts; null: every layer")
    # Routers and layer patterns of Qwen3-MoE and DeepSeek-V3 (models/moe.py), by their config.json names.
    moe_intermediate_size: int = knob(0, "each routed expert's inner width; 0: intermediate_size")
    norm_topk_prob: bool = knob(True, "renormalise the top-k routing weights to sum to one")
    scoring_func: Literal["softmax", "sigmoid"] = knob("softmax", "router scores: softmax (Mixtral, Qwen) or sigmoid")
    n_group: int = knob(1, "expert groups for group-limited routing (DeepSeek-V3); 1: no groups", positive=True)
    topk_group: int = knob(1, "groups a token may route to (by each group's top-2 score sum)", positive=True)
    routed_scaling_factor: float = knob(1.0, "routed experts' weights are multiplied by this")
    n_shared_experts: int = knob(0, "shared experts of width moe_intermediate_size each (DeepSeek-V3)")
    first_k_dense_replace: int = knob(0, "the first k layers are dense (DeepSeek-V3)")
    decoder_sparse_step: int = knob(1, "every n-th layer has experts (Qwen MoE)", positive=True)
    mlp_only_layers: tuple[int, ...] | None = knob(None, "layers kept dense (Qwen MoE); null: none")
    router_bias_update_rate: float = knob(
        0.0, "aux-loss-free balancing: the correction bias moves by this x sign(mean - load) each step; 0: off"
    )
    # The model family (config/families.py) and Hugging Face's switches, by their config.json names.
    family: Literal[
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "mixtral",
        "qwen3_moe",
        "deepseek_v3",
        "olmo2",
        "olmo3",
        "smollm3",
        "gemma3_text",
        "phi3",
        "glm4_moe",
        "gpt_oss",
    ] = knob("llama", "the architecture (README: Model families); its Hugging Face model_type on export")
    head_dim: int | None = knob(None, "width of one attention head; null: hidden_size / num_attention_heads")
    attention_bias: bool = knob(False, "biases on q, k, v and o (llama, qwen3)")
    mlp_bias: bool = knob(False, "biases on gate, up and down (llama)")
    rope_scaling: dict | None = knob(
        None, "Hugging Face's RoPE scaling: rope_type linear, llama3 or yarn and its keys; null: none"
    )
    sliding_window: int | None = knob(
        None, "attention window: a query sees its last sliding_window positions (its own included); null: full"
    )
    layer_types: tuple[str, ...] | None = knob(
        None, "per layer: sliding_attention or full_attention (Hugging Face's layer_types); null: all sliding"
    )
    sliding_rope: dict | None = knob(
        None, "RoPE of the sliding_attention layers: rope_theta and a rope_type's keys (OLMo 3); null: as the others"
    )
    partial_rotary_factor: float = knob(1.0, "RoPE on this fraction of each head's dims, the first ones (GLM-4.5)")
    use_qk_norm: bool = knob(False, "per-head q/k RMSNorm where the family makes it a choice (glm4_moe)")
    nope_layers: tuple[int, ...] | None = knob(None, "layers without RoPE (SmolLM3's NoPE layers); null: none")
    hidden_act: Literal["silu", "gelu_pytorch_tanh"] = knob(
        "silu", "the feed-forward's activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU, Gemma 3)"
    )
    query_pre_attn_scalar: int | None = knob(
        None, "attention scores scaled by its -1/2 power (Gemma 3); null: head_dim's"
    )
    swiglu_limit: float | None = knob(
        None,
        "the experts' clamped SwiGLU (gpt-oss): (up + 1) * gate * sigmoid(swiglu_alpha * gate), gate clamped "
        "above and up on both sides at this limit; null: the plain SwiGLU",
    )
    swiglu_alpha: float = knob(1.702, "the clamped SwiGLU's sigmoid gain (gpt-oss)")
    # Multi-head latent attention (family deepseek_v3: models/mla.py), by DeepseekV3Config's names.
    q_lora_rank: int | None = knob(None, "MLA: the query's low-rank width; null: one full query projection")
    kv_lora_rank: int = knob(32, "MLA: the compressed key/value latent's width", positive=True)
    qk_nope_head_dim: int = knob(16, "MLA: per-head query/key width without RoPE", positive=True)
    qk_rope_head_dim: int = knob(8, "MLA: per-head query/key width with RoPE (the key part shared by all heads)")
    v_head_dim: int = knob(16, "MLA: per-head value width", positive=True)
    rope_interleave: bool = knob(True, "MLA: the RoPE part's pairs are interleaved (DeepSeek's layout)")
    num_nextn_predict_layers: int = knob(
        0,
        "multi-token prediction depths D (DeepSeek-V3's MTP modules, HF's name): depth k predicts the token k+1 "
        "ahead; loss = CE_main + (mtp_loss_weight / D) * sum of CE_k; 0: off",
    )
    mtp_loss_weight: float = knob(0.3, "MTP: lambda, the weight of the MTP losses' mean (DeepSeek-V3's early value)")
    mtp_hidden: Literal["pre_norm", "post_norm"] = knob(
        "pre_norm",
        "MTP: depth 1 reads the last decoder layer's output before the final norm (pre_norm: torchtitan's "
        "training code) or after it (post_norm: the hidden states vLLM's and SGLang's MTP read)",
    )

    def __post_init__(self):
        if self.head_dim is None and self.mla:  # as transformers' DeepseekV3Config: the RoPE part's width
            object.__setattr__(self, "head_dim", self.qk_rope_head_dim)
        if self.head_dim is None and self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @property
    def padded_vocab_size(self) -> int:
        """The embedding's and the head's rows: vocab_size, rounded up to pad_vocab_to_multiple_of."""
        multiple = self.pad_vocab_to_multiple_of or 1
        return -(-self.vocab_size // multiple) * multiple

    def is_moe_layer(self, index: int) -> bool:
        """Layers with experts: all of them when the model has experts, unless moe_layers lists
        some; less the first first_k_dense_replace, mlp_only_layers and those off decoder_sparse_step."""
        return (
            bool(self.num_local_experts)
            and (self.moe_layers is None or index in self.moe_layers)
            and index >= self.first_k_dense_replace
            and index not in (self.mlp_only_layers or ())
            and (index + 1) % self.decoder_sparse_step == 0
        )

    def layer_window(self, index: int) -> int | None:
        """Layer `index`'s sliding window: sliding_window unless layer_types makes it full; a
        multi-token-prediction layer (past the decoder's) attends as the last decoder layer."""
        if (
            self.layer_types is not None
            and self.layer_types[min(index, len(self.layer_types) - 1)] != "sliding_attention"
        ):
            return None
        return self.sliding_window

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def shared_intermediate_size(self) -> int:
        """The shared expert's inner width: DeepSeek's n_shared_experts x moe width, or Qwen2-MoE's own."""
        return self.n_shared_experts * self.expert_intermediate_size or self.shared_expert_intermediate_size

    @property
    def correction_bias(self) -> bool:
        """The router has e_score_correction_bias (DeepSeek-V3's, or for aux-loss-free balancing)."""
        return bool(self.num_local_experts) and (
            FAMILIES[self.family].correction_bias or self.router_bias_update_rate > 0
        )

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or FAMILIES[self.family].qkv_bias

    @property
    def qk_norm(self) -> bool:
        return FAMILIES[self.family].qk_norm or self.use_qk_norm

    @property
    def o_bias(self) -> bool:
        """A bias on o_proj: attention_bias, where the family's covers o_proj too."""
        return self.attention_bias and FAMILIES[self.family].o_bias

    @property
    def rotary_dim(self) -> int:
        """The head dims RoPE rotates (partial_rotary_factor of head_dim)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qk_norm_whole(self) -> bool:
        """The q/k norm spans all heads' projection (OLMo 2), not each head (Qwen3)."""
        return FAMILIES[self.family].qk_norm_whole

    @property
    def post_norms(self) -> bool:
        """RMSNorm after attention and after the MLP (OLMo 2) instead of before them."""
        return FAMILIES[self.family].post_norms

    def rope_of(self, index: int) -> ModelConfig:
        """The config whose rope_theta / rope_scaling layer `index` rotates by (sliding_rope on
        a sliding-window layer)."""
        if self.sliding_rope is None or self.layer_window(index) is None:
            return self
        scaling = {k: v for k, v in self.sliding_rope.items() if k != "rope_theta"}
        scaling = None if scaling.get("rope_type", "default") == "default" else scaling
        theta = self.sliding_rope.get("rope_theta", self.rope_theta)
        return dataclasses.replace(self, rope_theta=theta, rope_scaling=scaling, sliding_rope=None)

    @property
    def sandwich_norms(self) -> bool:
        return FAMILIES[self.family].sandwich_norms

    @property
    def norm_offset(self) -> bool:
        return FAMILIES[self.family].norm_offset

    @property
    def embed_scale(self) -> bool:
        return FAMILIES[self.family].embed_scale

    def layer_rope(self, index: int) -> bool:
        """Whether layer `index` applies RoPE (all but nope_layers)."""
        return index not in (self.nope_layers or ())

    @property
    def sinks(self) -> bool:
        """A learned logit per head in each attention row's softmax (gpt-oss: self_attn.sinks)."""
        return FAMILIES[self.family].sinks

    @property
    def expert_bias(self) -> bool:
        """Biases on the experts' projections and on the router (gpt-oss)."""
        return bool(self.num_local_experts) and FAMILIES[self.family].expert_bias

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3) instead of grouped-query attention."""
        return FAMILIES[self.family].mla


@dataclass(frozen=True)
class DataConfig:
    """What the model reads."""

    kind: Literal["synthetic", "tokens"] = knob("synthetic", "synthetic: seeded random tokens; tokens: data.path")
    path: str | None = knob(None, "tokens: a prepared directory (prepare-data) or one .npy / .bin token file")
    seed: int | None = knob(None, "the sample order's seed; null: training.seed")
    validation: str | None = knob(
        "split", "validation windows: split (held-out documents), a prepared dir, or null (also none): no validation"
    )
    sources: tuple[Source, ...] | None = knob(None, "a weighted mixture of prepared directories, not data.path")
    stages: tuple[Stage, ...] | None = knob(None, "mixtures taking over at steps (start_step counts from 1)")
    document_masking: bool = knob(
        False, "packed documents: attention within each document, RoPE positions restarting at each (prepared dirs)"
    )


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go, how often, and what a run starts from."""

    dir: str | None = knob(None, "the checkpoint directory; null: no checkpoints")
    interval: int = knob(0, "steps between checkpoints; 0: only at the end (when dir is set)")
    resume: str = knob(
        "auto",
        "auto (the newest complete step in dir), none, or a step or checkpoint directory",
        expected="auto, none, or a step or checkpoint directory",
    )
    keep: int = knob(2, "the newest checkpoints kept", positive=True)
    init_from_hf: str | None = knob(None, "a Hugging Face directory to start from when there is nothing to resume")
    preempt_timeout_s: float = knob(120.0, "SIGTERM/SIGINT: stop, save and exit within this time")
    async_save: bool = knob(False, "write checkpoints in the background while training goes on", aliases=("async",))
    on_damaged: Literal["refuse", "previous"] = knob(
        "refuse",
        "a damaged newest step at launch (a file missing, truncated or corrupt): refuse (one error line), or "
        "previous: set it aside as step_N.damaged and resume from the step before",
    )


@dataclass(frozen=True)
class LoggingConfig:
    """What rank 0 writes and prints."""

    run_dir: str = knob(
        "runs/default",
        "metrics.jsonl, loss.svg, the resolved recipe (and TensorBoard events) go here",
        expected="a directory path, e.g. runs/debug",
    )
    every: int = knob(1, "steps between logged lines and metrics records", positive=True)
    tensorboard: bool = knob(False, "TensorBoard events in <run_dir>/tensorboard (the `tensorboard` extra)")
    profile_steps: tuple[int, ...] | None = knob(None, "[first, last]: a torch.profiler trace per rank of those steps")
    layout: bool = knob(False, "<run_dir>/layout/rank<R>.json: how each rank holds every parameter")
    expert_load_warn: float = knob(4.0, "warn when a MoE layer's max/mean tokens per expert stays above this; 0: never")
    expert_load_warn_steps: int = knob(20, "...for this many consecutive steps", positive=True)
    peak_tflops: float | None = knob(
        None, "the device's peak TFLOP/s for `mfu` (default: the GPU table's bf16 dense figure; none on CPU)"
    )
    straggler_ratio: float = knob(0.0, "warn when a rank's step time stays above this x the ranks' median; 0: never")
    straggler_steps: int = knob(5, "...for this many consecutive steps", positive=True)
    wandb: dict | None = knob(
        None,
        "Weights & Biases beside TensorBoard (the `wandb` extra): {project, entity, name, mode: online | offline, "
        "tags}; rank 0 logs every metric, the resolved recipe as the run config and loss.svg at the end; a resumed "
        "run continues the same W&B run (its id is in the checkpoint); null: off",
    )


@dataclass(frozen=True)
class EvalConfig:
    """Downstream evaluation inside the loop: lm-evaluation-harness on the live model (harness/)."""

    tasks: tuple[str, ...] | None = knob(None, "lm-eval task names to run every eval.every steps; null: none")
    every: int = knob(0, "steps between downstream evaluations (and at the last step); 0: never")
    limit: float | None = knob(None, "at most this many documents per task (a fraction if < 1); null: all")
    include_path: str | None = knob(None, "a directory of extra task YAML files (local tasks)")
    batch_size: int = knob(8, "requests per forward (loglikelihood)", positive=True)
    num_fewshot: int | None = knob(None, "few-shot examples per prompt; null: the task's")


@dataclass(frozen=True)
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def num_microbatches(self) -> int:
        """Microbatches per optimizer step on each of the ep x dp batch ranks."""
        p, t = self.parallelism, self.training
        return t.global_batch_size // (t.micro_batch_size * p.batch_ranks)

    def to_dict(self) -> dict[str, Any]:
        """Every setting as plain YAML types, less those that cannot apply (the expert settings
        of a dense model), so that the dict read back as a recipe is accepted."""
        out = dataclasses.asdict(self)
        if not self.model.num_local_experts:
            for key in EXPERT_ONLY:
                del out["model"][key]
        if not self.model.mla:
            for key in MLA_ONLY:
                del out["model"][key]
        return fields.plain(out)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Recipe)}
_SECTION_CLASSES = {
    "model": ModelConfig,
    "parallelism": ParallelismConfig,
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "eval": EvalConfig,
}
# Derived from the field declarations (config/fields.py): each field is declared once.
TYPES = {name: field_types(cls) for name, cls in _SECTION_CLASSES.items()}
ALIASES = {  # nanotron's long names (and `async`, a Python keyword) for the names we keep
    (section, alias): f.name
    for section, cls in _SECTION_CLASSES.items()
    for f in dataclasses.fields(cls)
    for alias in f.metadata.get(fields.ALIASES, ())
}
ENUMS = {
    (section, name): choices
    for section, types_ in TYPES.items()
    for name, tp in types_.items()
    if (choices := choices_of(tp))
}
NON_EMPTY = {
    f"{section}.{f.name}": f.metadata[fields.EXPECTED]
    for section, cls in _SECTION_CLASSES.items()
    for f in dataclasses.fields(cls)
    if f.metadata.get(fields.EXPECTED)
}
POSITIVE = {
    section: tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get(fields.POSITIVE))
    for section, cls in _SECTION_CLASSES.items()
}

# The model settings that only a model with experts may give (a dense recipe is refused them).
EXPERT_ONLY = tuple(
    "num_experts_per_tok router_aux_loss_coef shared_expert_intermediate_size moe_intermediate_size "
    "norm_topk_prob scoring_func n_group topk_group routed_scaling_factor n_shared_experts "
    "first_k_dense_replace decoder_sparse_step mlp_only_layers router_bias_update_rate".split()
)
MLA_ONLY = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave")
