"""model.lora: low-rank adapters on a frozen base (LoRA, https://arxiv.org/abs/2106.09685), and
QLoRA's quantised base (https://arxiv.org/abs/2305.14314). The schema of the keys and their
start-up checks, each failure one line naming the key, the value and the fix. The adapters
themselves are meshtrain.models.lora; the frozen base's storage is meshtrain.models.frozen.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

from meshtrain.errors import ConfigError, did_you_mean, require
from meshtrain.families import family
from meshtrain.families.vocabulary import PROJECTION_NAMES

if TYPE_CHECKING:
    from meshtrain.config.schema import ModelConfig

BaseDtype = Literal["compute", "bf16", "int8", "nf4"]
"""model.lora.base_dtype: how the frozen base is stored (int8 and nf4: QLoRA)."""
QUANTIZED: tuple[str, ...] = ("int8", "nf4")


@dataclass
class LoraConfig:
    """model.lora (docs/finetuning.md#lora-and-qlora)."""

    rank: int = 0
    """Rank r of the adapters A [in, r] and B [r, out] beside each target projection; 0: no LoRA, every parameter trains."""
    alpha: float = 16.0
    """An adapter adds alpha / rank · x·A·B to its projection's output (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on an adapter's input during training (PEFT's lora_dropout); 0: none."""
    targets: Any = field(default_factory=lambda: list(PROJECTION_NAMES))  # list[str] | str
    """Projections that get adapters: a list of names among q, k, v, o, gate, up, down or regular expressions over them (e.g. [q,v]), or one such pattern (e.g. 'q|v')."""
    base_dtype: str = "compute"  # BaseDtype
    """Storage of the frozen base: compute (training.mixed_precision's dtype), bf16, or QLoRA's int8 / nf4 (block-quantised projections, dequantised per layer in the step)."""
    quant_block: int = 64
    """int8 / nf4: weights per quantisation block, along each projection's input axis (the head axis for o)."""
    init_from: str | None = None
    """peft:/path/to/adapter: start the adapters from a PEFT adapter directory (adapter_config.json + adapter_model.safetensors); null: A random, B zero."""


def lora_enabled(model: ModelConfig) -> bool:
    return model.lora.rank > 0


def target_projections(model: ModelConfig) -> tuple[str, ...]:
    """The projections model.lora.targets (names or patterns, or one pattern) select among the
    family's (families.vocabulary), in block order; ConfigError for an entry that selects none."""
    targets = model.lora.targets
    adaptable = [p for p in family(model.family).projections if p.lora_target]
    projections = [p.name for p in adaptable]
    peft_names = {p.peft_name: p.name for p in adaptable}
    selected: set[str] = set()
    for entry in [targets] if isinstance(targets, str) else targets:
        entry = str(entry).strip()
        if entry in projections:
            selected.add(entry)
            continue
        if entry in peft_names:  # PEFT's names (q_proj, ...) are accepted too
            selected.add(peft_names[entry])
            continue
        try:
            matched = {name for name in projections if re.fullmatch(entry, name)}
        except re.error:
            matched = set()
        if not matched:
            raise ConfigError(
                f"model.lora.targets entry '{entry}' names no projection"
                f"{did_you_mean(entry, [*projections, *peft_names])}; use names among "
                f"{', '.join(projections)} or a pattern over them (e.g. 'q|v')"
            )
        selected |= matched
    return tuple(name for name in projections if name in selected)


def check_lora(model: ModelConfig) -> None:
    """The model.lora keys on their own (their fit to the model's shapes is checked with the
    abstract model: meshtrain.models.frozen.check_quant_blocks)."""
    lora = model.lora
    if lora.rank == 0:
        changed = [
            f"model.lora.{key}"
            for key, default in LORA_DEFAULTS.items()
            if getattr(lora, key) != default
        ]
        require(
            not changed,
            f"{', '.join(changed)} set but model.lora.rank=0 (LoRA off); set model.lora.rank "
            "(e.g. 16) to train adapters, or drop those keys",
        )
        return
    require(
        lora.rank > 0,
        f"model.lora.rank={lora.rank} must be positive (e.g. 16), or 0 for no LoRA",
    )
    require(lora.alpha > 0, f"model.lora.alpha={lora.alpha} must be positive (e.g. 2 × rank = 32)")
    require(
        0.0 <= lora.dropout < 1.0, f"model.lora.dropout={lora.dropout} must be in [0, 1), e.g. 0.05"
    )
    options = get_args(BaseDtype)
    require(
        lora.base_dtype in options,
        f"model.lora.base_dtype={lora.base_dtype!r} is not one of {', '.join(options)}"
        f"{did_you_mean(str(lora.base_dtype), options)}",
    )
    require(
        lora.quant_block >= 2,
        f"model.lora.quant_block={lora.quant_block} must be at least 2 (e.g. 64)",
    )
    require(
        lora.quant_block == LORA_DEFAULTS["quant_block"] or lora.base_dtype in ("int8", "nf4"),
        f"model.lora.quant_block={lora.quant_block} set but model.lora.base_dtype="
        f"{lora.base_dtype} quantises nothing; set model.lora.base_dtype=nf4 (or int8), or drop "
        "model.lora.quant_block",
    )
    require(bool(lora.targets), "model.lora.targets is empty; name projections, e.g. [q,v]")
    widths = {p.name: p.widths(model) for p in family(model.family).projections}
    smallest = min(target_projections(model), key=lambda name: min(widths[name]))
    limit = min(widths[smallest])
    require(
        lora.rank <= limit,
        f"model.lora.rank={lora.rank} exceeds projection {smallest}'s smaller side ({limit}), "
        f"where an adapter of rank {limit} already spans every update; set model.lora.rank "
        f"<= {limit} (e.g. 16)",
    )
    if lora.init_from is not None:
        require(
            str(lora.init_from).startswith("peft:") and len(str(lora.init_from)) > 5,
            f"model.lora.init_from={lora.init_from!r} must be peft:/path/to/adapter_dir",
        )


LORA_DEFAULTS = {
    key: getattr(LoraConfig(), key)
    for key in ("alpha", "dropout", "targets", "base_dtype", "quant_block", "init_from")
}
