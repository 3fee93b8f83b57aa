"""The model_args of lm-eval's `--model meshtrain` (and of `meshtrain-eval --model-args`): their
names, defaults and checks, each bad one reported in one line that names the key. lm-eval is not
imported here, so the command checks its arguments before anything heavy loads."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshtrain.errors import ConfigError, did_you_mean

DTYPES = ("float32", "bfloat16")
# lm-eval passes these to every model it builds from a name (its --batch_size, --max_batch_size,
# --device): meshtrain sizes its batches by batch_tokens and generate_batch and runs on the
# model's mesh instead.
HARNESS_ARGS = ("batch_size", "max_batch_size", "device")


@dataclass(frozen=True)
class ModelArgs:
    """What `--model meshtrain` is given as model_args=key=value,..."""

    checkpoint: str | None = None
    """a meshtrain checkpoint (step, checkpoints/ or run directory), an export, or a Hugging
    Face checkpoint directory: what `meshtrain.load_model` reads"""
    tokenizer: str | None = None
    """byte, a tokenizer.json, a .model, or a directory holding one (default: the one the
    checkpoint trained with or carries)"""
    mesh_shape: Any = None
    """the mesh to shard the model over: [[4,2],["fsdp","tp"]] (a list, or JSON) or, without
    commas, fsdp:4/tp:2 (default: one device)"""
    dtype: str = "float32"
    """the parameters' and computations' dtype: float32 or bfloat16"""
    max_length: int | None = None
    """the most tokens a request's input holds (longer ones lose their start, as in lm-eval's
    hf model); default: the model's max_seq_len (max_position_embeddings)"""
    batch_tokens: int = 4096
    """tokens per scoring batch: rows × row length, the rows a multiple of the devices the batch
    is split over"""
    add_bos_token: bool | None = None
    """start every request with the tokenizer's bos token; default: for a Hugging Face
    checkpoint, as its tokenizer.json's own rule says (as lm-eval's hf model); for a meshtrain
    checkpoint or export, yes if the tokenizer has one (as meshtrain trains: bos + document +
    eos)"""
    generate_batch: int = 16
    """prompts generate_until continues together (requests with the same generation kwargs),
    rounded up to a multiple of the devices the batch is split over"""
    max_gen_toks: int = 256
    """generate_until's token limit when a task sets none (lm-eval's default)"""


KEYS = tuple(field.name for field in dataclasses.fields(ModelArgs))


def _int(key: str, value: Any, minimum: int) -> int:
    try:
        number = int(str(value))  # 12 or "12"; not 1.5, "1.5" or True
    except ValueError:
        number = None
    if isinstance(value, bool) or number is None or number < minimum:
        raise ConfigError(f"model_args {key}={value!r} must be an integer >= {minimum}")
    return number


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text not in ("true", "false", "1", "0"):
        raise ConfigError(f"model_args {key}={value!r} must be true or false")
    return text in ("true", "1")


def parse_mesh_shape(value: Any) -> Any:
    """A mesh_shape model arg as load_model takes it: a list as given, JSON, or the comma-free
    form fsdp:4/tp:2 (→ [[4, 2], ["fsdp", "tp"]])."""
    if value is None or isinstance(value, list):
        return value
    text = str(value).strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    else:
        try:
            pairs = [part.split(":") for part in text.split("/")]
            return [[int(size) for _, size in pairs], [name for name, _ in pairs]]
        except ValueError:
            pass
    raise ConfigError(
        f'model_args mesh_shape={value!r} is neither JSON like [[4,2],["fsdp","tp"]] nor '
        "AXIS:SIZE/AXIS:SIZE like fsdp:4/tp:2"
    )


def parse_model_args(args: Mapping[str, Any], *, require_checkpoint: bool = True) -> ModelArgs:
    """ModelArgs from lm-eval's model_args (strings, or values lm-eval already converted);
    ConfigError naming the first unknown key, or the key of a bad value."""
    unknown = sorted(set(args) - set(KEYS) - set(HARNESS_ARGS))
    if unknown:
        raise ConfigError(
            f"model_args key {unknown[0]!r} does not exist{did_you_mean(unknown[0], KEYS)}; "
            f"the keys are {', '.join(KEYS)}"
        )
    given = {k: v for k, v in args.items() if k in KEYS and v is not None}
    if require_checkpoint and not given.get("checkpoint"):
        raise ConfigError("model_args needs checkpoint=DIRECTORY (a meshtrain or Hugging Face one)")
    for key in ("checkpoint", "tokenizer"):
        if key in given:
            given[key] = str(given[key])
    if given.get("dtype", "float32") not in DTYPES:
        raise ConfigError(f"model_args dtype={given['dtype']!r} must be one of {', '.join(DTYPES)}")
    for key, minimum in (
        ("max_length", 2),
        ("batch_tokens", 1),
        ("generate_batch", 1),
        ("max_gen_toks", 1),
    ):
        if key in given:
            given[key] = _int(key, given[key], minimum)
    if "add_bos_token" in given:
        given["add_bos_token"] = _bool("add_bos_token", given["add_bos_token"])
    given["mesh_shape"] = parse_mesh_shape(given.get("mesh_shape"))
    return ModelArgs(**given)


def split_model_args(text: str) -> dict[str, str]:
    """`key=value,key=value` (lm-eval's --model_args form) → {key: value}; ConfigError on an
    item without `=`."""
    args = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--model-args item {item!r} is not key=value")
        args[key.strip()] = value.strip()
    return args
