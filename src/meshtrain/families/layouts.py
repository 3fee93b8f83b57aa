"""How a weight's Hugging Face tensor is laid out against meshtrain's parameter.

HF stores linear layers as [out_features, in_features] with heads flattened into one dimension;
meshtrain keeps heads as their own axis so that they can be sharded by name: q is [D, N, H]
where HF's q_proj.weight is [N*H, D]. A `Layout` says how to get from one to the other:
ours = transpose(reshape(hf, view), perm), where the view splits HF dimensions into groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Layout:
    """ours = hf.reshape(view).transpose(perm); view dimension perm[i] is our dimension i;
    HF dimension j is the view dimensions groups[j] flattened (outermost first)."""

    perm: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]

    def view_shape(self, shape: Sequence[int]) -> list[int]:
        view = [0] * len(shape)
        for ours, dim in zip(self.perm, shape, strict=True):
            view[ours] = dim
        return view

    def hf_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The HF tensor's shape for our parameter shape."""
        view = self.view_shape(shape)
        return tuple(math.prod(view[d] for d in group) for group in self.groups)

    def hf_slices(self, shape: Sequence[int], index: Sequence[slice]) -> list[slice]:
        """The smallest HF block holding our block `index`: for a flattened group, the whole
        rows of its outermost view dimension's range (contiguous in the file)."""
        view = self.view_shape(shape)
        view_index = self._view_index(shape, index)
        slices = []
        for group in self.groups:
            inner = math.prod(view[d] for d in group[1:])
            outer = view_index[group[0]]
            slices.append(slice(outer.start * inner, outer.stop * inner))
        return slices

    def _view_index(self, shape: Sequence[int], index: Sequence[slice]) -> list[slice]:
        view_index = [slice(None)] * len(shape)
        for ours, (dim, s) in enumerate(zip(shape, index, strict=True)):
            start, stop, _ = s.indices(dim)
            view_index[self.perm[ours]] = slice(start, stop)
        return view_index

    def to_ours(
        self, block: np.ndarray, shape: Sequence[int], index: Sequence[slice]
    ) -> np.ndarray:
        """Our block `index` from the HF block read with `hf_slices(shape, index)`."""
        view = self.view_shape(shape)
        view_index = self._view_index(shape, index)
        block_view, within = [], []
        for group in self.groups:
            outer = view_index[group[0]]
            block_view.append(outer.stop - outer.start)
            within.append(slice(None))
            for d in group[1:]:
                block_view.append(view[d])
                within.append(view_index[d])
        return block.reshape(block_view)[tuple(within)].transpose(self.perm)

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        """The whole HF tensor from our whole parameter."""
        view = array.transpose(np.argsort(self.perm))
        return view.reshape(self.hf_shape(array.shape))


COPY = {1: Layout((0,), ((0,),)), 2: Layout((0, 1), ((0,), (1,)))}
TRANSPOSE = Layout((1, 0), ((0,), (1,)))  # [out, in] → [in, out]
HEADS_IN = Layout((2, 0, 1), ((0, 1), (2,)))  # q/k/v_proj [N*H, D] → [D, N, H]
HEADS_OUT = Layout((1, 2, 0), ((0,), (1, 2)))  # o_proj [D, N*H] → [N, H, D]


@dataclass(frozen=True)
class PerExpert:
    """Our parameter [E, *rest] held by Hugging Face as E tensors, one per expert, named by the
    tensor map's name with `{expert}` replaced by the expert's index, each laid out as `inner`
    against our [*rest] (Qwen3-MoE's and Mixtral's checkpoints, as transformers writes them)."""

    inner: Layout

    def hf_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """One expert's HF tensor's shape for our parameter shape [E, *rest]."""
        return self.inner.hf_shape(shape[1:])


def expert_names(name: str, num_experts: int) -> list[str]:
    """The HF tensors of a PerExpert parameter: `name` with {expert} = 0 … E-1."""
    return [name.format(expert=e) for e in range(num_experts)]
