"""DPO's step against trl's DPOTrainer on the same CPU, model and pairs, back to back
(docs/performance.md#preference-optimisation-against-trl).

    python scripts/benchmark_preference.py [--modes two-model precomputed lora] [--steps 10]
        [--warmup 3] [--hidden 256] [--layers 4] [--seq-len 255] [--rows 8] [--unshared-prompt]
        [--json OUT]

The model: a Qwen 3 (QK-norm, GQA, SwiGLU, tied embeddings) of --hidden width and --layers
layers with random weights, written with transformers' save_pretrained; the Qwen 3 chat
tokenizer of tests/fixtures/chat/qwen3 (512 ids). The pairs: 256 addition prompts with a
right and a wrong answer, each with a sentence around it, rendered by the chat template (about
85 tokens a sequence, 170 a pair with the prompt twice). trl: 8 pairs a step, each batch padded
to its longest sequence. meshtrain: --rows rows of --seq-len + 1 tokens, pairs packed whole by
first fit with the prompt once (about 127 tokens a pair, 1.8 pairs to a row of 256, 14.7 a step;
with --unshared-prompt the prompt twice, as trl, about one pair to a row). Both: sigmoid DPO with
beta 0.1, AdamW at a constant learning rate, fp32 on the CPU, 2 threads.

Modes: two-model (full weights; the reference is a frozen copy of the starting weights: trl's
ref_model, meshtrain's objective.reference=initial), precomputed (the same reference, its
log-probabilities computed once before the first step: trl's precompute_ref_log_probs=True,
meshtrain's objective.reference=precomputed; the steps run the policy alone) and lora (rank 16,
alpha 32 on q, k, v, o, gate, up, down; the reference is the base with the adapters off on both
sides). Each side runs in a child process of its own, so its peak resident memory (os.wait4's
ru_maxrss) is its own.

A step's time is the median of the timed steps after the warm-up (meshtrain: its logged
step_time_s; trl: the time between its callback's step ends). meshtrain packs pairs whole into
rows of --seq-len + 1 tokens, often more than one to a row; the comparison is therefore in
pairs per second (and tokens per second: pairs/s × the pairs' mean length), not steps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "tests" / "fixtures" / "chat" / "qwen3"
PAIRS = 256
BATCH = 8  # trl's pairs per step
BETA = 0.1
LEARNING_RATE = 1e-5
LORA = {"rank": 16, "alpha": 32}
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WORDS = [
    "the",
    "answer",
    "to",
    "this",
    "sum",
    "is",
    "written",
    "here",
    "in",
    "digits",
    "as",
    "asked",
]


def write_model(directory: Path, hidden: int, layers: int) -> None:
    """A random Qwen 3 of this size with the chat tokenizer, as save_pretrained writes it."""
    import shutil

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        max_position_embeddings=1024,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    Qwen3ForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, directory / name)


def timed_run(work: Path, args: argparse.Namespace, name: str, *task: str):
    """train() of write_model's checkpoint in work/model, in this process on one device, with
    `task`'s data and objective overrides: args.warmup + args.steps steps at a constant learning
    rate, a record each step, nothing saved; its RunResult (the GRPO benchmark runs it too)."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    sys.path.insert(0, str(REPO / "src"))
    from meshtrain.config.hydra import compose_config
    from meshtrain.train.loop import train

    hidden = args.hidden
    overrides = [
        "model=qwen3_0_6b",
        "model.vocab_size=512",
        f"model.d_model={hidden}",
        f"model.num_layers={args.layers}",
        f"model.num_heads={hidden // 64}",
        f"model.num_kv_heads={max(1, hidden // 128)}",
        "model.head_dim=64",
        f"model.mlp_dim={3 * hidden}",
        "model.max_seq_len=1024",
        "model.mesh_shape=[[1,1],[fsdp,tp]]",
        f"model.init_from=hf:{work / 'model'}",
        f"data.tokenizer={work / 'model'}",
        *task,
        f"training.steps={args.warmup + args.steps}",
        f"training.learning_rate={LEARNING_RATE}",
        "training.lr_schedule=constant",
        "training.warmup_steps=0",
        "training.log_every=1",
        "training.eval_every=0",
        "checkpoint.every_steps=0",
        f"checkpoint.dir={work / f'checkpoints-{name}'}",
        "logging.trackers=[]",
    ]
    return train(compose_config(*overrides), work / f"run-{name}")


