"""A policy-gradient run's start-up (data=prompts): the prompts read and encoded (and the
held-out ones of data.validation_paths, where the run evaluates), the reward functions loaded,
and the one-line checks of the run's shapes against them, before anything compiles."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.config.schema import Config
from meshtrain.data.tokenizer import Tokenizer
from meshtrain.errors import ConfigError, require
from meshtrain.rl.prompts import Prompt, PromptSet, padded_width, read_prompts
from meshtrain.rl.rewards import Rewards


@dataclass(frozen=True)
class RolloutData:
    prompts: PromptSet
    rewards: Rewards
    tokenizer: Tokenizer  # data.tokenizer: it encoded the prompts and decodes the completions
    validation: list[Prompt]  # data.validation_paths' (with training.eval_every > 0), or none
    width: int  # every prompt, training and validation, is padded to it (one program)


def rollout_data(cfg: Config, global_batch: int) -> RolloutData:
    """The prompts and reward functions of `cfg`, whose steps take `global_batch` rows (one
    completion each). Raises ConfigError, or a data module's ValueError (a missing file, an
    unreadable tokenizer) that train.setup turns into one."""
    objective, data = cfg.objective, cfg.data
    group = objective.num_generations
    require(
        global_batch % group == 0,
        f"training.global_batch_size={global_batch} completions are not whole groups of "
        f"objective.num_generations={group}; use a multiple of {group}",
    )
    require(
        cfg.training.epochs is None,
        f"training.epochs={cfg.training.epochs} counts passes over documents; with data=prompts "
        "set training.steps (each step samples from training.global_batch_size / "
        "objective.num_generations prompts)",
    )
    rewards = Rewards(objective.rewards, objective.reward_weights, objective)
    reading = {
        "tokenizer": data.tokenizer,
        "chat_template": data.chat_template,
        "prompt_key": data.prompt_key,
        "on_bad_record": data.on_bad_record,
    }
    prompts, tokenizer = read_prompts(list(data.paths), **reading)
    validation = []
    if cfg.training.eval_every > 0 and data.validation_paths:
        validation, _ = read_prompts(
            list(data.validation_paths), key="data.validation_paths", **reading
        )
    if "exact_match" in objective.rewards:
        _check_answer_column(objective.answer_column, prompts + validation)
    prompt_set = PromptSet(prompts, per_step=global_batch // group, seed=cfg.training.seed)
    longest = max(p.ids.size for p in prompts + validation)
    needed = longest + objective.max_new_tokens
    require(
        data.seq_len + 1 >= needed,
        f"data.seq_len={data.seq_len}: a row holds a prompt and its completion, and the longest "
        f"prompt has {longest} tokens; with objective.max_new_tokens="
        f"{objective.max_new_tokens} set data.seq_len={needed - 1} or more (or lower "
        "objective.max_new_tokens)",
    )
    return RolloutData(
        prompt_set, rewards, tokenizer, validation, padded_width(prompts, validation)
    )


def _check_answer_column(column: str, prompts: list[Prompt]) -> None:
    """exact_match reads each record's answer: one line if a record lacks the column."""
    lacking = [p for p in prompts if column not in p.columns]
    if lacking:
        has = ", ".join(sorted(lacking[0].columns)) or "none besides the prompt"
        raise ConfigError(
            f"objective.answer_column={column!r}: {len(lacking)} of {len(prompts)} records of "
            f"data.paths have no such column (a record's columns: {has}); set "
            "objective.answer_column to the column exact_match compares with"
        )
