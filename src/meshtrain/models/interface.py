"""The surface of a language model that code outside meshtrain.models may use: the step and its
objectives, the pipeline schedules, decoding and the harness read a Transformer through these
and nothing else (tests/models/test_interface.py). Shapes: B batch, T length, D d_model, V
vocabulary, L layers."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, runtime_checkable

import jax
from flax import nnx

from meshtrain.models.attention import AttentionKernel
from meshtrain.models.lora import AdapterDropout
from meshtrain.models.routing import MoeStats


@runtime_checkable
class LanguageModel(Protocol):
    """A decoder-only language model (models.transformer.Transformer is the one)."""

    rules: Any
    """The logical axis rules its layers constrain with."""
    blocks: Any
    """Its blocks: a list, or one Block whose parameters are stacked on a layers axis."""

    @property
    def kind_index(self) -> list[int]:
        """For each layer, the index of its kind (global, local) in rope_per_kind's list."""

    def hidden(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        dropout: AdapterDropout | None = None,
        *,
        in_layout: bool = False,
    ) -> jax.Array:
        """int32 [B, T] → the final-normed residual stream [B, T, D]."""

    def hidden_and_stats(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        dropout: AdapterDropout | None = None,
        *,
        in_layout: bool = False,
    ) -> tuple[jax.Array, MoeStats | None]:
        """hidden, and a mixture of experts' routing statistics stacked [L, ...] (or None)."""

    def logits(self, x: jax.Array) -> jax.Array:
        """Final-normed hidden states [B, T, D] → logits [B, T, V]."""

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """int32 [B, T] → the first block's input [B, T, D]."""

    def rope_per_kind(self, positions: jax.Array) -> list[tuple[jax.Array, jax.Array, Any]]:
        """(sin, cos, window) of each kind of layer at positions [B, T]."""

    def scan_blocks(
        self,
        graphdef: nnx.GraphDef,
        stacked: nnx.State,
        x: jax.Array,
        per_kind: list,
        kinds: jax.Array,
        kernel: AttentionKernel,
        segment_ids: jax.Array | None,
        active: jax.Array | None = None,
        dropout: AdapterDropout | None = None,
    ) -> tuple[jax.Array, MoeStats | None]:
        """Stacked blocks (a pipeline stage's) in a lax.scan: x [B, T, D] → (x, statistics)."""

    def final_norm(self, x: jax.Array) -> jax.Array:
        """The norm after the last block, [B, T, D] → [B, T, D]."""

    def output_weight(self) -> tuple[jax.Array, str]:
        """The output projection and its layout: "VD" (tied embedding) or "DV"."""

    def attention_kernel(self, dtype: Any) -> tuple[AttentionKernel, str]:
        """The attention kernel that runs in this compute dtype on the current mesh, and why."""

    def on_params_mesh(self) -> contextlib.AbstractContextManager:
        """The parameters' mesh set, around a compiled call outside training."""
