"""Fine-tuning speed against a plain torch loop (docs/performance.md#fine-tuning-against-torch).

    pip install -e '.[test,parity]'
    python scripts/benchmark_finetune.py [--vocab 32768 512] [--modes full lora] [--steps 8]
        [--warmup 3] [--rounds 2] [--json OUT]
    python scripts/benchmark_finetune.py --quick       # a smoke test: tiny shapes, one round

A Qwen 3 architecture of width 512, 8 layers, 8 query and 4 key/value heads of 64, MLP 1,536 and
a tied vocabulary (--vocab: 32,768, and 512, where the projections are nearly all of the work),
fp32, AdamW at a constant rate, a global batch of 8 × 256 random tokens, the loss on every token,
one CPU device, in two modes:

    full    every parameter trains
    lora    rank-16 adapters (alpha 32, no dropout) on q, k, v, o, gate, up and down; the base
            frozen, in fp32 on both sides

Each side runs in a child process of its own, one after the other (meshtrain, then torch, for
each vocabulary and mode; --rounds times over), so that each meets the same machine:

    meshtrain   the step of `python run_training.py` with these overrides (scripts/bench/measure.py:
                the batch put on the device, the compiled update, waited for)
    torch       transformers' Qwen3ForCausalLM (sdpa attention), its loss from `labels`,
                backward, torch.optim.AdamW over the trainable parameters, zero_grad; with LoRA
                the same loop over peft.get_peft_model; torch.set_num_threads(cores)

A child times --steps steps after --warmup and reports their median; a side's number is the
median over the rounds. Tokens per second are 8 × 256 / the step time; the ratio is meshtrain's
tokens per second over torch's. Nothing here asserts a time: the quick form runs in CI as a
smoke test of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.common import REPO, child_env, compose, machine, progress, write_results

MODES = ("full", "lora")
SIDES = ("meshtrain", "torch")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LEARNING_RATE = 1e-4


def shape(quick: bool) -> dict[str, int]:
    """The model and batch: the issue's shape, or a tiny one for --quick."""
    if quick:
        return dict(
            d_model=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=128, batch=2, seq=32
        )
    return dict(d_model=512, layers=8, heads=8, kv_heads=4, head_dim=64, mlp=1536, batch=8, seq=256)


def meshtrain_overrides(vocab: int, mode: str, s: dict[str, int]) -> list[str]:
    overrides = [
        "model=qwen3_0_6b",
        f"model.d_model={s['d_model']}",
        f"model.num_layers={s['layers']}",
        f"model.num_heads={s['heads']}",
        f"model.num_kv_heads={s['kv_heads']}",
        f"model.head_dim={s['head_dim']}",
        f"model.mlp_dim={s['mlp']}",
        f"model.vocab_size={vocab}",
        "model.mesh_shape=[[1,1],[fsdp,tp]]",
        "data=synthetic",
        f"data.seq_len={s['seq']}",
        f"training.global_batch_size={s['batch']}",
        f"training.micro_batch_size={s['batch']}",
        "training.mixed_precision=fp32",
        f"training.learning_rate={LEARNING_RATE}",
        "training.warmup_steps=0",
        "training.lr_schedule=constant",
    ]
    if mode == "lora":
        overrides += ["model.lora.rank=16", "model.lora.alpha=32", "model.lora.base_dtype=compute"]
    return overrides


def _time_steps(step, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def meshtrain_child(vocab: int, mode: str, s: dict[str, int], warmup: int, steps: int) -> dict:
    import jax
    from bench.measure import MeshtrainStep

    step = MeshtrainStep(compose(meshtrain_overrides(vocab, mode, s)), jax.devices()[:1])
    return {"step_times_s": _time_steps(step, warmup, steps), "compile_s": step.compile_s}


def torch_child(vocab: int, mode: str, s: dict[str, int], warmup: int, steps: int) -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=s["d_model"],
        intermediate_size=s["mlp"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        max_position_embeddings=s["seq"],
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    model = Qwen3ForCausalLM(config).float().train()
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
        model = get_peft_model(model, lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LEARNING_RATE)
    tokens = torch.randint(0, vocab, (s["batch"], s["seq"]))

    def step() -> None:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {"step_times_s": _time_steps(step, warmup, steps)}


def run_child(side: str, vocab: int, mode: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", side, str(vocab), mode, str(out)]
        command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        command += ["--quick"] if args.quick else []
        env = {**child_env("W1"), "JAX_PLATFORMS": "cpu"}
        subprocess.run(command, env=env, cwd=REPO, check=True)
        return json.loads(out.read_text())


def summary(vocab: int, mode: str, runs: dict[str, list[dict]], s: dict[str, int]) -> dict:
    tokens = s["batch"] * s["seq"]
    row: dict = {"vocab": vocab, "mode": mode, "tokens_per_step": tokens}
    for side in SIDES:
        medians = [statistics.median(r["step_times_s"]) for r in runs[side]]
        row[side] = {
            "step_time_s": statistics.median(medians),
            "tokens_per_s": tokens / statistics.median(medians),
            "round_step_times_s": medians,
        }
    row["meshtrain_over_torch"] = row["meshtrain"]["tokens_per_s"] / row["torch"]["tokens_per_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", nargs="+", type=int, default=[32768, 512])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per child")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    parser.add_argument("--rounds", type=int, default=2, help="children per side and case")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 steps, one round")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.vocab, args.steps, args.warmup, args.rounds = [512], 2, 1, 1
    s = shape(args.quick)
    if args.child:
        side, vocab, mode, out = args.child
        child = meshtrain_child if side == "meshtrain" else torch_child
        Path(out).write_text(json.dumps(child(int(vocab), mode, s, args.warmup, args.steps)))
        return 0
    load_before = os.getloadavg()[0]
    runs = {(v, m): {side: [] for side in SIDES} for v in args.vocab for m in args.modes}
    for round_ in range(args.rounds):
        for (vocab, mode), sides in runs.items():
            for side in SIDES:
                progress(f"round {round_ + 1}/{args.rounds}: vocabulary {vocab}, {mode}, {side}")
                sides[side].append(run_child(side, vocab, mode, args))
    results = [summary(vocab, mode, sides, s) for (vocab, mode), sides in runs.items()]
    for row in results:
        print(
            f"vocabulary {row['vocab']:>6}, {row['mode']:<4}: meshtrain "
            f"{row['meshtrain']['tokens_per_s']:,.0f} tok/s "
            f"({row['meshtrain']['step_time_s']:.2f} s/step), torch "
            f"{row['torch']['tokens_per_s']:,.0f} tok/s ({row['torch']['step_time_s']:.2f} s/step)"
            f": {row['meshtrain_over_torch']:.2f}×"
        )
    by_case = {(r["vocab"], r["mode"]): r for r in results}
    for vocab in args.vocab:
        if (vocab, "full") in by_case and (vocab, "lora") in by_case:
            full, lora = by_case[vocab, "full"], by_case[vocab, "lora"]
            print(
                f"vocabulary {vocab:>6}: LoRA step / full step: meshtrain "
                f"{lora['meshtrain']['step_time_s'] / full['meshtrain']['step_time_s']:.2f}, torch "
                f"{lora['torch']['step_time_s'] / full['torch']['step_time_s']:.2f}"
            )
    if args.json:
        write_results(args.json, results, load_before)
    print(f"({machine()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
