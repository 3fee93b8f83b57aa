"""The tiny model (tied embeddings, one device) and the unfused log-probabilities that the tests
of an objective's fused loss compare with (train/test_preference.py,
train/test_policy_gradient.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from helpers.config import compose_config
from meshtrain.models.abstract import AbstractModel, abstract_model
from meshtrain.models.transformer import Transformer
from meshtrain.parallel.mesh import build_mesh, parse_mesh_shape
from meshtrain.train.documents import DocumentBoundaries, TokenFormat

# Rows as the chat and preference data write them: the untrained tokens flagged in the ids.
FLAGGED = TokenFormat(documents=DocumentBoundaries(bos_id=-1, eos_id=-1), flagged=True)


@dataclass
class TinyPolicy:
    model: AbstractModel  # on one device
    params: Any  # a pure dict, seed 0
    reference: Any  # another draw, seed 1
    graphdef: Any
    state: Any

    def log_probs_alone(self, weights: Any, ids: np.ndarray, length: int) -> jax.Array:
        """fp32 [length - 1]: log p(ids[t + 1] | ids[:t + 1]) of the sequence `ids` alone with
        `weights`, log_softmax over the whole logits. Zeros after the sequence (which a causal
        model does not read) give every call one shape, so its eager ops compile once."""
        padded = np.pad(ids, (0, length - len(ids)))
        log_probs = self._log_softmax_alone(weights, padded)
        return jnp.take_along_axis(log_probs, padded[1:, None], axis=-1)[:, 0]

    def entropies_alone(self, weights: Any, ids: np.ndarray, length: int) -> jax.Array:
        """fp32 [length - 1]: the entropy of the prediction after each of ids[:t + 1], the
        sequence alone (padded as log_probs_alone pads it)."""
        log_probs = self._log_softmax_alone(weights, np.pad(ids, (0, length - len(ids))))
        return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)

    def _log_softmax_alone(self, weights: Any, padded: np.ndarray) -> jax.Array:
        nnx.replace_by_pure_dict(self.state, weights)
        logits = nnx.merge(self.graphdef, self.state)(jnp.asarray(padded[None, :-1]))[0]
        return jax.nn.log_softmax(logits)


def tiny_policy() -> TinyPolicy:
    cfg = dataclasses.replace(compose_config().model, tie_embeddings=True)
    spec = parse_mesh_shape([[1, 1], ["fsdp", "tp"]], 1)
    model = abstract_model(cfg, build_mesh(spec, jax.devices()[:1]), spec)

    def draw(seed):
        return nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed)), nnx.Param))

    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    return TinyPolicy(model, draw(0), draw(1), graphdef, state)
