"""A mixture-of-experts feed-forward layer (sparse MoE, as Mixtral's and Qwen3-MoE's) in Flax
NNX: a router sends each token to K of E gated MLPs and sums their outputs, weighted.

Dimension letters: B batch, T length, D model (embed), N tokens (B·T), E experts, K experts per
token (top-k), M assignments (N·K), F one expert's hidden width, C capacity (the assignments one
expert takes in capacity mode), r a LoRA adapter's rank.

Numerics, against Hugging Face transformers' Qwen3MoeSparseMoeBlock and MixtralSparseMoeBlock:
the router's logits are computed in fp32 from the upcast x (transformers computes them in the
model's dtype, then the softmax in fp32: the same in fp32, more exact in bf16, where a near tie
between two experts may pick differently); the scores, the top-k and the routing weights are fp32
(Mixtral's are; Qwen3-MoE casts its weights back to the model's dtype); each expert runs in x's
dtype, and its outputs are weighted and summed over the K picks in fp32, then cast to x's dtype
(transformers' default grouped_mm experts do the same with Mixtral's fp32 weights).

LoRA (models.lora) on the experts, as PEFT's on each expert's own projection: every expert e's
gate, up and down W_e get A_e [in, r] and B_e [r, out] (stored [E, in, r] and [E, r, out]),
y_e = x·W_e + alpha/r · (x·A_e)·B_e, run as grouped matmuls like the weights; the router never
gets one. The base weights may be QLoRA's block-quantised codes, dequantised where they are read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.models.capacity import CapacityRouting, expert_capacity
from meshtrain.models.expert_parallel import (
    NO_EXCHANGE,
    Exchange,
    exchanging_buffers,
    expert_axes,
    gathering_tokens,
    token_shards,
)
from meshtrain.models.grouped import grouped_matmul
from meshtrain.models.layers import Projections, normal_param
from meshtrain.models.lora import AdapterDropout, LoraSpec, add_adapter
from meshtrain.models.routing import MoeStats, route, routing_stats, weighted_sum
from meshtrain.parallel.rules import Rules, constrain

EXPERT_PROJECTIONS = ("gate", "up", "down")
"""The experts' projections, each of which LoRA may target (the router: never)."""


