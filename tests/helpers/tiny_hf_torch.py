"""The tiny checkpoints of helpers.tiny_hf in transformers (PyTorch, CPU): for the slow live
comparisons and for tests/fixtures/hf/make_fixtures.py. Needs the `parity` extra."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from helpers import tiny_hf
from helpers.tiny_tokenizers import train_bpe
from meshtrain.data import build_tokenizer


def load(directory: Path) -> PreTrainedModel:
    """transformers' model of a checkpoint directory, eager attention, fp32, eval mode."""
    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


def logits(model: PreTrainedModel, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def loss_and_grad_norm(model: PreTrainedModel, batch: np.ndarray) -> tuple[float, float]:
    """transformers' loss and gradient norm on `batch` [B, T + 1] (it shifts the labels)."""
    tokens = torch.as_tensor(batch, dtype=torch.long)
    model.zero_grad()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    grad_norm = math.sqrt(sum(float((p.grad**2).sum()) for p in model.parameters()))
    model.zero_grad()
    return loss.item(), grad_norm


def reference(family: str, directory: Path) -> dict[str, np.ndarray]:
    """What tiny_hf.reference holds, computed now by transformers from the checkpoint in
    `directory` (tiny_hf.write_checkpoint)."""
    model = load(directory)
    numbers = {"logits": logits(model, tiny_hf.TOKENS)}
    if family == "gemma3":
        numbers["logits_reversed"] = logits(model, tiny_hf.TOKENS[:, ::-1].copy())
    cfg = tiny_hf.run_config(
        family,
        directory,
        *tiny_hf.STEP_ONE,
        f"training.micro_batch_size={tiny_hf.STEP_ONE_BATCH}",
    )
    loss, grad_norm = loss_and_grad_norm(model, tiny_hf.step_one_batch(cfg))
    numbers["loss"], numbers["grad_norm"] = np.float64(loss), np.float64(grad_norm)
    if family == "llama":
        numbers["prompt_ids"], numbers["greedy_ids"] = greedy(model)
    return numbers


def greedy(model: PreTrainedModel) -> tuple[np.ndarray, np.ndarray]:
    """([bos] + tiny_hf.PROMPT's ids in train_bpe's tokenizer, the tiny_hf.NEW_TOKENS ids
    transformers' greedy generate picks after them; fewer if it picks eos)."""
    with tempfile.TemporaryDirectory() as directory:
        train_bpe(Path(directory), vocab_size=tiny_hf.VOCAB)
        tokenizer = build_tokenizer(directory)  # as meshtrain reads a checkpoint's directory
        ids = [tokenizer.bos_id, *tokenizer.encode(tiny_hf.PROMPT).tolist()]
        output = model.generate(
            torch.tensor([ids]),
            max_new_tokens=tiny_hf.NEW_TOKENS,
            do_sample=False,
            eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id,
            # meshtrain never picks embedding rows past the tokenizer's vocabulary
            suppress_tokens=list(range(tokenizer.vocab_size, tiny_hf.VOCAB)),
        )
    return np.asarray(ids, np.int64), output[0, len(ids) :].numpy().astype(np.int64)
