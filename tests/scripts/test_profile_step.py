"""scripts/profile_step.py's categories, on a compiled module whose products are one of each kind
(the profiled runs themselves are measurements: docs/performance.md)."""

import importlib.util
import sys

import jax
import jax.numpy as jnp
from helpers.paths import REPO

from meshtrain.observe.hlo import parse_module

spec = importlib.util.spec_from_file_location("profile_step", REPO / "scripts/profile_step.py")
profile_step = importlib.util.module_from_spec(spec)
sys.modules["profile_step"] = profile_step
spec.loader.exec_module(profile_step)

RANK, VOCAB = 4, 96


def test_each_product_gets_the_category_of_what_it_computes():
    def f(x, w, a, head, q, k):
        hidden = x @ w  # a projection: [8, 24] · [24, 40]
        low = x @ a  # an adapter: rank 4
        logits = hidden @ head  # the head: the vocabulary as a dimension
        scores = jnp.einsum("bqd,bkd->bqk", q, k)  # attention: batched over b
        return logits, low, scores

    shapes = [(8, 24), (24, 40), (24, RANK), (40, VOCAB), (2, 5, 6), (2, 7, 6)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    module = parse_module(jax.jit(f).lower(*args).compile().as_text())
    categories = profile_step.categorise(module, RANK, VOCAB)
    dots = [i for ops in module.computations.values() for i in ops if i.opcode == "dot"]
    assert sorted(categories[d.name] for d in dots) == [
        "adapters",
        "attention",
        "head and loss",
        "projections",
    ]