def write_pairs(path: Path) -> None:
    """PAIRS conversational pairs (trl's prompt/chosen/rejected message lists)."""
    rng = random.Random(0)
    lines = []
    for _ in range(PAIRS):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        wrong = a + b + rng.choice([-10, -1, 1, 10])
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
        lines.append(
            {
                "prompt": [{"role": "user", "content": f"{words}: {a}+{b}="}],
                "chosen": [{"role": "assistant", "content": f"{a + b}, {words}."}],
                "rejected": [{"role": "assistant", "content": f"{wrong}, {words}."}],
            }
        )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def meshtrain_child(args: argparse.Namespace) -> dict:
    """The DPO run of `python run_training.py` in this process; its timed steps."""
    work = Path(args.work)
    overrides = [
        "data=preference",
        f"data.paths=[{work / 'pairs.jsonl'}]",
        f"data.seq_len={args.seq_len}",
        "data.validation_fraction=0",
        "objective=dpo",
        f"objective.beta={BETA}",
        f"training.global_batch_size={args.rows}",
        f"data.shared_prompt={not args.unshared_prompt}",
    ]
    if args.mode == "lora":
        overrides += [f"model.lora.rank={LORA['rank']}", f"model.lora.alpha={LORA['alpha']}"]
    if args.mode == "precomputed":
        overrides += ["objective.reference=precomputed", "data.cache_dir=null"]  # scored here
    result = timed_run(work, args, args.mode, *overrides)
    data = result.setup.train_data
    times = [h["step_time_s"] for h in result.history if h["step"] > args.warmup]
    pairs_per_row = data.num_documents / len(data)
    return {"step_s": statistics.median(times), "pairs_per_step": args.rows * pairs_per_row}


