"""Hugging Face config.json ↔ the architecture fields of `ModelConfig`, for every registered
family (meshtrain.families: its model_type, defaults, fixed features and own keys).

Reads both the published format (rope_theta, rope_scaling, rope_local_base_freq,
sliding_window_pattern; transformers 4.x) and the transformers 5 format (rope_parameters,
layer_types); writes the published format, which both load. Keys a published config leaves out
take the defaults of the transformers config class of its model_type (Gemma 3 4B/12B/27B rely on
them).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from meshtrain.config.schema import ModelConfig
from meshtrain.errors import ConfigError
from meshtrain.families import REGISTERED, Family, family, family_of_model_type

_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}
_ACTIVATION_NAMES = {"silu": "silu", "gelu": "gelu_pytorch_tanh"}

# ModelConfig field → how config.json calls it, for error messages.
HF_NAMES = {
    "family": "model_type",
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "mlp_dim": "intermediate_size",
    "mlp_activation": "hidden_act (Gemma: hidden_activation)",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "max_seq_len": "max_position_embeddings",
    "attention_pattern": "layer_types",
    "sliding_window": "sliding_window",
    "rope_local_theta": "rope_local_base_freq",
    "rope_scaling": "rope_scaling.rope_type",
    "rope_scaling_factor": "rope_scaling.factor",
    "rope_low_freq_factor": "rope_scaling.low_freq_factor",
    "rope_high_freq_factor": "rope_scaling.high_freq_factor",
    "rope_original_max_len": "rope_scaling.original_max_position_embeddings",
    "qk_norm": "model_type",
    "post_norms": "model_type",
    "norm_scale_offset": "model_type",
    "scale_embeddings": "model_type",
    "query_pre_attn_scalar": "query_pre_attn_scalar",
    "moe.num_experts": "num_experts (Mixtral: num_local_experts)",
    "moe.top_k": "num_experts_per_tok",
    "moe.expert_dim": "moe_intermediate_size (Mixtral: intermediate_size)",
    "moe.normalize_top_k": "norm_topk_prob",
}


def read_config_json(directory: Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"{path} does not exist; a Hugging Face checkpoint directory holds config.json"
        )
    return json.loads(path.read_text())


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: Gemma 3 4B/12B/27B nest it under text_config."""
    if "text_config" in hf:
        text = dict(hf["text_config"])
        outer = hf.get("model_type")
        text.setdefault("model_type", family_of_model_type(outer, "config.json").model_type)
        for key in ("tie_word_embeddings",):
            if key in hf and key not in text:
                text[key] = hf[key]
        return text
    return hf


def family_of(hf: dict[str, Any], source: str) -> Family:
    """The family of an HF config.json (its language model's model_type)."""
    return family_of_model_type(_text_config(hf).get("model_type"), source)


