"""Measures what model.remat and model.scan_layers buy: the activation memory XLA plans for one
gradient computation (per remat policy), and compile time against depth (with and without scan).

    python scripts/bench_memory_levers.py

Nothing is allocated for the model: the step is compiled from abstract shapes, and XLA's
memory_analysis() reports the temporary buffers it planned. Numbers go into docs/models.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.config import ModelConfig
from meshtrain.models.transformer import REMAT_POLICIES, Transformer

# A model big enough for activations to dominate: 8 layers of width 512, 1024-token sequences.
BASE = ModelConfig(
    vocab_size=384,
    d_model=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    mlp_dim=2048,
)


def compiled_gradient(cfg: ModelConfig, batch: int, seq_len: int):
    """The compiled (params, tokens) → (loss, grads) of `cfg`, and its compile time in seconds."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract)

    def loss(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))

    tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
    start = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()
    return compiled, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args()
    params = sum(
        x.size for x in jax.tree.leaves(nnx.eval_shape(lambda: Transformer(BASE, rngs=nnx.Rngs(0))))
    )
    print(
        f"model: {BASE.num_layers} layers, d_model {BASE.d_model}, {params / 1e6:.1f}M parameters; "
        f"batch {args.batch} × {args.seq_len} tokens; {jax.devices()[0].platform}"
    )
    print("| model.remat | temporary memory (MiB), scan_layers=false | scan_layers=true |")
    print("|---|---|---|")
    for remat in REMAT_POLICIES:
        temps = []
        for scan in (False, True):
            cfg = dataclasses.replace(BASE, remat=remat, scan_layers=scan)
            compiled, _ = compiled_gradient(cfg, args.batch, args.seq_len)
            temps.append(compiled.memory_analysis().temp_size_in_bytes / 2**20)
        print(f"| {remat} | {temps[0]:,.0f} | {temps[1]:,.0f} |")
    print()
    print("| num_layers | compile, scan_layers=false (s) | compile, scan_layers=true (s) |")
    print("|---|---|---|")
    for depth in (2, 8, 32):
        times = []
        for scan in (False, True):
            cfg = dataclasses.replace(BASE, num_layers=depth, scan_layers=scan)
            times.append(compiled_gradient(cfg, 1, 128)[1])
        print(f"| {depth} | {times[0]:.1f} | {times[1]:.1f} |")


if __name__ == "__main__":
    main()
