"""Model FLOPs of a training step: the matmul count behind TFLOP/s per device and MFU.

The rules (written out with a worked example in docs/profiling.md#the-flop-formula):

- A matmul [m, k] × [k, n] costs 2·m·k·n FLOPs (one multiply, one add). Norms, softmax, rotary
  embeddings and other elementwise work are not counted, as in PaLM (Chowdhery et al. 2022,
  https://arxiv.org/abs/2204.02311, appendix B) and Kaplan et al. 2020 (§2.1), whose 6·N per
  token this reduces to for short sequences.
- Training costs 3× the forward pass: the backward pass computes the gradients with respect to
  the activations and with respect to the weights, each as many FLOPs as the forward pass.
  (Rematerialisation would add a forward pass of hardware FLOPs, but not of model FLOPs.)
- Causal attention is counted once: the query at position t attends to min(t + 1, window) keys
  (window = None: every earlier key), and both the scores q·kᵀ and the weighted sum of values
  cost 2·head_dim FLOPs per query head per attended key. With full causal attention the average
  query attends to (T + 1) / 2 keys. Kernels that compute the whole T×T square and mask it do
  more hardware work; MFU counts only the useful half.
- The embedding lookup is a gather (0 FLOPs); the output projection to the vocabulary is a
  matmul (2·d_model·vocab per token), whether or not it is tied to the embedding.
- LoRA (model.lora): each adapter adds x·A and (x·A)·B, 2·r·(in + out) per token, trained 3×.
  The frozen base's weights get no gradient, so its projections cost 2× their forward pass (the
  pass and the activations' gradient); attention, which has no weights, still costs 3×.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshtrain.config import ModelConfig
from meshtrain.config.lora import lora_enabled, target_projections
from meshtrain.families import family
from meshtrain.models.transformer import layer_kinds

# Forward + backward (gradients of activations and of weights).
TRAIN_FACTOR = 3


def attention_windows(cfg: ModelConfig) -> list[int | None]:
    """Per layer, how many of the most recent keys a query attends to; None is full causal.

    Local layers of `model.attention_pattern` (Gemma 3's five in six) see `model.sliding_window`
    keys; global layers see the whole causal prefix.
    """
    return [cfg.sliding_window if kind == "local" else None for kind in layer_kinds(cfg)]


def attended_keys(seq_len: int, window: int | None) -> int:
    """Σ over query positions t in [0, seq_len) of the keys it attends to, min(t + 1, window)."""
    if window is None or window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    # Positions 0..window-1 see t + 1 keys; the remaining seq_len - window see `window`.
    return window * (window + 1) // 2 + (seq_len - window) * window


@dataclass(frozen=True)
class FlopCount:
    """Forward-pass FLOPs of one sequence, by part of the model."""

    projections: int  # q, k, v and output projections of every attention layer
    attention: int  # scores and weighted values, causal (and window-limited) keys only
    mlp: int  # gate, up and down projections
    logits: int  # the output projection to the vocabulary
    embedding: int = 0  # a gather: no FLOPs
    adapters: int = 0  # LoRA: x·A and (x·A)·B of every adapter
    frozen_base: bool = False  # LoRA: the base's weights get no gradient

    @property
    def forward(self) -> int:
        weights = self.projections + self.mlp + self.logits + self.embedding
        return weights + self.attention + self.adapters

    @property
    def train(self) -> int:
        if not self.frozen_base:
            return TRAIN_FACTOR * self.forward
        weights = self.projections + self.mlp + self.logits + self.embedding
        return 2 * weights + TRAIN_FACTOR * (self.attention + self.adapters)


def forward_flops(
    cfg: ModelConfig, seq_len: int, windows: Sequence[int | None] | None = None
) -> FlopCount:
    """Forward FLOPs of one sequence of `seq_len` tokens (windows: per layer, default the model's)."""
    windows = attention_windows(cfg) if windows is None else list(windows)
    if len(windows) != cfg.num_layers:
        raise ValueError(f"{len(windows)} attention windows for {cfg.num_layers} layers")
    h, t = cfg.head_dim, seq_len
    # Per token, each of the family's projections (families.vocabulary): 2 · in · out.
    per_token = {"attn": 0, "mlp": 0}
    for projection in family(cfg.family).projections:
        per_token[projection.module] += projection.flops_per_token(cfg)
    projections, mlp = t * per_token["attn"], t * per_token["mlp"]
    # Per attended (query, key) pair and query head: q·k (2·H) and p·v (2·H).
    attention = sum(4 * h * cfg.num_heads * attended_keys(t, w) for w in windows)
    return FlopCount(
        projections=cfg.num_layers * projections,
        attention=attention,
        mlp=cfg.num_layers * mlp,
        logits=2 * t * cfg.d_model * cfg.vocab_size,
        adapters=cfg.num_layers * adapter_flops(cfg, t),
        frozen_base=lora_enabled(cfg),
    )


def adapter_flops(cfg: ModelConfig, seq_len: int) -> int:
    """Forward FLOPs of one block's LoRA adapters over `seq_len` tokens (0 without LoRA)."""
    if not lora_enabled(cfg):
        return 0
    widths = {p.name: sum(p.widths(cfg)) for p in family(cfg.family).projections}
    return sum(2 * seq_len * cfg.lora.rank * widths[t] for t in target_projections(cfg))


def train_flops_per_step(
    cfg: ModelConfig,
    *,
    seq_len: int,
    sequences: int,
    windows: Sequence[int | None] | None = None,
) -> int:
    """Model FLOPs of one update over `sequences` sequences (the global batch), all devices."""
    return sequences * forward_flops(cfg, seq_len, windows).train
