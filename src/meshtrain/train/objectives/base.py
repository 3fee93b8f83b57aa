"""What a train step minimises: an objective computes, from some rows of a batch, the sums its
loss and metrics are made of (train.gradients.Sums), and differentiates its loss.

The step (train.step) and the gradient paths (train.gradients: implicit and grouped
accumulation, dp grouping) know nothing of the loss itself: they add up the sums of every
micro-batch and device, and divide the loss sum by the count at the end, so the loss of an
update is the same on any split of its batch. An objective declares the pipeline schedules it
runs under (`schedules`); the others are refused in one line at start-up. Adding an objective:
its module here (a subclass of Objective, registered in train.objectives.OBJECTIVES), its config
file in configs/objective/ and its keys in config/objective.py (docs/architecture.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from meshtrain.config.moe import MoeConfig
from meshtrain.config.objective import ObjectiveConfig
from meshtrain.models.abstract import AbstractModel
from meshtrain.models.frozen import is_quantized
from meshtrain.models.lora import AdapterDropout
from meshtrain.models.routing import MOE_METRICS, MoeStats, auxiliary_losses
from meshtrain.models.transformer import default_positions
from meshtrain.parallel.context import context_layout, split_sequences
from meshtrain.train.documents import TokenFormat
from meshtrain.train.gradients import LossAndGrads, Sums
from meshtrain.train.pipeline_plan import PipelinePlan


@dataclass(frozen=True)
class StepInputs:
    """What every objective reads besides the parameters: how the rows are laid out and the
    compute dtype and pipeline of the step."""

    token_format: TokenFormat
    compute_dtype: jnp.dtype
    pipeline: PipelinePlan | None = None
    moe: MoeConfig | None = None  # the model's mixture of experts: its auxiliary losses
    completions_per_row: int = 1  # a policy-gradient run's rows: completions each (rl.rows)


def cast_params(model: AbstractModel, params: Any, compute_dtype: jnp.dtype) -> Any:
    """The fp32 master weights in the compute dtype, cast where they are stored: each cast is
    pinned to its parameter's sharding, so FSDP all-gathers move compute-dtype bytes (half of
    fp32 in bf16), not fp32 ones cast after the gather."""

    def cast(param: Any, sharding: jax.sharding.NamedSharding) -> Any:
        if is_quantized(param):  # QLoRA: dequantised to the compute dtype where it is read
            return param.astype(compute_dtype)
        if param.dtype == compute_dtype:
            return param
        return jax.lax.with_sharding_constraint(param.astype(compute_dtype), sharding)

    return jax.tree.map(cast, params, model.param_shardings, is_leaf=is_quantized)


def read_in_layout(
    token_format: TokenFormat, tokens: jax.Array, rules: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """token_format.read(tokens), and under a mesh that splits sequences over cp, the five
    arrays in the context layout (meshtrain.parallel.context), positions included: segment
    ids and positions are read from the tokens in sequence order first."""
    inputs, targets, mask, segment_ids, positions = token_format.read(tokens)
    if context_layout(inputs.shape[1], rules) is None:
        return inputs, targets, mask, segment_ids, positions
    positions = default_positions(inputs) if positions is None else positions
    return split_sequences(rules, inputs, targets, mask, segment_ids, positions)


class Objective(ABC):
    """A loss and its metrics; see the module docstring."""

    name: ClassVar[str]
    schedules: ClassVar[frozenset[str]] = frozenset()  # pipeline schedules it runs under
    context_parallel: ClassVar[bool] = False  # runs with sequences split over cp
    perplexity: ClassVar[bool] = False  # its loss is a mean next-token loss (val_perplexity)
    reads_reference: bool = False  # reads a frozen reference model (train.state's `frozen`)
    metric_names: ClassVar[tuple[str, ...]] = ()  # its own metrics, in the order they are logged

    def __init__(self, inputs: StepInputs, cfg: ObjectiveConfig | None = None) -> None:
        self.inputs, self.cfg = inputs, cfg or ObjectiveConfig()

    def row_width(self, seq_len: int) -> int:
        """The int32 columns of its rows: seq_len + 1 tokens, or more where a row carries more
        (the reference's log-probabilities; a rollout's completions and advantages)."""
        return seq_len + 1

    @abstractmethod
    def sums(
        self,
        model: AbstractModel,
        params: Any,
        rows: Any,
        frozen: Any,
        dropout: AdapterDropout | None = None,
    ) -> Sums:
        """The sums of `rows` (tokens [B, seq_len + 1] or a tuple of arrays [B, ...]): "loss"
        (differentiable with respect to `params`, the trainable parameters), "count", and the
        metrics' own sums. `frozen`: what the loss reads but does not train (a LoRA run's base),
        or None; `dropout`: the LoRA adapters' (training only)."""

    def loss_and_grads(self, model: AbstractModel) -> LossAndGrads:
        """(params, rows, frozen) → (sums, gradients of the summed loss w.r.t. params)."""

        def loss(params: Any, rows: Any, frozen: Any) -> tuple[jax.Array, Sums]:
            tokens, keys = rows if isinstance(rows, tuple) else (rows, None)
            dropout = None if keys is None else AdapterDropout(keys)
            sums = self.sums(model, params, tokens, frozen, dropout)
            return sums["loss"], sums

        # Differentiated with respect to the trainable parameters only: a LoRA run's frozen
        # base gets no gradient computed at all.
        value_and_grad = jax.value_and_grad(loss, has_aux=True)

        def loss_and_grads(params: Any, rows: Any, frozen: Any) -> tuple[Sums, Any]:
            (_, sums), grads = value_and_grad(params, rows, frozen)
            return sums, grads

        return loss_and_grads

    def metrics(self, sums: Sums) -> dict[str, Any]:
        """The logged metrics of an update (or a validation pass) from its summed sums, whose
        "count" the caller has raised to at least 1: "loss" (the loss sum over the count), then
        the objective's own, in the order they are logged, then a mixture of experts' (each
        averaged as the loss is). Plain arithmetic, so that the same code runs on the devices
        (jax arrays, in the step) and on the host (float64 numpy)."""
        auxiliary = {name: sums[name] / sums["count"] for name in MOE_METRICS if name in sums}
        return {"loss": sums["loss"] / sums["count"], **auxiliary}

    @property
    def logged_names(self) -> tuple[str, ...]:
        """Its metrics and a mixture of experts', in the order they are logged."""
        return (*self.metric_names, *(MOE_METRICS if self.inputs.moe is not None else ()))

    def with_auxiliary(self, sums: Sums, stats: MoeStats | None) -> Sums:
        """`sums` with the model's auxiliary losses (a mixture of experts': load balance and
        router z-loss, models.routing.auxiliary_losses, from its routing statistics; none where
        `stats` is None) added to the loss, and their metrics: each weighted by the count, so
        that the loss of an update is the objective's mean plus the auxiliary losses averaged
        over its micro-batches as the objective's count weighs them, on any split of the
        batch."""
        if stats is None:
            return sums
        weighted = {
            name: value * sums["count"]
            for name, value in auxiliary_losses(stats, self.inputs.moe).items()
        }
        return {**sums, "loss": sums["loss"] + weighted.pop("loss"), **weighted}