def _rope(text: dict[str, Any], family: Family) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) RoPE parameters as {rope_type, rope_theta, factor, ...}; `text` holds the
    family's defaults."""
    params = text.get("rope_parameters")
    if params is not None and "full_attention" in params:  # transformers 5, per layer type
        return dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    if params is not None:  # transformers 5, one set for every layer
        return dict(params), {}
    scaling = dict(text.get("rope_scaling") or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    scaling["rope_theta"] = text["rope_theta"]
    local = {}
    if family.sliding_layers:
        local = {"rope_type": "default", "rope_theta": text["rope_local_base_freq"]}
    return scaling, local


def _layer_kinds(text: dict[str, Any], family: Family, num_layers: int) -> list[str]:
    """global or local, per layer; `text` holds the family's defaults."""
    if not family.sliding_layers:
        if text.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true (Qwen sliding layers) is not supported")
        return ["global"] * num_layers
    if text.get("layer_types"):
        kinds = {"sliding_attention": "local", "full_attention": "global"}
        return [kinds[t] for t in text["layer_types"]]
    period = text["sliding_window_pattern"]
    return ["local" if (i + 1) % period else "global" for i in range(num_layers)]


def _shortest_period(kinds: list[str]) -> list[str]:
    """The shortest pattern whose repetition gives `kinds` (Gemma 3: 5 local, 1 global)."""
    for period in range(1, len(kinds) + 1):
        if all(kind == kinds[i % period] for i, kind in enumerate(kinds)):
            return kinds[:period]
    return kinds


def architecture_from_hf(hf: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """ModelConfig fields (architecture only, no mesh or training choices) of an HF config.json."""
    family = family_of(hf, source)
    text = {**family.hf_defaults, **{k: v for k, v in _text_config(hf).items() if v is not None}}
    unsupported = {
        "attention_bias": False,
        "mlp_bias": False,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }
    for key, expected in unsupported.items():
        if text.get(key, expected) != expected:
            raise ConfigError(f"{source}: {key}={text[key]!r} is not supported (only {expected})")
    activation = text.get("hidden_activation", text.get("hidden_act"))
    if activation not in _ACTIVATIONS:
        raise ConfigError(f"{source}: activation {activation!r} is not supported; use silu or gelu")
    num_heads = text["num_attention_heads"]
    num_layers = text["num_hidden_layers"]
    global_rope, local_rope = _rope(text, family)
    rope_type = global_rope.get("rope_type", "default")
    if rope_type not in ("default", "linear", "llama3"):
        raise ConfigError(
            f"{source}: RoPE type {rope_type!r} is not supported; use linear or llama3"
        )
    if global_rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor is not supported")
    kinds = _layer_kinds(text, family, num_layers)
    fields: dict[str, Any] = {
        "family": family.name,
        "vocab_size": text["vocab_size"],
        "d_model": text["hidden_size"],
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": text.get("num_key_value_heads") or num_heads,
        "head_dim": text.get("head_dim") or text["hidden_size"] // num_heads,
        "mlp_dim": text["intermediate_size"],
        "mlp_activation": _ACTIVATIONS[activation],
        "rope_theta": float(global_rope["rope_theta"]),
        "norm_eps": float(text["rms_norm_eps"]),
        "tie_embeddings": bool(text["tie_word_embeddings"]),
        "max_seq_len": text["max_position_embeddings"],
        "attention_pattern": _shortest_period(kinds),
        "sliding_window": text.get("sliding_window") if "local" in kinds else None,
        "rope_local_theta": float(local_rope["rope_theta"]) if local_rope else None,
        "rope_scaling": {"default": "none"}.get(rope_type, rope_type),
        "rope_scaling_factor": float(global_rope.get("factor", 1.0)),
        "rope_low_freq_factor": float(global_rope.get("low_freq_factor", 1.0)),
        "rope_high_freq_factor": float(global_rope.get("high_freq_factor", 4.0)),
        "rope_original_max_len": int(global_rope.get("original_max_position_embeddings", 8192)),
        "query_pre_attn_scalar": (
            float(text["query_pre_attn_scalar"]) if family.attention_scale else None
        ),
        **family.features,
        **family.read_fields(text, source),
    }
    if len(kinds) != num_layers:
        raise ConfigError(f"{source}: layer_types has {len(kinds)} entries for {num_layers} layers")
    return fields


def _comparable(model: ModelConfig) -> dict[str, Any]:
    """The architecture of `model` with the values that do not change the computation normalised
    (an unused window or scaling factor, rope_local_theta null meaning rope_theta...)."""
    values = {key: _field(model, key) for key in HF_NAMES}
    kinds = [
        model.attention_pattern[i % len(model.attention_pattern)] for i in range(model.num_layers)
    ]
    values["attention_pattern"] = kinds
    if "local" not in kinds:
        values["sliding_window"] = None
        values["rope_local_theta"] = None
    elif values["rope_local_theta"] is None:
        values["rope_local_theta"] = model.rope_theta
    if model.rope_scaling == "none":
        values["rope_scaling_factor"] = 1.0
    if model.rope_scaling != "llama3":
        for key in ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len"):
            values[key] = None
    if model.query_pre_attn_scalar is None:
        values["query_pre_attn_scalar"] = float(model.head_dim)
    return values


def check_matches(model: ModelConfig, hf: dict[str, Any], source: str) -> None:
    """One ConfigError naming the first field where the chosen `model=` differs from config.json."""
    from_hf = dataclasses.replace(model, **architecture_from_hf(hf, source))
    expected = _comparable(from_hf)
    actual = _comparable(model)
    for key, want in expected.items():
        have = actual[key]
        same = (
            abs(float(have) - float(want)) <= 1e-9 * abs(float(want))
            if isinstance(want, float) and isinstance(have, int | float)
            else have == want
        )
        if not same:
            shown_have = _shown(key, _field(model, key))
            shown_want = _shown(key, _field(from_hf, key))
            raise ConfigError(
                f"model.{key}={shown_have} does not match {HF_NAMES[key]} in {source} "
                f"(model.{key}={shown_want}); choose the model config of this checkpoint or set "
                f"model.{key}={shown_want}"
            )


def _field(model: ModelConfig, key: str) -> Any:
    """model's field `key`, a nested one dotted (moe.top_k)."""
    value: Any = model
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _shown(key: str, value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def model_config_from_hf(
    hf: dict[str, Any], *, name: str, source: str, **fields: Any
) -> ModelConfig:
    """A ModelConfig for an HF checkpoint: its architecture plus `fields` (mesh, remat...)."""
    return ModelConfig(name=name, **architecture_from_hf(hf, source), **fields)


def hf_config_from_model(
    model: ModelConfig, *, dtype: str, special_tokens: dict[str, int] | None = None
) -> dict[str, Any]:
    """config.json for `model` in the published format, loadable by transformers 4.5x and 5."""
    spec = family(model.family)
    for key, value in spec.features.items():
        if getattr(model, key) != value:
            raise ConfigError(
                f"model.{key}={getattr(model, key)} cannot be exported as model.family="
                f"{model.family} ({spec.architecture} has {key}={value})"
            )
    kinds = [
        model.attention_pattern[i % len(model.attention_pattern)] for i in range(model.num_layers)
    ]
    if not spec.sliding_layers and "local" in kinds:
        with_local = [f.name for f in REGISTERED.values() if f.sliding_layers]
        raise ConfigError(
            f"model.attention_pattern={_shown('attention_pattern', model.attention_pattern)} "
            f"has local layers, which {spec.architecture} does not; export as "
            f"{' or '.join(with_local)}"
        )
    if not spec.attention_scale and model.query_pre_attn_scalar not in (None, model.head_dim):
        raise ConfigError(
            f"model.query_pre_attn_scalar={model.query_pre_attn_scalar} cannot be exported as "
            f"model.family={model.family}; its attention scale is 1/sqrt(head_dim)"
        )
    rope_scaling = None
    if model.rope_scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": model.rope_scaling_factor}
    elif model.rope_scaling == "llama3":
        rope_scaling = {
            "rope_type": "llama3",
            "factor": model.rope_scaling_factor,
            "low_freq_factor": model.rope_low_freq_factor,
            "high_freq_factor": model.rope_high_freq_factor,
            "original_max_position_embeddings": model.rope_original_max_len,
        }
    config: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": model.mlp_dim,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": model.max_seq_len,
        "tie_word_embeddings": model.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": dtype,
    }
    config[spec.activation_key] = _ACTIVATION_NAMES[model.mlp_activation]
    config.update(spec.export_fields(model, kinds))
    config.update(special_tokens or {})
    return config
