"""`MeshtrainLM`: lm-eval's model interface (its `TemplateLM`) backed by a meshtrain model,
registered as lm-eval's model "meshtrain" when this module is imported.

- loglikelihood: (context, continuation) → (log P(continuation | context), whether every
  continuation token is the model's most likely one). The requests are tokenized as lm-eval's
  `hf` model tokenizes them (context and continuation encoded together, trailing spaces of the
  context moved to the continuation, an empty context replaced by bos), cut to the last
  max_length + 1 tokens, packed into fixed-shape batches (harness.packing) and scored together.
- loglikelihood_rolling: a text's whole log-likelihood, from disjoint windows of max_length
  tokens, each scored as a loglikelihood request (as the hf model does).
- generate_until: the prompts continued with the key/value cache (models.decode), greedy unless
  the task samples, generate_batch rows at a time (those with the same generation kwargs), each
  until one of the task's stop strings, eos or max_gen_toks tokens; the text is cut before the
  first stop string.

Build it from model_args (`lm_eval` / `python -m meshtrain.harness --model meshtrain
--model_args checkpoint=DIR,...`, keys in harness.options) or around a loaded model:
`MeshtrainLM.from_model(model, tokenizer, max_length=...)` (harness.run.evaluate_in_place).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from meshtrain.checkpoint.layout import find_checkpoints
from meshtrain.data.chat.template import ChatTemplate, load_chat_template
from meshtrain.data.tokenizer import Tokenizer, build_tokenizer
from meshtrain.errors import ConfigError, DataError
from meshtrain.harness.engine import Engine, Generation
from meshtrain.harness.options import ModelArgs, parse_model_args
from meshtrain.harness.packing import pack
from meshtrain.models.transformer import Transformer
from meshtrain.weights.load import checkpoint_config, load_model, load_tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 2048  # lm-eval's, for a model whose config names none


def model_max_length(path: str | Path) -> int:
    """The max_seq_len of the model at `path`: a meshtrain checkpoint's run config, a
    safetensors export's config.json, or a Hugging Face config.json's max_position_embeddings
    (its text_config's for a multimodal one); DEFAULT_MAX_LENGTH if none says."""
    directory = Path(path).expanduser()
    if find_checkpoints(directory):
        return int(checkpoint_config(directory)["model"]["max_seq_len"])
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_MAX_LENGTH
    if isinstance(config.get("model"), dict):  # meshtrain.export --format safetensors
        return int(config["model"].get("max_seq_len", DEFAULT_MAX_LENGTH))
    text = config.get("text_config") or config
    return int(text.get("max_position_embeddings") or DEFAULT_MAX_LENGTH)


def _hugging_face(directory: Path) -> bool:
    """Whether `directory` is a Hugging Face checkpoint (its config.json names no meshtrain
    model), not a meshtrain checkpoint or safetensors export, which were trained with bos."""
    if find_checkpoints(directory):
        return False
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return not isinstance(config.get("model"), dict)


@register_model("meshtrain")
class MeshtrainLM(TemplateLM):
    """lm-eval's model interface over a meshtrain model; see the module's docstring."""

    def __init__(self, **model_args: Any):
        options = parse_model_args(model_args)
        directory = Path(options.checkpoint).expanduser()
        if not directory.is_dir():
            raise ConfigError(
                f"model_args checkpoint={options.checkpoint!r} is not a directory; pass a "
                "meshtrain checkpoint (or its run directory), an export or a Hugging Face "
                "checkpoint directory"
            )
        tokenizer = _tokenizer(options.tokenizer, directory)
        dtype = jnp.bfloat16 if options.dtype == "bfloat16" else jnp.float32
        model = load_model(directory, options.mesh_shape, dtype=dtype)
        if options.max_length is None:
            options = dataclasses.replace(options, max_length=model_max_length(directory))
        if options.add_bos_token is None and _hugging_face(directory):
            adds_bos = getattr(tokenizer, "adds_bos", None)  # a tokenizer.json's rule
            if adds_bos is not None:
                options = dataclasses.replace(options, add_bos_token=adds_bos())
                log.info(
                    "evaluation: requests %s bos, as the tokenizer's own rule says (lm-eval's "
                    "hf model follows it too); model_args add_bos_token=true|false decides",
                    "start with" if options.add_bos_token else "do not start with",
                )
        self._start(model, tokenizer, options)

    @classmethod
    def from_model(cls, model: Transformer, tokenizer: Tokenizer, **options: Any) -> MeshtrainLM:
        """The harness's model around `model` as it is (its arrays, on its mesh: nothing is
        copied); `options` are ModelArgs' fields but checkpoint, tokenizer and mesh_shape."""
        loaded = sorted({"checkpoint", "tokenizer", "mesh_shape"} & set(options))
        if loaded:
            raise TypeError(f"from_model takes a loaded model and tokenizer, not {loaded[0]}")
        options = parse_model_args(options, require_checkpoint=False)
        lm = cls.__new__(cls)
        lm._start(model, tokenizer, options)
        return lm

    def _start(self, model: Transformer, tokenizer: Tokenizer, options: ModelArgs) -> None:
        super().__init__()
        if tokenizer.vocab_size > model.embed.shape[0]:
            raise ConfigError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                f"{model.embed.shape[0]} embeddings; pass the checkpoint's own tokenizer"
            )
        self.engine = Engine(
            model,
            tokenizer,
            batch_tokens=options.batch_tokens,
            generate_batch=options.generate_batch,
        )
        self.progress = True  # progress bars on stderr (evaluate_in_place: off)
        self.meshtrain_tokenizer = tokenizer
        self.options = options
        self._max_length = options.max_length or DEFAULT_MAX_LENGTH
        self._template: ChatTemplate | None = None  # loaded when a task asks for it
        has_bos = tokenizer.bos_id >= 0
        self.add_bos_token = has_bos if options.add_bos_token is None else options.add_bos_token
        if self.add_bos_token and not has_bos:
            raise ConfigError("model_args add_bos_token=true, but the tokenizer has no bos token")

    # What lm-eval asks of a model.

    @property
    def eot_token_id(self) -> int:
        return self.meshtrain_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The context of a continuation scored from nothing: bos, else eos (as the hf model)."""
        bos = self.meshtrain_tokenizer.bos_id
        return bos if bos >= 0 else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self.options.max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        files = getattr(self.meshtrain_tokenizer, "source_files", ())
        return str(files[0]) if files else "byte"

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """The ids of `string`, after bos when add_special_tokens (None: add_bos_token, unless
        the text starts with the bos token itself, as the hf model decides)."""
        ids = self.meshtrain_tokenizer.encode(string).tolist()
        bos = self.meshtrain_tokenizer.bos_id
        add = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and ids[:1] == [bos]:
            add = False
        return [bos, *ids] if add and bos >= 0 else ids

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The Jinja source of the tokenizer's chat template (what lm-eval records); None when
        not asked for (lm-eval's --apply_chat_template off)."""
        return self._chat_template().text if chat_template else None

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of `chat_history` as lm-eval's hf model renders it: the chat
        template with the assistant's turn opened (add_generation_prompt), or the last
        (assistant) message continued; a template that refuses a system turn is rendered
        without it, as the hf model retries."""
        template = self._chat_template()
        options = dict(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )
        try:
            return template.render(chat_history, **options)
        except DataError:
            without_system = [m for m in chat_history if m["role"] != "system"]
            if len(without_system) == len(chat_history):
                raise
            log.warning("the chat template refused this chat; rendering it without the system role")
            return template.render(without_system, **options)

    def _chat_template(self) -> ChatTemplate:
        if self._template is None:
            files = getattr(self.meshtrain_tokenizer, "source_files", ())
            if not files:
                raise ConfigError(
                    "--apply-chat-template: the byte tokenizer has no chat template; evaluate "
                    "a checkpoint whose tokenizer has one, or leave the flag out"
                )
            try:
                self._template = load_chat_template(str(files[0]))
            except DataError as err:
                raise ConfigError(f"--apply-chat-template: {err}") from None
        return self._template

    def tok_decode(self, ids: list[int]) -> str:
        return self.meshtrain_tokenizer.decode(ids)

    def get_model_info(self) -> dict[str, Any]:
        """What the results' config records about the model."""
        return {"model_dtype": self.options.dtype, "max_length": self.max_length}

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **_
    ) -> list[tuple[float, bool]]:
        """(log-probability, is greedy) of each (key, context ids, continuation ids)."""
        inputs, targets, scored = [], [], []
        for _, context, continuation in requests:
            if not 0 < len(continuation) <= self.max_length:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens: 1 to max_length "
                    f"({self.max_length}) can be scored"
                )
            whole = (context + continuation)[-(self.max_length + 1) :]
            inputs.append(whole[:-1])
            targets.append(whole[1:])
            scored.append(len(continuation))
        batches = pack(
            inputs,
            targets,
            max_length=self.max_length,
            batch_tokens=self.engine.batch_tokens,
            row_multiple=self.engine.row_multiple,
        )
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        progress = tqdm(
            total=len(requests), disable=disable_tqdm or not self.progress, desc="loglikelihood"
        )
        for batch in batches:
            logprob, greedy = self.engine.score(batch)  # [rows, length] each
            for index, place in zip(batch.members, batch.placements, strict=True):
                end = place.start + place.size
                span = slice(end - scored[index], end)  # the continuation's positions
                answer = (
                    float(logprob[place.row, span].sum(dtype=np.float64)),
                    bool(greedy[place.row, span].all()),
                )
                results[index] = answer
                if requests[index][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[index][0], answer)
            progress.update(len(batch.members))
        progress.close()
        return results

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """TemplateLM's (tokenize, then _loglikelihood_tokens), its bars shown if `progress`."""
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood, summed over windows of at most max_length tokens."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            token_windows = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(make_disjoint_window, token_windows):
                windows.append((None, context, continuation))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = np.zeros(len(requests), np.float64)
        np.add.at(totals, np.asarray(owners, np.int64), [s for s, _ in scores])
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, float(total))
        return totals.tolist()

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Each (context, generation kwargs)'s continuation, cut before its first stop string.
        Requests with the same generation kwargs are continued together, generate_batch at a
        time, longest prompts first (as lm-eval's hf model batches them)."""
        groups: dict[Generation, list[tuple[int, tuple[int, ...]]]] = {}
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
            max_new_tokens = kwargs.pop("max_gen_toks")
            if max_new_tokens >= self.max_length:
                raise ValueError(
                    f"max_gen_toks={max_new_tokens} leaves no room for the prompt in "
                    f"max_length={self.max_length} tokens"
                )
            sampled = kwargs.get("do_sample") and kwargs.get("temperature", 0.0) > 0
            ids = self.tok_encode(context)[-(self.max_length - max_new_tokens) :]
            kind = Generation(
                ids=(),
                until=tuple(until),
                max_new_tokens=max_new_tokens,
                temperature=float(kwargs["temperature"]) if sampled else 0.0,
                seed=int(kwargs.get("seed", 0) or 0),
            )
            groups.setdefault(kind, []).append((index, tuple(ids)))
        outputs: list[str] = [""] * len(requests)
        size = self.engine.generate_rows
        quiet = disable_tqdm or not self.progress
        with tqdm(total=len(requests), disable=quiet, desc="generate_until") as bar:
            for kind, members in groups.items():
                members.sort(key=lambda member: -len(member[1]))
                for start in range(0, len(members), size):
                    batch = members[start : start + size]
                    news = self.engine.generate(
                        [dataclasses.replace(kind, ids=ids) for _, ids in batch]
                    )
                    for (index, _), new in zip(batch, news, strict=True):
                        text = postprocess_generated_text(self.tok_decode(new), kind.until, None)
                        self.cache_hook.add_partial("generate_until", requests[index].args, text)
                        outputs[index] = text
                    bar.update(len(batch))
        return outputs


def _tokenizer(name: str | None, directory: Path) -> Tokenizer:
    """The tokenizer model_args names, else the checkpoint's (weights.load.load_tokenizer)."""
    if name is None:
        return load_tokenizer(directory, option="--model_args tokenizer=")
    try:
        return build_tokenizer(name)
    except ValueError as err:
        raise ConfigError(str(err).replace("data.tokenizer", "model_args tokenizer")) from None