def trl_child(args: argparse.Namespace) -> dict:
    """trl's DPOTrainer on the same model and pairs; its timed steps."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    work = Path(args.work)
    ends: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    peft_config = None
    if args.mode == "lora":
        import peft

        peft_config = peft.LoraConfig(
            r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=PROJECTIONS
        )
    pairs = [json.loads(line) for line in (work / "pairs.jsonl").read_text().splitlines()]
    trainer = DPOTrainer(
        model=model,
        args=DPOConfig(
            output_dir=str(work / f"trl-{args.mode}"),
            per_device_train_batch_size=BATCH,
            learning_rate=LEARNING_RATE,
            beta=BETA,
            max_steps=args.warmup + args.steps,
            lr_scheduler_type="constant",
            warmup_steps=0,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            bf16=False,
            save_strategy="no",
            max_length=args.seq_len + 1,
            dataloader_num_workers=0,
            gradient_checkpointing=False,  # as meshtrain's default (model.remat=none)
            precompute_ref_log_probs=args.mode == "precomputed",
        ),
        train_dataset=Dataset.from_list(pairs),
        processing_class=AutoTokenizer.from_pretrained(work / "model"),
        peft_config=peft_config,
        callbacks=[StepTimes()],
    )
    trainer.train()
    times = [b - a for a, b in zip(ends[args.warmup - 1 : -1], ends[args.warmup :], strict=True)]
    return {"step_s": statistics.median(times), "pairs_per_step": float(BATCH)}


def run_child(side: str, mode: str, args: argparse.Namespace) -> dict:
    """One side in a child process: its numbers and its peak resident memory."""
    command = [sys.executable, __file__, "--child", side, "--mode", mode, "--work", args.work]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    command += ["--hidden", str(args.hidden), "--layers", str(args.layers)]
    command += ["--seq-len", str(args.seq_len), "--rows", str(args.rows)]
    command += ["--unshared-prompt"] if args.unshared_prompt else []
    return run_in_child(command, Path(args.work) / f"{side}-{mode}.json")


def run_in_child(command: list[str], out: Path) -> dict:
    """Runs `command --child-out OUT`: the json it writes there, with its peak resident memory
    (os.wait4's ru_maxrss, the child's own)."""
    child = subprocess.Popen([*command, "--child-out", str(out)], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    if status != 0:
        raise SystemExit(f"failed (status {status}): {' '.join(command)}")
    result = json.loads(out.read_text())
    result["peak_rss_gib"] = usage.ru_maxrss / 2**20  # KiB on Linux
    return result


def mean_pair_tokens(work: Path, seq_len: int) -> float:
    """The pairs' mean length in tokens, both sequences with the prompt twice, as trl feeds them
    (data.shared_prompt=false)."""
    sys.path.insert(0, str(REPO / "src"))
    from meshtrain.data.chat.records import preference_options_for
    from meshtrain.data.corpus_cache import tokenised_corpus

    options = preference_options_for(
        str(work / "model"),
        chat_template=None,
        prompt_key="prompt",
        chosen_key="chosen",
        rejected_key="rejected",
        shared_prompt=False,
    )
    corpus = tokenised_corpus(
        [work / "pairs.jsonl"],
        work,
        tokenizer=str(work / "model"),
        text_key="text",
        on_bad_record="error",
        directory=work / "cache",
        verify="quick",
        chat=options,
    )
    return corpus.num_tokens / corpus.num_documents


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["two-model", "precomputed", "lora"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=255, help="meshtrain's rows: + 1 tokens")
    parser.add_argument(
        "--rows", type=int, default=8, help="meshtrain's rows per step (a row of 256: ~1.8 pairs)"
    )
    parser.add_argument(
        "--unshared-prompt",
        action="store_true",
        help="meshtrain stores each pair as prompt + chosen, prompt + rejected "
        "(data.shared_prompt=false)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", choices=["meshtrain", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        measured = meshtrain_child(args) if args.child == "meshtrain" else trl_child(args)
        Path(args.child_out).write_text(json.dumps(measured))
        return
    with tempfile.TemporaryDirectory(prefix="meshtrain-dpo-bench-") as work:
        args.work = work
        write_model(Path(work) / "model", args.hidden, args.layers)
        write_pairs(Path(work) / "pairs.jsonl")
        tokens = mean_pair_tokens(Path(work), args.seq_len)
        print(f"load average {os.getloadavg()[0]:.2f}; pairs of {tokens:.1f} tokens on average")
        results = []
        for mode in args.modes:
            row = {"mode": mode}
            for side in ("meshtrain", "trl"):
                got = run_child(side, mode, args)
                pairs_s = got["pairs_per_step"] / got["step_s"]
                row[side] = {**got, "pairs_per_s": pairs_s, "tokens_per_s": pairs_s * tokens}
            row["ratio"] = row["meshtrain"]["pairs_per_s"] / row["trl"]["pairs_per_s"]
            results.append(row)
            m, t = row["meshtrain"], row["trl"]
            print(
                f"{mode}: meshtrain {m['tokens_per_s']:,.0f} tok/s ({m['step_s']:.3f} s/step, "
                f"{m['pairs_per_step']:.1f} pairs), peak {m['peak_rss_gib']:.2f} GiB | trl "
                f"{t['tokens_per_s']:,.0f} tok/s ({t['step_s']:.3f} s/step), peak "
                f"{t['peak_rss_gib']:.2f} GiB | {row['ratio']:.2f}x"
            )
        by_mode = {row["mode"]: row for row in results}
        if {"two-model", "precomputed"} <= set(by_mode):
            for side in ("meshtrain", "trl"):
                speedup = (
                    by_mode["precomputed"][side]["pairs_per_s"]
                    / by_mode["two-model"][side]["pairs_per_s"]
                )
                by_mode["precomputed"][f"{side}_over_two_model"] = speedup
                print(f"{side}: precomputed reference {speedup:.2f}x the two-model step")
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
