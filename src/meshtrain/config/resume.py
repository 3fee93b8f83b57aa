"""What a resumed run may change: every config key is compared with the config saved in the
checkpoint, and falls in one of three classes (docs/checkpointing.md#what-resume-compares):

  - REFUSED: keys that change what the run computes or reads (the architecture, the data and
    its tokenizer, seq_len, the seed, the global batch, the loss's masking). A change cannot be
    continued exactly; it is refused in one line unless listed in checkpoint.allow_changes.
  - ALLOWED: keys a user may want to change on resume (learning rate, schedule, steps, logging,
    evaluation, the mesh and how the step is computed); a change is logged in one line.
  - IGNORED: keys that only say where things go or how they are observed.

A class holds key prefixes: `data.mixture` covers `data.mixture[0].weight`. Every key of the
schema belongs to exactly one class (a test enforces it), so a new field must be placed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshtrain.errors import ConfigError, did_you_mean

REFUSED = (
    "model.vocab_size",
    "model.d_model",
    "model.num_layers",
    "model.num_heads",
    "model.num_kv_heads",
    "model.head_dim",
    "model.mlp_dim",
    "model.mlp_activation",
    "model.rope_theta",
    "model.norm_eps",
    "model.tie_embeddings",
    "model.family",
    "model.attention_pattern",
    "model.sliding_window",
    "model.rope_local_theta",
    "model.rope_scaling",
    "model.rope_scaling_factor",
    "model.rope_low_freq_factor",
    "model.rope_high_freq_factor",
    "model.rope_original_max_len",
    "model.qk_norm",
    "model.post_norms",
    "model.norm_scale_offset",
    "model.scale_embeddings",
    "model.query_pre_attn_scalar",
    "model.scan_layers",
    "model.lora.rank",
    "model.lora.alpha",
    "model.lora.targets",
    "model.lora.base_dtype",
    "model.lora.quant_block",
    "model.lora.base",  # the frozen base's identity (weights.lora_base: the caller puts it here)
    "model.moe.num_experts",
    "model.moe.top_k",
    "model.moe.expert_dim",
    "model.moe.score",
    "model.moe.normalize_top_k",
    "data.source",
    "data.paths",
    "data.path",
    "data.glob",
    "data.text_key",
    "data.messages_key",
    "data.prompt_key",
    "data.completion_key",
    "data.chosen_key",
    "data.rejected_key",
    "data.shared_prompt",  # the layout of the pairs and of the rollouts in the rows
    "data.chat_template",
    "data.train_on",
    "data.overlong",
    "data.packing",  # which conversations share a row
    "data.mixture",
    "data.document_masking",
    "data.tokenizer",  # compared by content (the caller puts its identity here)
    "data.seq_len",
    "data.validation_fraction",  # of the training data: 0 where data.validation_paths is set
    "data.on_bad_record",
    "training.seed",
    "training.global_batch_size",  # sequences per step, however they are made up
    "objective.name",
    "objective.loss_type",
    "objective.reference",
    "objective.reference_weights",  # its identity (weights.lora_base: the caller puts it here)
    "objective.num_generations",  # the prompts each step reads
    "objective.num_iterations",  # which steps sample, and the completions a checkpoint holds
    "objective.steps_per_generation",
)
ALLOWED = (
    "model.name",
    "model.mesh_shape",
    "model.logical_axis_rules",
    "model.max_seq_len",
    "model.remat",
    "model.attention",
    "model.pipeline",
    "model.lora.dropout",
    "model.moe.capacity_factor",
    "model.moe.aux_loss_coef",
    "model.moe.z_loss_coef",
    "data.validation_paths",
    "training.steps",
    "training.epochs",
    "training.micro_batch_size",
    "training.gradient_accumulation_steps",
    "training.sync_gradients_every",
    "training.reduce_dtype",
    "training.learning_rate",
    "training.warmup_steps",
    "training.lr_schedule",
    "training.min_lr_ratio",
    "training.weight_decay",
    "training.adam_b1",
    "training.adam_b2",
    "training.adam_eps",
    "training.grad_clip",
    "training.mixed_precision",
    "training.log_every",
    "training.eval_every",
    "training.eval_batches",
    "training.nonfinite",
    "training.pipeline",
    "eval",
    "objective.beta",
    "objective.label_smoothing",
    "objective.gamma",
    "objective.epsilon",
    "objective.epsilon_high",
    "objective.max_new_tokens",
    "objective.temperature",
    "objective.top_k",
    "objective.top_p",
    "objective.rewards",
    "objective.reward_weights",
    "objective.scale_rewards",
    "objective.mask_truncated_completions",
    "objective.importance_sampling_level",
    "objective.answer_column",
    "objective.answer_pattern",
    "objective.format_pattern",
)
IGNORED = (
    "model.init_std",  # a resumed run is not initialised
    "model.init_from",  # a LoRA run's base is compared by content as model.lora.base
    "model.lora.init_from",
    "data.workers",
    "data.cache_dir",
    "data.verify",
    "training.profile",
    "training.profile_communication",
    "training.dry_run",
    "training.compilation_cache_dir",
    "training.xla_gpu_flags",
    "checkpoint",
    "profile",
    "plan",
    "experiment",
    "distributed",
    "logging",  # where the metrics go (trackers), not what the run computes
)
_INDEX = re.compile(r"\[\d+\]")


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a.b": value} of a nested config dict; a list of dicts (data.mixture) becomes
    "key[i].field" entries, any other list stays one value."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            for i, item in enumerate(value):
                flat.update(flatten(item, f"{name}[{i}]."))
        else:
            flat[name] = value
    return flat


def _covers(prefix: str, key: str) -> bool:
    """Whether `prefix` names `key` or a part of the config above it; list indices may be left
    out of the prefix (data.mixture.weight covers data.mixture[1].weight)."""
    bare = _INDEX.sub("", key)
    return any(k == prefix or k.startswith(f"{prefix}.") for k in (key, bare))


def key_class(key: str) -> str:
    """ "refused", "allowed" or "ignored" for a flattened key; ValueError if none covers it."""
    for name, prefixes in (("refused", REFUSED), ("allowed", ALLOWED), ("ignored", IGNORED)):
        if any(_covers(p, key) for p in prefixes):
            return name
    raise ValueError(f"config key {key} is in none of REFUSED, ALLOWED and IGNORED")


def check_allow_changes(keys: Iterable[str]) -> None:
    """Raises ConfigError for an entry of checkpoint.allow_changes that names no compared key."""
    for key in keys:
        known = [p for p in REFUSED + ALLOWED if _covers(key, p) or _covers(p, key)]
        if not known:
            raise ConfigError(
                f"checkpoint.allow_changes: {key!r} is not a key that resume compares"
                f"{did_you_mean(key, REFUSED)}; list keys such as data.mixture or training.seed "
                "(docs/checkpointing.md#what-resume-compares)"
            )


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    refused: bool  # a REFUSED key not listed in checkpoint.allow_changes
    on_purpose: bool = False  # a REFUSED key listed in checkpoint.allow_changes

    def __str__(self) -> str:
        text = f"{self.key} {_show(self.old)} → {_show(self.new)}"
        return f"{text} (checkpoint.allow_changes)" if self.on_purpose else text


_ABSENT = "(none)"


def compare(
    saved: Mapping[str, Any], current: Mapping[str, Any], allow: Sequence[str]
) -> list[Change]:
    """The changes from the flattened `saved` config to `current`, in key order; keys the saved
    config lacks (a checkpoint written before they existed) are not compared."""
    changes = []
    keys = [k for k in current if k in saved or _INDEX.search(k)]
    keys += [k for k in saved if k not in current and _INDEX.search(k)]  # a mixture entry less
    for key in keys:
        old, new = saved.get(key, _ABSENT), current.get(key, _ABSENT)
        kind = key_class(key)
        if old == new or kind == "ignored":
            continue
        listed = kind == "refused" and any(_covers(a, key) for a in allow)
        changes.append(Change(key, old, new, kind == "refused" and not listed, listed))
    return changes


def refusal(changes: Sequence[Change], checkpoint: str, *, adapters: bool = False) -> str:
    """The one line that refuses the REFUSED changes of a resume from `checkpoint` (a LoRA
    run's, holding adapters, with `adapters`)."""
    refused = [c for c in changes if c.refused]
    keys = ",".join(dict.fromkeys(_INDEX.sub("", c.key) for c in refused))
    # Adapters of another rank or on other projections cannot start from these ones.
    reshaped = any(c.key in ("model.lora.rank", "model.lora.targets") for c in refused)
    if adapters and reshaped:
        fresh = ""
    elif adapters:
        fresh = (
            f" start new adapters from these in a new run directory (meshtrain-export "
            f"{checkpoint} DIR --format peft, then model.lora.init_from=peft:DIR),"
        )
    else:
        fresh = (
            f" start fresh from these weights in a new run directory with "
            f"checkpoint.load_params={checkpoint},"
        )
    return (
        f"checkpoint {checkpoint} cannot be continued with this config: "
        f"{'; '.join(map(str, refused))}; put the old value back, start a new run directory "
        f"(hydra.run.dir=...),{fresh} or accept the change on purpose with "
        f"checkpoint.allow_changes=[{keys}]"
    )
