"""The paths a run records, made absolute at its start, so that its directory travels: a run
directory read from another working directory (meshtrain-eval, meshtrain-generate, an export)
finds the tokenizer and the weights its run started from.

Only paths that exist are rewritten (a name such as `byte`, or a path that a check will refuse,
is left for that check). data.paths is left as typed: a resume compares it by value, and a
checkpoint written before this rule would be refused for the same files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from meshtrain.config.schema import Config


def _absolute(path: str | None, prefix: str = "") -> str | None:
    """`path` (after `prefix`, e.g. hf:) made absolute where it names something that exists."""
    if path is None or not path.startswith(prefix):
        return path
    local = Path(path.removeprefix(prefix)).expanduser()
    return f"{prefix}{local.resolve()}" if local.exists() else path


def with_absolute_paths(cfg: Config) -> Config:
    """`cfg` with data.tokenizer, model.init_from (hf:), model.lora.init_from (peft:) and
    checkpoint.load_params absolute where they name existing paths."""
    lora = dataclasses.replace(
        cfg.model.lora, init_from=_absolute(cfg.model.lora.init_from, "peft:")
    )
    model = dataclasses.replace(
        cfg.model, init_from=_absolute(cfg.model.init_from, "hf:"), lora=lora
    )
    data = dataclasses.replace(cfg.data, tokenizer=_absolute(cfg.data.tokenizer))
    checkpoint = dataclasses.replace(
        cfg.checkpoint, load_params=_absolute(cfg.checkpoint.load_params)
    )
    return dataclasses.replace(cfg, model=model, data=data, checkpoint=checkpoint)
