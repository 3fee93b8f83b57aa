"""A mixture of experts' router: which K of E experts each token goes to and with what weights,
the routing statistics of a layer, and the auxiliary losses they give (the load-balancing loss
and the router z-loss), added to the objective's loss and logged as moe/* metrics.

Dimension letters: N tokens, E experts, K experts per token (top-k), L layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class MoeStats:
    """One MoE layer's routing statistics, fp32, over the tokens its mask counts (all by
    default). The losses are unweighted: the caller multiplies them by model.moe.aux_loss_coef
    and z_loss_coef."""

    aux_loss: jax.Array
    """[]: the load-balancing loss of Switch Transformer as transformers' load_balancing_loss_func
    computes it for one layer, E · Σ_e (assignments to e / tokens) · (mean score of e); K when the
    load is even."""
    z_loss: jax.Array
    """[]: ST-MoE's router z-loss, the mean over tokens of logsumexp(router logits)²."""
    expert_load: jax.Array
    """[E]: the fraction of the N·K assignments routed to each expert (before any is dropped)."""
    router_prob: jax.Array
    """[E]: each expert's score averaged over the tokens (softmax: its probability; sigmoid: its
    score divided by the token's sum of scores). With expert_load it gives the loss of several
    layers together: combined_aux_loss."""
    dropped: jax.Array
    """[]: assignments over their expert's capacity, dropped (padding tokens' included); 0 when
    dropless."""


def combined_aux_loss(expert_load: jax.Array, router_prob: jax.Array, top_k: int) -> jax.Array:
    """The load-balancing loss of L layers together, as transformers' load_balancing_loss_func
    computes it from a tuple of L layers' router logits (of as many tokens each): the assignment
    fractions and the mean probabilities averaged over the layers first, then
    E · Σ_e K·load_e · prob_e. expert_load, router_prob: [L, E] (MoeStats' fields stacked). Not
    the mean of the layers' aux_loss: averaging the layers first, it is smaller when one layer's
    overload meets another's underload."""
    num_experts = expert_load.shape[-1]
    load, prob = jnp.mean(expert_load, axis=0), jnp.mean(router_prob, axis=0)
    return num_experts * top_k * jnp.sum(load * prob)


def route(
    logits: jax.Array, *, top_k: int, score: str, normalize_top_k: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Routing from fp32 logits [N, E]: (weights [N, K] fp32, experts [N, K] int32, scores
    [N, E] fp32). The scores are the softmax over the E experts or the sigmoid of each; the K
    highest pick the experts (in descending order; a tie goes to the lower index); their scores,
    divided by their sum with normalize_top_k, weigh the experts' outputs. As transformers'
    routers: softmax first, then top-k, then the renormalisation (Mixtral always; Qwen3-MoE with
    norm_topk_prob)."""
    scores = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    _, experts = jax.lax.top_k(scores, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if normalize_top_k:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), scores


def weighted_sum(outputs: jax.Array, weights: jax.Array) -> jax.Array:
    """A token's output: its K picks' expert outputs weighted by their routing weights and
    summed, in fp32. outputs [N, K, D] (any dtype), weights [N, K] fp32 → [N, D] fp32."""
    return jnp.einsum("NKD,NK->ND", outputs.astype(jnp.float32), weights)


def routing_stats(
    logits: jax.Array,
    scores: jax.Array,
    experts: jax.Array,
    mask: jax.Array | None,
    *,
    score: str,
    dropped: jax.Array,
) -> MoeStats:
    """MoeStats of logits and scores [N, E], experts [N, K], over the tokens of mask [N] (all
    where None). transformers' load_balancing_loss_func always takes the softmax of the logits;
    with sigmoid scores, the mean score is of the scores normalised over the experts (as
    DeepSeek-V3's sequence-wise balance loss)."""
    num_tokens, top_k = experts.shape
    num_experts = logits.shape[-1]
    weight = jnp.ones((num_tokens,), jnp.float32) if mask is None else mask.astype(jnp.float32)
    tokens = jnp.maximum(jnp.sum(weight), 1.0)  # no token counted: zeros rather than NaN
    counts = (
        jnp.zeros((num_experts,), jnp.float32)
        .at[experts.reshape(-1)]
        .add(jnp.repeat(weight, top_k))
    )  # [E]
    probs = scores if score == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
    router_prob = jnp.sum(probs * weight[:, None], axis=0) / tokens  # [E]
    z = jnp.square(jax.nn.logsumexp(logits, axis=-1))  # [N]
    return MoeStats(
        aux_loss=num_experts * jnp.sum(counts / tokens * router_prob),
        z_loss=jnp.sum(z * weight) / tokens,
        expert_load=counts / (tokens * top_k),
        router_prob=router_prob,
        dropped=dropped.astype(jnp.float32),
    )


MOE_METRICS = ("moe/aux_loss", "moe/z_loss", "moe/load_min", "moe/load_max", "moe/dropped")
"""What a mixture of experts logs each step, after the objective's own metrics."""


def auxiliary_losses(stats: MoeStats, moe: Any) -> dict[str, jax.Array]:
    """The auxiliary loss of a model's MoE layers and its metrics, from their routing statistics
    stacked [L, ...] and model.moe: "loss", aux_loss_coef · the load-balancing loss of every layer
    together (combined_aux_loss, as transformers adds router_aux_loss_coef · aux_loss to its
    loss) + z_loss_coef · the layers' mean z-loss, fp32 []; "moe/aux_loss" and "moe/z_loss"
    unweighted; "moe/load_min" and "moe/load_max", the least and most loaded expert of any
    layer as a multiple of an even load (1: every expert takes N·K/E assignments);
    "moe/dropped", the assignments dropped over capacity in all layers."""
    aux = combined_aux_loss(stats.expert_load, stats.router_prob, moe.top_k)
    z_loss = jnp.mean(stats.z_loss)
    even = stats.expert_load * stats.expert_load.shape[-1]  # [L, E]
    return {
        "loss": moe.aux_loss_coef * aux + moe.z_loss_coef * z_loss,
        "moe/aux_loss": aux,
        "moe/z_loss": z_loss,
        "moe/load_min": jnp.min(even),
        "moe/load_max": jnp.max(even),
        "moe/dropped": jnp.sum(stats.dropped),
    }
