"""LoRA adapters in PEFT's format, out (`export_peft`) and in (`model.lora.init_from=peft:DIR`).

A PEFT LoRA adapter directory holds adapter_config.json and adapter_model.safetensors, whose
tensors are named after the base model's modules, e.g.
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`, with lora_A [r, in] and
lora_B [out, r] (torch's Linear layout, heads flattened). Ours are A [*in, r] and B [r, *out]:

    q, k, v      A = lora_A.T            B = lora_B [N*H, r] → [r, N, H]
    o            A = lora_A [r, N*H] → [N, H, r]            B = lora_B.T
    gate, up, down   A = lora_A.T        B = lora_B.T

`peft.PeftModel.from_pretrained(base, DIR)` on the Hugging Face base gives the logits meshtrain
gives with the adapters (tests/hf/test_peft_live.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import jax

from meshtrain.config.lora import target_projections
from meshtrain.config.schema import ModelConfig
from meshtrain.errors import ConfigError
from meshtrain.families import family
from meshtrain.families.layouts import Layout
from meshtrain.hf.load import read_params, unstacked_shapes
from meshtrain.hf.safetensors_io import CheckpointReader, write_safetensors
from meshtrain.hf.save import gather, locate
from meshtrain.hf.tensor_map import ParamPath

log = logging.getLogger(__name__)

PEFT_SCHEME = "peft:"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# adapter_config.json settings that make an adapter differ per layer or train whole modules:
# an adapter that sets one is refused rather than loaded as another adapter.
UNSUPPORTED_SETTINGS = (
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "modules_to_save",
)
PREFIX = "base_model.model.model.layers"


def peft_tensors(cfg: ModelConfig) -> dict[ParamPath, tuple[str, Layout]]:
    """Our adapter path (unstacked: blocks/i/attn/q_lora_a) → (PEFT tensor name, layout), as
    the family's vocabulary names each projection and lays out its adapter."""
    projection = family(cfg.family).projection
    tensors = {}
    experts = [name for name in target_projections(cfg) if projection[name].leading]
    if experts:
        raise ConfigError(
            f"model.lora.targets {','.join(experts)} puts adapters on every expert, which "
            "meshtrain cannot write or read as a PEFT adapter; export with --merge (the base with "
            "the adapters folded in), or target the attention only (model.lora.targets=[q,k,v,o])"
        )
    for i in range(cfg.num_layers):
        for name in target_projections(cfg):
            target = projection[name]
            base = f"{PREFIX}.{i}.{target.hf_module}"
            layout_a, layout_b = target.adapter_layouts
            module = target.module
            tensors[("blocks", i, module, f"{name}_lora_a")] = (f"{base}.lora_A.weight", layout_a)
            tensors[("blocks", i, module, f"{name}_lora_b")] = (f"{base}.lora_B.weight", layout_b)
    return tensors


def _peft_names(cfg: ModelConfig) -> dict[str, str]:
    """PEFT's target_modules name of each of the family's projections, by our name."""
    return {p.name: p.peft_name for p in family(cfg.family).projections}


def adapter_config(cfg: ModelConfig, base_model: str | None) -> dict[str, Any]:
    """adapter_config.json of `cfg`'s adapters."""
    lora = cfg.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": [_peft_names(cfg)[n] for n in target_projections(cfg)],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
    }


def quantised_base_note(cfg: ModelConfig) -> str | None:
    """What a PEFT export of adapters trained on a quantised base (QLoRA) must say: they fit the
    base as the run dequantised it, not the full-precision base peft loads them on by default.
    None for adapters trained on an unquantised base."""
    stored = cfg.lora.base_dtype
    if stored not in ("int8", "nf4"):
        return None
    return (
        f"these adapters were trained on the base quantised to {stored} (blocks of "
        f"{cfg.lora.quant_block}): on the full-precision base, as peft loads them by default, "
        "the model computes other logits; for meshtrain's numbers export with --merge (the base "
        "dequantised as the run computed it, plus the adapters), or load the base quantised the "
        "same way"
    )


