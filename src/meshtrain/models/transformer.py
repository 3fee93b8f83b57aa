"""Decoder-only transformer language model in Flax NNX, configured by `ModelConfig`.

One implementation for every flavour: Llama 3 (GQA, SwiGLU, llama3 RoPE scaling), Qwen 3 (plus
QK-norm) and Gemma 3 (plus local/global layers with their own RoPE bases, sandwich norms, GeGLU,
embedding scaling and (1 + w) norm scales) differ only in their `ModelConfig`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from meshtrain.config.schema import LayerKind, ModelConfig, RematPolicy, choices
from meshtrain.models.attention import AttentionKernel, WindowOfKind
from meshtrain.models.attention_choice import select_attention
from meshtrain.models.block import Block, stack_blocks
from meshtrain.models.layers import RMSNorm, RopeSpec, normal_param, rope_angles
from meshtrain.models.lora import AdapterDropout
from meshtrain.models.routing import MoeStats
from meshtrain.parallel.context import context_layout, sequence_shards, split_sequences
from meshtrain.parallel.rules import constrain

LAYER_KINDS = choices(LayerKind)  # global: full causal attention; local: sliding window
# jax.checkpoint policy per model.remat value: what the backward pass may read from the forward
# pass of a block instead of recomputing it (the block's input is always saved).
REMAT_POLICIES: dict[RematPolicy, Any] = {
    "none": None,  # no remat: every intermediate is kept
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole block
    "dots_saveable": jax.checkpoint_policies.dots_saveable,  # keep every matmul output
    # keep the projections' outputs (matmuls without batch dimensions), recompute attention
    # scores and probabilities ([B, N, T, S], or [B, N, block, keys] per block of queries of the
    # chunked kernel: the largest activations) and element-wise ops
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def layer_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    """ "global" or "local" for each layer: the attention pattern repeated over the depth."""
    pattern = cfg.attention_pattern
    return tuple(pattern[i % len(pattern)] for i in range(cfg.num_layers))


def rope_specs(cfg: ModelConfig) -> dict[str, RopeSpec]:
    """RoPE per layer kind: scaling applies to global layers only (as in Gemma 3)."""
    return {
        "global": RopeSpec(
            theta=cfg.rope_theta,
            scaling=cfg.rope_scaling,
            factor=cfg.rope_scaling_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_len=cfg.rope_original_max_len,
        ),
        "local": RopeSpec(theta=cfg.rope_local_theta or cfg.rope_theta),
    }


def default_positions(tokens: jax.Array) -> jax.Array:
    """0 … T-1 in every row of tokens [B, T]: the positions of unpacked sequences."""
    return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)


def parameter_count(cfg: ModelConfig) -> int:
    """Number of parameters, from abstract one- and two-block models (fast at any depth)."""

    def count(num_layers: int) -> int:
        one = dataclasses.replace(cfg, num_layers=num_layers, scan_layers=False)
        abstract = nnx.eval_shape(lambda: Transformer(one, rngs=nnx.Rngs(0)))
        return sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(abstract, nnx.Param)))

    one_block, two_blocks = count(1), count(2)
    return one_block + (cfg.num_layers - 1) * (two_blocks - one_block)


class Transformer(nnx.Module):
    """tokens [B, T] int32 → logits [B, T, V] in the compute dtype of the parameters.

    `hidden` runs everything up to the final norm and `logits` the output projection; the train
    step calls the two apart, to fuse the projection with the loss. Every layer attends through
    the one kernel model.attention selects (meshtrain.models.attention); optional segment ids
    keep packed documents from attending to each other.

    With scan_layers, `blocks` is one Block whose parameters carry a leading [num_layers] axis,
    run by a lax.scan (one block is compiled whatever the depth; with local and global layers,
    a lax.switch runs the kind of each layer); otherwise a list of Blocks. Both hold the same
    random initial values for the same seed.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.rules = cfg.logical_axis_rules
        # Gather the embedding table over its embed axes before the lookup: set for a pass run
        # per device group (models.abstract.without_mesh_axes), where XLA cannot partition the
        # lookup of a split table and would replicate it; so does a sequence split over cp
        # (embed_tokens); elsewhere XLA's own lookup is cheaper.
        self.gather_table = False
        self.embed = normal_param(
            rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std
        )
        blocks = [Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)]
        self.scan_layers = cfg.scan_layers
        self.blocks = stack_blocks(blocks) if cfg.scan_layers else nnx.List(blocks)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, scale_offset=cfg.norm_scale_offset)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else normal_param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)
        )
        # Gemma computes sqrt(d_model) in fp32, then rounds it to the compute dtype.
        self.embed_scale = (
            float(np.float32(math.sqrt(cfg.d_model))) if cfg.scale_embeddings else None
        )
        self.head_dim = cfg.head_dim
        self.layer_kinds = layer_kinds(cfg)
        self.kinds_used = tuple(k for k in LAYER_KINDS if k in self.layer_kinds)
        self.rope = rope_specs(cfg)
        self.sliding_window = cfg.sliding_window
        self.remat = cfg.remat
        self.attention = cfg.attention

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """tokens, positions (default 0 … T-1), segment_ids (optional: a token attends only to
        earlier tokens of its own segment): int32 [B, T] → logits [B, T, V].

        Called outside a trace (a script, a notebook, the model `meshtrain.load_hf` returns), the
        call is one compiled program per input shape, on whatever mesh the parameters live on,
        rather than op-by-op dispatch: that is slow, and on faked CPU devices it can starve the
        threads of XLA's collectives."""
        if not isinstance(tokens, jax.core.Tracer):
            # Under the parameters' mesh, so that the activations' shardings (a sequence split
            # over cp among them) follow the rules, as in training.
            with self.on_params_mesh():
                return _compiled_call(self, tokens, positions, segment_ids)
        return self.logits(self.hidden(tokens, positions, segment_ids))

    def params_mesh(self) -> Mesh | None:
        """The mesh the parameters are sharded over (None: they live on one device without a
        mesh)."""
        sharding = getattr(self.embed[...], "sharding", None)
        return sharding.mesh if isinstance(sharding, NamedSharding) else None

    def on_params_mesh(self) -> contextlib.AbstractContextManager:
        """`jax.set_mesh` of params_mesh: around a compiled call outside training (a model call,
        generation, the harness), so that `constrain` shards the activations (and a decode cache)
        as in training. Nothing without a mesh, or inside the caller's own trace (a call within
        its `jax.grad` or `jax.jit`), where `jax.set_mesh` is refused and the caller's mesh, if
        any, applies."""
        mesh = self.params_mesh()
        if mesh is None:
            return contextlib.nullcontext()
        try:
            return jax.set_mesh(mesh)
        except ValueError:  # "`set_mesh` can only be used outside of `jax.jit`" (any trace)
            return contextlib.nullcontext()

    def attention_kernel(self, dtype: jnp.dtype) -> tuple[AttentionKernel, str]:
        """The attention kernel model.attention selects in this compute dtype on the current
        mesh, and why."""
        mesh = jax.sharding.get_abstract_mesh()
        shards = 1 if mesh.empty else sequence_shards(mesh.shape, self.rules)
        return select_attention(
            self.attention, dtype=dtype, head_dim=self.head_dim, context_shards=shards
        )

    def hidden(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        dropout: AdapterDropout | None = None,
        *,
        in_layout: bool = False,
    ) -> jax.Array:
        """hidden_and_stats without the routing statistics."""
        return self.hidden_and_stats(tokens, positions, segment_ids, dropout, in_layout=in_layout)[
            0
        ]

    def hidden_and_stats(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        dropout: AdapterDropout | None = None,
        *,
        in_layout: bool = False,
    ) -> tuple[jax.Array, MoeStats | None]:
        """The final-normed residual stream [B, T, D] that the output projection turns into
        logits (the loss fuses that projection with the cross-entropy: meshtrain.train.step).
        dropout: of the LoRA adapters' inputs, in training.

        Under a mesh that splits sequences over cp, the blocks run on them in the context
        layout (meshtrain.parallel.context): the inputs are put in it, and the result back in
        sequence order; with `in_layout`, the inputs (positions included) already are in it
        and the result stays in it (the train step's loss does not need the order). The routing
        statistics of a mixture of experts' layers, stacked on a leading layers axis [L, ...]
        (None without experts), give its auxiliary losses (models.moe.auxiliary_losses)."""
        layout = context_layout(tokens.shape[1], self.rules)
        if positions is None:
            positions = default_positions(tokens)
            if in_layout and layout is not None:
                positions = layout.to_layout(positions)
        if layout is not None and not in_layout:
            tokens, positions, segment_ids = split_sequences(
                self.rules, tokens, positions, segment_ids
            )
        x = self.embed_tokens(tokens)
        kernel, _ = self.attention_kernel(x.dtype)
        per_kind = self.rope_per_kind(positions)
        x, stats = self._run_blocks(x, per_kind, self.kind_index, kernel, segment_ids, dropout)
        x = self.final_norm(x)
        if layout is None or in_layout:
            return x, stats
        return constrain(layout.to_sequence(x), ("batch", "length", None), self.rules), stats

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens int32 [B, T] → the residual stream's input [B, T, D], in the compute dtype
        (that of the embedding: the caller casts the parameters)."""
        embed = self.embed[...]
        if self.gather_table or context_layout(tokens.shape[1], self.rules) is not None:
            embed = constrain(embed, ("vocab", None), self.rules)
        x = jnp.take(embed, tokens, axis=0)  # [B, T, D]
        if self.embed_scale is not None:
            x = x * jnp.asarray(self.embed_scale, embed.dtype)
        return constrain(x, ("batch", "length", None), self.rules)

    def rope_per_kind(self, positions: jax.Array) -> list[tuple[jax.Array, jax.Array, int | None]]:
        """(sin, cos, window) of each kind in kinds_used at positions [B, T]: RoPE angles
        depend only on the layer kind, so they are computed once and shared by the layers."""
        per_kind = []
        for kind in self.kinds_used:
            sin, cos = rope_angles(positions, self.rope[kind].inv_freq(self.head_dim))
            window = self.sliding_window if kind == "local" else None
            per_kind.append((sin, cos, window))
        return per_kind

    @property
    def kind_index(self) -> list[int]:
        """For each layer, the index of its kind in kinds_used."""
        return [self.kinds_used.index(k) for k in self.layer_kinds]

    def output_weight(self) -> tuple[jax.Array, str]:
        """The output projection and its layout: the embedding [V, D] ("VD") when tied, else
        lm_head [D, V] ("DV"); in the compute dtype of the parameters."""
        if self.lm_head is None:
            return self.embed[...], "VD"
        return self.lm_head[...].astype(self.embed[...].dtype), "DV"

    def logits(self, x: jax.Array) -> jax.Array:
        """Final-normed hidden states [B, T, D] → logits [B, T, V]."""
        weight, layout = self.output_weight()
        logits = jnp.einsum(f"BTD,{layout}->BTV", x, weight)
        return constrain(logits, ("batch", "length", "vocab"), self.rules)

    def _run_blocks(
        self,
        x: jax.Array,
        per_kind: list,
        kind_index: list[int],
        kernel: AttentionKernel,
        segment_ids: jax.Array | None,
        dropout: AdapterDropout | None = None,
    ) -> tuple[jax.Array, MoeStats | None]:
        """x [B, T, D] through every block → (x, the blocks' routing statistics stacked [L, ...],
        or None)."""
        policy = REMAT_POLICIES[self.remat]

        def layer_dropout(layer: int) -> AdapterDropout | None:
            return None if dropout is None else dropout.at_layer(layer)

        if not self.scan_layers:
            # One wrapper per layer kind (remat or not): the window is static, arrays arguments.
            def wrapper(window: int | None) -> Any:
                def run(block, x, sin, cos, segment_ids, dropout):
                    return block(
                        x,
                        sin,
                        cos,
                        kernel=kernel,
                        window=window,
                        segment_ids=segment_ids,
                        dropout=dropout,
                    )

                return run if self.remat == "none" else nnx.remat(run, policy=policy)

            apply = [wrapper(window) for _, _, window in per_kind]
            per_layer = []
            for layer, (block, kind) in enumerate(zip(self.blocks, kind_index, strict=True)):
                sin, cos, _ = per_kind[kind]
                x, stats = apply[kind](block, x, sin, cos, segment_ids, layer_dropout(layer))
                per_layer.append(stats)
            return x, jax.tree.map(lambda *layers: jnp.stack(layers), *per_layer)

        graphdef, stacked = nnx.split(self.blocks)
        kinds = jnp.asarray(kind_index, jnp.int32)
        return self.scan_blocks(
            graphdef, stacked, x, per_kind, kinds, kernel, segment_ids, dropout=dropout
        )

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
        """Runs stacked blocks in a lax.scan: `stacked` is the state of scan_layers' `blocks`
        (or a pipeline stage's layers), kinds int32 [layers] the index in per_kind of each
        layer's kind; x [B, T, D] → ([B, T, D], the layers' routing statistics [layers, ...] or
        None). active bool [layers]: a layer where false passes
        x through (a pipeline stage's slot beyond its layers); None: all run. dropout: the
        adapters', each layer's folded with its index in the stack."""
        policy = REMAT_POLICIES[self.remat]

        # Several kinds: RoPE by kind [K, B, T, 1, H/2], indexed by each layer's kind.
        sins, coses = (jnp.stack([angles[i] for angles in per_kind]) for i in (0, 1))
        windows = tuple(window for _, _, window in per_kind)

        def angles_and_window(kind: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
            if len(per_kind) == 1:
                return per_kind[0]
            return sins[kind], coses[kind], WindowOfKind(kind, windows)

        def run(x: jax.Array, params: nnx.State, kind: jax.Array, index: jax.Array) -> Any:
            sin, cos, window = angles_and_window(kind)
            block = nnx.merge(graphdef, params)
            drop = None if dropout is None else dropout.at_layer(index)
            return block(
                x, sin, cos, kernel=kernel, window=window, segment_ids=segment_ids, dropout=drop
            )

        def layer(x: jax.Array, slot) -> tuple[jax.Array, MoeStats | None]:
            if active is None:
                return run(x, *slot)
            params, kind, index, on = slot
            y, stats = run(x, params, kind, index)
            return jnp.where(on, y, x), stats

        if self.remat != "none":
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
        indices = jnp.arange(kinds.shape[0], dtype=jnp.int32)
        xs = (stacked, kinds, indices) if active is None else (stacked, kinds, indices, active)
        return jax.lax.scan(layer, x, xs)


@nnx.jit
def _compiled_call(
    model: Transformer,
    tokens: jax.Array,
    positions: jax.Array | None,
    segment_ids: jax.Array | None,
) -> jax.Array:
    """Transformer.__call__ under jit: traced, so it runs the model's ops directly."""
    return model(tokens, positions, segment_ids)