class MoeFeedForward(Projections):
    """Mixture of E gated-MLP experts (each as GatedMLP: down(act(x·gate) * (x·up))), K per
    token, picked by a linear router.

    Dropless (capacity_factor None): the N·K assignments sorted by expert, every expert runs on
    all of its own as one grouped matmul (models.grouped), no token dropped. Capacity mode:
    each expert takes its first C = expert_capacity(...) assignments of each sequence in token
    order (first come first served, as Switch Transformer; GShard instead serves every token's
    first pick before any second pick) into fixed buffers [E, S·C, D] (models.capacity), run as
    a batched matmul; the assignments past C add nothing (the residual carries the token) and
    are counted. The routing weights are not renormalised over the assignments kept. On a mesh
    whose devices hold different tokens, the layer runs per device (models.expert_parallel):
    with the experts split over ep, dropless mode gathers the tokens of the ep group and
    capacity mode exchanges its buffers by all-to-all.

    Parameters: router [D, E] ("embed", "experts"); gate, up [E, D, F] ("experts", "embed",
    "expert_mlp"); down [E, F, D] ("experts", "expert_mlp", "embed"). From transformers'
    Qwen3-MoE and Mixtral (5.x, in memory): router = gate.weight.T, gate[e] =
    experts.gate_up_proj[e, :F].T, up[e] = experts.gate_up_proj[e, F:].T, down[e] =
    experts.down_proj[e].T.

    With `lora` targeting gate, up or down: `<name>_lora_a` [E, *in, r] ("experts", <the
    weight's input axis>, "lora_rank") and `<name>_lora_b` [E, r, *out] ("experts",
    "lora_rank", <its output axis>), as nnx.LoRAParam (models.lora.add_adapter with one leading
    axis), drawn after the base parameters.
    """

    def __init__(
        self,
        *,
        d_model: int,
        expert_dim: int,
        num_experts: int,
        top_k: int,
        score: str = "softmax",
        normalize_top_k: bool = True,
        capacity_factor: float | None = None,
        activation: str,
        init_std: float,
        rules: Rules,
        rngs: nnx.Rngs,
        lora: LoraSpec | None = None,
    ):
        self.num_experts, self.top_k = num_experts, top_k
        self.score, self.normalize_top_k = score, normalize_top_k
        self.capacity_factor = capacity_factor
        self.activation = activation
        self.rules = rules
        e, d, f = num_experts, d_model, expert_dim
        self.router = normal_param(rngs, (d, e), ("embed", "experts"), init_std)
        self.gate = normal_param(rngs, (e, d, f), ("experts", "embed", "expert_mlp"), init_std)
        self.up = normal_param(rngs, (e, d, f), ("experts", "embed", "expert_mlp"), init_std)
        self.down = normal_param(rngs, (e, f, d), ("experts", "expert_mlp", "embed"), init_std)
        self.lora = lora
        for name in EXPERT_PROJECTIONS:
            add_adapter(self, name, rngs, lora, inputs=1, leading=1)

    def __call__(
        self, x: jax.Array, dropout: AdapterDropout | None = None, mask: jax.Array | None = None
    ) -> tuple[jax.Array, MoeStats]:
        """x: [B, T, D] → ([B, T, D] in x's dtype, MoeStats). dropout: of the adapters' inputs,
        in training. mask: optional [B, T], true for the tokens the statistics count
        (transformers' attention_mask in load_balancing_loss_func); every token is routed and
        computed either way."""
        batch, length, d_model = x.shape
        flat = x.reshape(batch * length, d_model)  # [N, D]
        router = self.weight("router").astype(jnp.float32)
        logits = jnp.einsum(
            "ND,DE->NE", flat.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST
        )
        weights, experts, scores = route(
            logits, top_k=self.top_k, score=self.score, normalize_top_k=self.normalize_top_k
        )
        adapter_inputs, down_keep = self.adapter_inputs(x, dropout)
        inputs = (flat, experts, self.expert_params(x.dtype), adapter_inputs, down_keep)
        axes = expert_axes(self.rules)  # () when the experts are whole on every device
        shards = token_shards(self.rules)
        split = shards > 1 and flat.shape[0] % shards == 0  # each device runs its own tokens
        dropped = jnp.zeros((), jnp.int32)
        if self.capacity_factor is not None:
            run = functools.partial(self.with_capacity, length=length)
            if split:
                y, dropped = exchanging_buffers(run, axes, self.rules, inputs, weights)
            else:
                outputs, dropped = run(*inputs)
                y = weighted_sum(outputs, weights)
        elif split:
            y = gathering_tokens(self.dropless_on, axes, self.rules, inputs, weights)
        else:
            y = weighted_sum(self.dropless_on(*inputs), weights)
        y = y.astype(x.dtype)  # [N, D]: the picks' outputs weighted and summed in fp32
        y = constrain(y.reshape(batch, length, d_model), ("batch", "length", None), self.rules)
        stats = routing_stats(
            logits,
            scores,
            experts,
            None if mask is None else mask.reshape(-1),
            score=self.score,
            dropped=dropped,
        )
        return y, stats

    def expert_params(self, dtype: jnp.dtype) -> dict[str, jax.Array]:
        """The experts' weights, gate, up [E, D, F] and down [E, F, D], and their adapters
        (`<name>_lora_a` [E, *in, r], `<name>_lora_b` [E, r, *out]), cast to the compute dtype
        (a quantised weight dequantised by self.weight)."""
        params = {}
        for name in EXPERT_PROJECTIONS:
            params[name] = self.gathered(name, self.weight(name).astype(dtype))
            if self.adapted(name):
                for suffix in ("_lora_a", "_lora_b"):
                    value = getattr(self, f"{name}{suffix}")[...].astype(dtype)
                    params[f"{name}{suffix}"] = self.gathered(f"{name}{suffix}", value)
        return params

    def adapted(self, name: str) -> bool:
        """Whether the projection `name` has an adapter."""
        return self.lora is not None and name in self.lora.targets

    def adapter_inputs(
        self, x: jax.Array, dropout: AdapterDropout | None
    ) -> tuple[dict[str, jax.Array], jax.Array | None]:
        """In training (dropout given, lora.dropout > 0), the adapters' dropped-out inputs: (x
        [N, D] dropped out for gate's and up's adapters, those targeted; the mask [M, F],
        token-major, of down's adapter input, or None). Out of training: ({}, None), every
        adapter reading its weight's own input.

        As GatedMLP's adapters: x is dropped out per projection before dispatch, so a token's
        mask is the same in each of its K experts. For down, the mask is the one
        AdapterDropout.apply draws for a [B, T, K, F] array, in x's dtype (0 or 1/(1 - p)): the
        hidden of the k-th pick of token (b, t) is multiplied by entry [b, t, k] wherever its
        expert runs it, as if the hidden were put back in token order [B, T, K, F], dropped out
        and dispatched again. Every mask depends only on its sequence's key, the layer and the
        projection, never on how the batch is split."""
        rate = 0.0 if self.lora is None else self.lora.dropout
        if dropout is None or rate <= 0:
            return {}, None
        batch, length, d_model = x.shape
        inputs = {
            name: dropout.apply(x, name, rate).reshape(-1, d_model)
            for name in ("gate", "up")
            if self.adapted(name)
        }
        down_keep = None
        if self.adapted("down"):
            width = self.down_lora_a.shape[-2]  # F (the base weight may be quantised)
            ones = jnp.ones((batch, length, self.top_k, width), x.dtype)
            down_keep = dropout.apply(ones, "down", rate).reshape(-1, width)  # [M, F]
        return inputs, down_keep

    def expert_projection(
        self,
        name: str,
        matmul: Callable[[jax.Array, jax.Array], jax.Array],
        lhs: jax.Array,
        params: dict[str, jax.Array],
        adapter_lhs: jax.Array | None = None,
    ) -> jax.Array:
        """Each expert's rows of lhs times its weight params[name], by matmul (a grouped or a
        batched product over the experts), plus alpha/r · (adapter_lhs·A_e)·B_e where `name`
        has an adapter (adapter_lhs: lhs dropped out, or lhs itself when None), in lhs's dtype."""
        y = matmul(lhs, params[name])
        if not self.adapted(name):
            return y
        a, b = params[f"{name}_lora_a"], params[f"{name}_lora_b"]
        low = matmul(lhs if adapter_lhs is None else adapter_lhs, a)  # [..., r]
        return y + matmul(low * jnp.asarray(self.lora.scale, low.dtype), b)

    def act(self, gate: jax.Array) -> jax.Array:
        return (
            jax.nn.silu(gate) if self.activation == "silu" else jax.nn.gelu(gate, approximate=True)
        )

    def dropless_on(
        self,
        flat: jax.Array,
        experts: jax.Array,
        params: dict[str, jax.Array],
        adapter_inputs: dict[str, jax.Array],
        down_keep: jax.Array | None,
        *,
        first: Any = 0,
    ) -> jax.Array:
        """The experts params holds (E_l of them, the first numbered `first`) on the picks
        routed to them, dropless: flat [N, D], experts [N, K] → outputs [N, K, D], zero for a
        pick of another expert. adapter_inputs, down_keep: see adapter_inputs."""
        local = params["gate"].shape[0]
        picks = experts - first
        picks = jnp.where((picks >= 0) & (picks < local), picks, local)  # local: another's
        return self.dropless(flat, picks, params, adapter_inputs, down_keep)

    def dropless(
        self,
        flat: jax.Array,
        picks: jax.Array,
        params: dict[str, jax.Array],
        adapter_inputs: dict[str, jax.Array],
        down_keep: jax.Array | None,
    ) -> jax.Array:
        """Every expert of params (E_l) on every pick routed to it: flat [N, D], picks [N, K]
        (an expert of params, or E_l for another's) → outputs [N, K, D], the output of the k-th
        pick of each token (unweighted; zero for another's). adapter_inputs, down_keep: see
        adapter_inputs."""
        num_tokens, top_k = picks.shape
        local = params["gate"].shape[0]
        assigned = picks.reshape(-1)  # [M], token-major
        order = jnp.argsort(assigned, stable=True)  # [M]: grouped by expert, another's last
        group_sizes = jnp.sum(
            jax.nn.one_hot(assigned, local, dtype=jnp.int32), axis=0
        )  # [E_l]: another's pick (E_l) counts in none
        token = order // top_k  # [M]: each assignment's token, in expert order
        rows = flat[token]  # [M, D]

        def matmul(lhs: jax.Array, rhs: jax.Array) -> jax.Array:  # [M, i] · [E_l, i, o]
            return grouped_matmul(lhs, rhs, group_sizes)  # rows past the groups: 0

        def adapter_rows(name: str) -> jax.Array | None:
            inputs = adapter_inputs.get(name)
            return None if inputs is None else inputs[token]

        hidden = self.act(
            self.expert_projection("gate", matmul, rows, params, adapter_rows("gate"))
        ) * self.expert_projection("up", matmul, rows, params, adapter_rows("up"))  # [M, F]
        hidden = constrain(hidden, (None, "expert_mlp"), self.rules)
        kept = None if down_keep is None else hidden * down_keep[order]
        out = self.expert_projection("down", matmul, hidden, params, kept)  # [M, D], by expert
        unsorted = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
        return out[unsorted].reshape(num_tokens, top_k, -1)

    def with_capacity(
        self,
        flat: jax.Array,
        experts: jax.Array,
        params: dict[str, jax.Array],
        adapter_inputs: dict[str, jax.Array],
        down_keep: jax.Array | None,
        *,
        length: int,
        exchange: Exchange = NO_EXCHANGE,
    ) -> tuple[jax.Array, jax.Array]:
        """Each expert on its first C picks of each sequence, in token order: flat [N, D] (whole
        sequences of `length` tokens), experts [N, K] → (outputs [N, K, D], zero for a dropped
        pick; the picks dropped, int32 []). C = expert_capacity over a sequence's tokens and all
        E experts, so which picks drop depends on the sequence alone, never on how the batch or
        the experts are split over devices. params holds every expert (E_l = E, no exchange),
        or, with an `exchange` over ep, this device's E/ep: the buffers for every expert
        [E, S·C, ...] then go to the devices holding them and the outputs come back.
        adapter_inputs, down_keep: see adapter_inputs."""
        top_k = self.top_k
        capacity = expert_capacity(self.capacity_factor, length, top_k, self.num_experts)
        routing = CapacityRouting.of(
            experts, length=length, capacity=capacity, num_experts=self.num_experts
        )

        def dispatch(rows: jax.Array) -> jax.Array:  # [M, i] → [E_l, X, i]
            return exchange.to_experts(routing.dispatch(rows))

        def matmul(lhs: jax.Array, rhs: jax.Array) -> jax.Array:  # [E_l, X, i] · [E_l, i, o]
            return jnp.einsum("EXi,Eio->EXo", lhs, rhs)

        def adapter_buffer(name: str) -> jax.Array | None:
            inputs = adapter_inputs.get(name)
            return None if inputs is None else dispatch(jnp.repeat(inputs, top_k, axis=0))

        buffer = dispatch(jnp.repeat(flat, top_k, axis=0))  # [E_l, X, D]
        hidden = self.act(
            self.expert_projection("gate", matmul, buffer, params, adapter_buffer("gate"))
        ) * self.expert_projection("up", matmul, buffer, params, adapter_buffer("up"))
        kept = None if down_keep is None else hidden * dispatch(down_keep)
        out = self.expert_projection("down", matmul, hidden, params, kept)  # [E_l, X, D]
        return routing.combine(exchange.back(out)).reshape(*experts.shape, -1), routing.dropped