def export_peft(
    params: Any, cfg: ModelConfig, out_dir: str | os.PathLike, base_model: str | None = None
) -> Path:
    """Writes the adapters in `params` (a LoRA run's parameters, adapters only or with the
    base) as a PEFT adapter directory `out_dir` (new), in fp32; `base_model` is recorded as
    base_model_name_or_path. Written under a temporary name and renamed when complete."""
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists; export into a new directory")
    tensors = list(peft_tensors(cfg).items())

    def array_of(path: ParamPath) -> Any:
        array, layer = locate(params, path, cfg.scan_layers)
        return array if layer is None else array[layer]

    shapes = [layout.hf_shape(array_of(path).shape) for path, (_, layout) in tensors]
    by_name = {name: (path, layout) for path, (name, layout) in tensors}

    def produce(name: str) -> Any:
        path, layout = by_name[name]
        return layout.to_hf(gather(array_of(path)))

    entries = [(name, shape) for (_, (name, _)), shape in zip(tensors, shapes, strict=True)]
    if jax.process_index() != 0:
        for name, _ in entries:  # take part in the gathers of a multi-process export
            produce(name)
        return out
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write_safetensors(partial / WEIGHTS_FILE, entries, "float32", produce)
    config = adapter_config(cfg, base_model)
    (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    if note := quantised_base_note(cfg):
        log.warning(note)
        (partial / "README.md").write_text(f"# LoRA adapters exported by meshtrain\n\n{note}\n")
    if out.exists():
        out.rmdir()
    partial.rename(out)
    return out


def peft_dir(init_from: str) -> Path:
    """The directory model.lora.init_from=peft:DIR names, checked to be an adapter."""
    path = Path(init_from.removeprefix(PEFT_SCHEME)).expanduser()
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise ConfigError(
            f"model.lora.init_from={init_from!r}: {path} holds no {CONFIG_FILE} and "
            f"{WEIGHTS_FILE}; point it at a PEFT adapter directory (save_pretrained of a "
            "PeftModel, or meshtrain-export --format peft)"
        )
    return path


def check_peft(cfg: ModelConfig) -> None:
    """ConfigError (one line) unless model.lora.init_from is a LoRA adapter of `cfg`'s rank,
    alpha and targets, with a tensor of the right shape for every adapter."""
    key = f"model.lora.init_from={cfg.lora.init_from!r}"
    directory = peft_dir(cfg.lora.init_from)
    saved = json.loads((directory / CONFIG_FILE).read_text())
    if saved.get("peft_type") != "LORA" or saved.get("use_dora") or saved.get("use_rslora"):
        raise ConfigError(
            f"{key}: a {saved.get('peft_type')} adapter"
            f"{' with DoRA' if saved.get('use_dora') else ''}"
            f"{' with rsLoRA' if saved.get('use_rslora') else ''}; only plain LoRA adapters load"
        )
    for setting in UNSUPPORTED_SETTINGS:
        if saved.get(setting) not in (None, {}, []):
            raise ConfigError(
                f"{key}: its adapter_config.json sets {setting}={json.dumps(saved[setting])}, "
                "which meshtrain's adapters cannot follow (the same rank, alpha and targets on "
                f"every layer, no fully trained modules); merge the adapter into its base with "
                "peft (merge_and_unload) and start from that with model.init_from=hf:DIR"
            )
    targets = saved.get("target_modules") or []
    targets = sorted([targets] if isinstance(targets, str) else targets)
    peft_names = _peft_names(cfg)
    expected = sorted(peft_names[n] for n in target_projections(cfg))
    for name, value, want in (
        ("rank", saved.get("r"), cfg.lora.rank),
        ("alpha", saved.get("lora_alpha"), cfg.lora.alpha),
        ("targets", targets, expected),
    ):
        if value != want and not (name == "alpha" and float(value) == float(want)):
            shown = (
                [n for n, peft in peft_names.items() if peft in value]
                if name == "targets"
                else value
            )
            raise ConfigError(
                f"{key}: the adapter has {name} {shown} but model.lora.{name} is {_shown(name, cfg)}; "
                f"set model.lora.{name}={_value(name, shown)}"
            )
    reader = CheckpointReader(directory)
    shapes = unstacked_shapes(cfg)
    read = {name for name, _ in peft_tensors(cfg).values()}
    if extra := sorted(reader.names() - read):
        raise ConfigError(
            f"{key}: {WEIGHTS_FILE} holds {len(extra)} tensor(s) no adapter of this config reads "
            f"(e.g. {extra[0]}); it was saved with other targets or settings"
        )
    for path, (name, layout) in peft_tensors(cfg).items():
        want = layout.hf_shape(shapes[path])
        if name not in reader.names() or reader.shape(name) != want:
            found = reader.shape(name) if name in reader.names() else "no such tensor"
            raise ConfigError(
                f"{key}: {name} is {found}, the model ({cfg.name}) needs {list(want)}; "
                "the adapter was trained on another architecture or size"
            )


def _shown(name: str, cfg: ModelConfig) -> Any:
    return list(target_projections(cfg)) if name == "targets" else getattr(cfg.lora, name)


def _value(name: str, value: Any) -> str:
    return f"[{','.join(value)}]" if name == "targets" else f"{value:g}"


def load_peft(cfg: ModelConfig, abstract_adapters: Any, shardings: Any) -> Any:
    """The adapters of model.lora.init_from (checked by check_peft), in `shardings`."""
    reader = CheckpointReader(peft_dir(cfg.lora.init_from))
    return read_params(reader, peft_tensors(cfg), cfg, abstract_adapters, shardings)
