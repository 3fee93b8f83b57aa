"""W4: llama3_1b and gemma3_1b in bf16 at sequence 4096 on one GPU, at the micro-batch that
fits best."""

from __future__ import annotations

import argparse
from typing import Any

from bench.common import (
    W4_MICRO_BATCHES,
    W4_MODELS,
    W4_SEQ_LEN,
    compose,
    progress,
    steps_of,
)
from bench.measure import measure


def fits(cfg, devices) -> bool:
    """Whether the compiled step of `cfg` fits the device's memory (XLA's plan)."""
    import jax

    from meshtrain.train.compilation import compile_train_step
    from meshtrain.train.optimizer import build_optimizer
    from meshtrain.train.setup import prepare
    from meshtrain.train.state import state_shardings

    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    setup = prepare(cfg, devices)
    tx = build_optimizer(cfg.training)
    shardings = state_shardings(setup.model, tx, setup.mesh)
    try:
        with jax.set_mesh(setup.mesh):
            compiled, _ = compile_train_step(setup, tx, shardings)
    except Exception as err:  # XLA reports a step that cannot fit as a compile error
        progress(f"  does not compile: {str(err).splitlines()[0][:200]}")
        return False
    a = compiled.memory_analysis()
    need = a.argument_size_in_bytes + a.output_size_in_bytes - a.alias_size_in_bytes
    need += a.temp_size_in_bytes
    progress(f"  needs {need / 2**30:.1f} GiB of {(limit or 0) / 2**30:.1f} GiB")
    return limit is None or need <= limit


def run_w4(args: argparse.Namespace, devices) -> list[dict[str, Any]]:
    results = []
    warmup, timed = steps_of("W4", args)
    for name in args.model or W4_MODELS:
        base = [
            f"model={name}",
            "data=synthetic",
            f"data.seq_len={W4_SEQ_LEN}",
            "training.mixed_precision=bf16",
            'model.mesh_shape=[[1,1],["fsdp","tp"]]',
            *args.override,
        ]
        candidates = [args.micro_batch] if args.micro_batch else W4_MICRO_BATCHES
        best = None
        for micro in candidates:
            overrides = [*base, f"training.micro_batch_size={micro}"]
            progress(f"W4 {name}: micro-batch {micro}")
            if not args.micro_batch and not fits(compose(overrides), devices):
                break
            try:
                result = measure("W4", overrides, devices[:1], (warmup, timed), reference=False)
            except Exception as err:  # out of memory at run time
                progress(f"  failed: {str(err).splitlines()[0][:200]}")
                break
            spec = f", {result['mfu_spec']:.1%} of the data sheet" if "mfu_spec" in result else ""
            progress(f"  {result['tokens_per_sec']:,.0f} tokens/s, MFU {result['mfu']:.1%}{spec}")
            if best is None or result["tokens_per_sec"] > best["tokens_per_sec"]:
                best = result
        if best is not None:
            results.append(best)
    return results
