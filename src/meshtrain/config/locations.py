"""The paths a run records, made absolute at its start, so that its directory travels: a run
directory read from another working directory (meshtrain-eval, meshtrain-generate, an export)
finds the tokenizer and the weights its run started from, and a resumed policy-gradient run its
reward functions.

Only paths that exist are rewritten (a name such as `byte`, or a path that a check will refuse,
is left for that check). A Hugging Face id instead of a directory (model.init_from=hf:ORG/NAME,
data.tokenizer=ORG/NAME) becomes its snapshot in the local Hugging Face cache
(config.hub_cache). data.paths is left as typed: a resume compares it by value, and a
checkpoint written before this rule would be refused for the same files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from meshtrain.config.hub_cache import is_hub_id, resolve_hub_id
from meshtrain.config.schema import Config


def _absolute(path: str | None, prefix: str = "", hub_key: str | None = None) -> str | None:
    """`path` (after `prefix`, e.g. hf:) made absolute where it names something that exists;
    with `hub_key` (the config key), a Hugging Face id becomes its cached snapshot."""
    if path is None or not path.startswith(prefix):
        return path
    name = path.removeprefix(prefix)
    if hub_key is not None and is_hub_id(name):
        return f"{prefix}{resolve_hub_id(hub_key, name)}"
    local = Path(name).expanduser()
    return f"{prefix}{local.resolve()}" if local.exists() else path


def with_absolute_paths(cfg: Config) -> Config:
    """`cfg` with data.tokenizer, model.init_from (hf:), model.lora.init_from (peft:),
    checkpoint.load_params and the files of objective.rewards absolute where they name existing
    paths, and the first two's Hugging Face ids resolved to their cached snapshots."""
    lora = dataclasses.replace(
        cfg.model.lora, init_from=_absolute(cfg.model.lora.init_from, "peft:")
    )
    init_from = _absolute(cfg.model.init_from, "hf:", hub_key="model.init_from")
    model = dataclasses.replace(cfg.model, init_from=init_from, lora=lora)
    tokenizer = _absolute(cfg.data.tokenizer, hub_key="data.tokenizer")
    data = dataclasses.replace(cfg.data, tokenizer=tokenizer)
    checkpoint = dataclasses.replace(
        cfg.checkpoint, load_params=_absolute(cfg.checkpoint.load_params)
    )
    objective = dataclasses.replace(
        cfg.objective, rewards=[_absolute_function(spec) for spec in cfg.objective.rewards]
    )
    return dataclasses.replace(
        cfg, model=model, data=data, checkpoint=checkpoint, objective=objective
    )


def _absolute_function(spec: str) -> str:
    """A reward function named "path/to/file.py:function" with the file's path absolute (a
    "module:function" left as it is)."""
    where, colon, name = spec.rpartition(":")
    if not where.endswith(".py"):
        return spec
    return f"{_absolute(where)}{colon}{name}"
