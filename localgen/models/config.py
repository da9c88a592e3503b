"""ModelConfig: one normalized description of a decoder-only model, whatever its source.

Every model source (embedded GGUF, local Hugging Face directory, hub id, GGUF path) produces a
`ModelConfig` plus a weight store whose tensor names follow the Hugging Face parameter names of the
family (``model.layers.{i}.self_attn.q_proj.weight`` …), so the per-family layer math and the policy
cost model read one shape of data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from localgen.models.moe_options import MoEConfigError, MoEOptions, moe_layer_parameters, moe_options
from localgen.models.dense_options import DenseConfigError, DenseOptions, dense_options, global_rope_parameters

# Hugging Face `architectures` / `model_type` values we run, mapped to our layer-math family.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    # the Llama layer with the departures of models/dense_options.py
    "Qwen3ForCausalLM": "llama",
    "Phi3ForCausalLM": "llama",
    "GraniteForCausalLM": "llama",
    "Olmo2ForCausalLM": "llama",
    "SmolLM3ForCausalLM": "llama",
    "Gemma2ForCausalLM": "llama",
    "Gemma3ForCausalLM": "llama",
    # the Llama layer with a mixture-of-experts MLP (models/moe.py)
    "MixtralForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",
    "GptOssForCausalLM": "llama",
    "OPTForCausalLM": "opt",
}
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "opt": "OPTForCausalLM",
}


class UnsupportedModelError(ValueError):
    """Raised at load time for an architecture, a checkpoint setting or a tensor type localgen
    has no math for; the message names the file, the key or tensor and its value."""


class CorruptModelError(ValueError):
    """Raised at load time for a model file that cannot be what it claims: not GGUF at all, a
    header cut short, tensor data past the end of the file; the message names the file and what
    is missing."""


def supported_list() -> str:
    """The families localgen runs, as users name them: each supported Hugging Face class
    without its ``ForCausalLM`` suffix (``"Llama, Mistral, OPT, Qwen2"``)."""
    return ", ".join(sorted({a.removesuffix("ForCausalLM") for a in SUPPORTED_ARCHITECTURES},
                            key=str.lower))


def unsupported_architecture(named: str, where: str | None = None,
                             detail: str = "") -> UnsupportedModelError:
    """The one-sentence error for an architecture without layer math: ``where`` (a file) and
    ``named`` (e.g. ``architecture 'MambaForCausalLM'``), then the supported families and
    ``detail`` (e.g. the GGUF archs that carry them)."""
    prefix = f"{where}: " if where else ""
    return UnsupportedModelError(
        f"{prefix}unsupported {named}; localgen runs these families: {supported_list()}{detail}")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a decoder-only transformer.

    Sizes are element counts; ``head_dim * num_heads`` need not equal ``hidden_size``.
    ``num_kv_heads < num_heads`` means GQA (``== 1``: MQA). OPT-only fields are ignored by the
    Llama family and vice versa.
    """

    architecture: str  # Hugging Face class name, e.g. "LlamaForCausalLM"
    family: str  # "llama" | "opt": which layer math runs it
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # MLP width (OPT: ffn_dim)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # Llama family
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None  # HF dict: {"rope_type": "llama3"|"linear"|…}
    # Per-frequency divisors [head_dim // 2] of the inverse frequencies, applied after
    # rope_scaling: a GGUF's `rope_freqs` tensor (llama.cpp's form of llama3 scaling).
    rope_freq_factors: tuple[float, ...] | None = None
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    mlp_bias: bool = False
    dense: DenseOptions = DenseOptions()  # the families' departures from the Llama layer
    moe: MoEOptions | None = None  # mixture-of-experts MLP (Mixtral, Qwen3-MoE); None = dense
    # OPT
    word_embed_proj_dim: int | None = None  # != hidden_size -> project_in / project_out
    do_layer_norm_before: bool = True
    enable_bias: bool = True
    activation: str = "silu"  # "relu" for OPT
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # the checkpoint's dtype name, informational
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def sliding_window(self) -> int | None:
        """The sliding window of the layers that have one (``dense.window(i)`` says which)."""
        return self.dense.sliding_window

    @property
    def attn_logit_softcapping(self) -> float | None:
        """The attention-score softcap of every layer (Gemma 2), None when off."""
        return self.dense.attn_logit_softcap

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (elements) from the shapes, embeddings counted once when tied."""
        n = self.num_layers * self.layer_parameters() + self.global_parameters()
        if self.moe is not None:  # Qwen3-MoE's dense layers hold a dense MLP, not the experts
            dense = self.num_layers - self.moe.num_moe_layers(self.num_layers)
            n += dense * (3 * self.hidden_size * self.intermediate_size
                          - moe_layer_parameters(self.moe, self.hidden_size))
        return n

    def layer_parameters(self) -> int:
        """Elements of one decoder layer: its matrices, norms and biases (with experts: an MoE
        layer, every expert counted)."""
        h, f = self.hidden_size, self.intermediate_size
        if self.family == "opt":
            n = 2 * h * self.q_size + 2 * h * self.kv_size + 2 * h * f
            return n + ((self.q_size + 2 * self.kv_size + h + f + h + 4 * h) if self.enable_bias else 4 * h)
        mlp = 3 * h * f if self.moe is None else moe_layer_parameters(self.moe, h)  # an MoE layer
        n = 2 * h * self.q_size + 2 * h * self.kv_size + mlp + 2 * h
        return n + (self.q_size + 2 * self.kv_size if self.attention_bias else 0)

    def global_parameters(self) -> int:
        """Elements outside the decoder layers: embeddings (token, OPT's positions and
        projections), the final norm and the lm_head unless tied."""
        h = self.hidden_size
        if self.family == "opt":
            e = self.word_embed_proj_dim or h
            emb = self.vocab_size * e + (self.max_position_embeddings + 2) * h + (2 * e * h if e != h else 0)
            return emb + (0 if self.tie_word_embeddings else self.vocab_size * e) + 2 * h
        return self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V, all layers, for one token."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (plus localgen's own
        ``rope_freq_factors``, a list of head_dim/2 floats, which the GGUF source sets).

        Raises UnsupportedModelError naming the supported architectures.
        """
        arch = _architecture_of(d)
        family = SUPPORTED_ARCHITECTURES[arch]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        common = dict(
            architecture=arch,
            family=family,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=int(d["num_attention_heads"]),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", family == "opt")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            extra=dict(d),
        )
        if family == "opt":
            h = common["hidden_size"]
            act = d.get("activation_function", "relu")
            return cls(
                intermediate_size=int(d["ffn_dim"]),
                num_kv_heads=common["num_heads"],
                head_dim=h // common["num_heads"],
                norm_eps=1e-5,
                word_embed_proj_dim=int(d.get("word_embed_proj_dim") or h),
                do_layer_norm_before=bool(d.get("do_layer_norm_before", True)),
                enable_bias=bool(d.get("enable_bias", True)),
                activation=act,
                **common,
            )
        n_heads = common["num_heads"]
        head_dim = d.get("head_dim") or common["hidden_size"] // n_heads
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        # transformers >= 5 folds theta/scaling here (per layer type for Gemma 3: the full layers')
        rope_params = global_rope_parameters(d) or d.get("rope_parameters")
        if isinstance(rope_params, Mapping):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_params.get("rope_type", "default") != "default" and rope_scaling is None:
                rope_scaling = dict(rope_params)
        if isinstance(rope_scaling, Mapping):
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling = None if rtype == "default" else {**rope_scaling, "rope_type": rtype}
        return cls(
            intermediate_size=int(d["intermediate_size"]),
            num_kv_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            rope_freq_factors=_freq_factors(d.get("rope_freq_factors")),
            attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
            mlp_bias=bool(d.get("mlp_bias", False)),
            activation=d.get("hidden_act") or d.get("hidden_activation") or "silu",
            dense=_dense(arch, d, common["num_layers"], int(head_dim)),
            moe=_moe(arch, d, common["num_layers"]),
            **common,
        )


def _moe(arch: str, d: Mapping[str, Any], num_layers: int) -> MoEOptions | None:
    try:
        return moe_options(arch, d, num_layers)
    except MoEConfigError as e:
        raise UnsupportedModelError(f"{arch}: {e}") from None


def _dense(arch: str, d: Mapping[str, Any], num_layers: int, head_dim: int) -> DenseOptions:
    try:
        return dense_options(arch, d, num_layers, head_dim)
    except DenseConfigError as e:
        raise UnsupportedModelError(f"{arch}: {e}") from None


def _freq_factors(v: Any) -> tuple[float, ...] | None:
    """localgen's own config key ``rope_freq_factors`` (set by the GGUF source) as a tuple."""
    return None if v is None else tuple(float(x) for x in v)


def _architecture_of(d: Mapping[str, Any]) -> str:
    archs = d.get("architectures") or []
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return a
    mt = d.get("model_type")
    if not archs and mt in SUPPORTED_MODEL_TYPES:
        return SUPPORTED_MODEL_TYPES[mt]
    named = f"architecture {', '.join(repr(a) for a in archs)}" if archs else f"model_type {mt!r}"
    raise unsupported_architecture(named)
