"""Tiny random-weight Hugging Face checkpoints of each family, and transformers' own numbers for
them, with no torch: the weights come from numpy with a fixed seed, and the reference numbers
were computed by transformers and committed under tests/fixtures/hf/ (made by
tests/fixtures/hf/make_fixtures.py; tests/hf/test_interop_live.py, marked slow, recomputes them
with transformers and compares).

Each is the family's real model config (configs/model/*.yaml) shrunk to hidden 64 and vocab 512
(the mixtures of experts to 8 experts of width 32, 3 per token, and 4 of width 128, 2 per token);
the Gemma one has 7 layers (5 local with a 16-token window, 1 global, 1 local), so sequences of
40 tokens cross the window; its global layers use linear RoPE scaling like Gemma 3 4B-27B, and
its attention scale 1/sqrt(24) is not 1/sqrt(head_dim), like Gemma 3 27B's.

fixtures/hf/<family>/: config.json and tensors.json (each safetensors file of the checkpoint
with its tensors' names and shapes, as save_pretrained wrote them) and reference.npz.
fixtures/hf/inputs.json: a fingerprint of what transformers was given (fingerprint), so that a
default test can tell stale fixtures from a meshtrain bug without torch.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from helpers.config import compose_config
from helpers.paths import REPO
from meshtrain.config import Config

# The bound of every fp32 logit comparison with transformers and its measure (the tests read
# them here).
from meshtrain.hf.parity import LOGIT_TOLERANCE, relative_error  # noqa: F401

VOCAB = 512
SEQ_LEN = 40
FIXTURES = REPO / "tests" / "fixtures" / "hf"
# The tokens of the logit comparisons: [2, SEQ_LEN], longer than Gemma's window.
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, SEQ_LEN))
# Greedy generation from the Llama checkpoint with helpers.tiny_tokenizers.train_bpe's tokenizer
# of at most VOCAB tokens (tests/inference/test_generate.py).
PROMPT = "def function_5(value):"
NEW_TOKENS = 12
_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
_SHRINK = (
    f"model.vocab_size={VOCAB}",
    "model.d_model=64",
    "model.mlp_dim=128",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.head_dim=16",
    "model.max_seq_len=256",
)
# family → (HF config in the published key format, meshtrain overrides)
SPECS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "llama": (
        dict(
            model_type="llama",
            num_hidden_layers=3,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=128,
            ),
            **_SHAPE,
        ),
        (
            "model=llama3_8b",
            *_SHRINK,
            "model.num_layers=3",
            "model.rope_original_max_len=128",
            "model.rope_scaling_factor=32.0",
        ),
    ),
    "qwen3": (
        dict(
            model_type="qwen3",
            num_hidden_layers=3,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            **_SHAPE,
        ),
        ("model=qwen3_0_6b", *_SHRINK, "model.num_layers=3"),
    ),
    "gemma3": (
        dict(
            model_type="gemma3_text",
            num_hidden_layers=7,
            sliding_window=16,
            query_pre_attn_scalar=24,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rope_scaling=dict(rope_type="linear", factor=8.0),
            **_SHAPE,
        ),
        (
            "model=gemma3_4b",
            *_SHRINK,
            "model.num_layers=7",
            "model.sliding_window=16",
            "model.query_pre_attn_scalar=24",
        ),
    ),
    "qwen3_moe": (
        dict(
            model_type="qwen3_moe",
            num_hidden_layers=2,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            **_SHAPE,
        ),
        (
            "model=qwen3_30b_a3b",
            *_SHRINK,
            "model.num_layers=2",
            "model.moe.num_experts=8",
            "model.moe.top_k=3",
            "model.moe.expert_dim=32",
            "model.moe.normalize_top_k=false",
            "model.moe.aux_loss_coef=0.0",  # transformers adds it only with output_router_logits
        ),
    ),
    "mixtral": (
        dict(
            model_type="mixtral",
            num_hidden_layers=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            num_local_experts=4,
            num_experts_per_tok=2,
            **_SHAPE,
        ),
        (
            "model=mixtral_8x7b",
            *_SHRINK,
            "model.num_layers=2",
            "model.moe.num_experts=4",
            "model.moe.expert_dim=128",
            "model.moe.aux_loss_coef=0.0",
        ),
    ),
}
FAMILIES = tuple(SPECS)


def weights(family: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors by Hugging Face name, from numpy's generator seeded by the
    family: 1-D ones (norms) around 1, or around 0 for Gemma's 1 + w, so that a misplaced or
    swapped tensor changes the logits; the others 0.08 × N(0, 1)."""
    rng = np.random.default_rng([0, FAMILIES.index(family)])
    layout = json.loads((FIXTURES / family / "tensors.json").read_text())
    tensors = {}
    for _, entries in layout.items():
        for name, shape in entries:
            noise = rng.standard_normal(shape, dtype=np.float32)
            if len(shape) == 1:
                tensors[name] = (0.0 if family == "gemma3" else 1.0) + 0.2 * noise
            else:
                tensors[name] = 0.08 * noise
    return tensors


def write_checkpoint(family: str, directory: Path) -> Path:
    """The family's checkpoint in `directory`, as save_pretrained wrote it (Gemma's in several
    files with a model.safetensors.index.json)."""
    directory.mkdir(parents=True, exist_ok=True)
    source = FIXTURES / family
    layout = json.loads((source / "tensors.json").read_text())
    tensors = weights(family)
    for file, entries in layout.items():
        save_file({name: tensors[name] for name, _ in entries}, directory / file)
    for extra in ("config.json", "model.safetensors.index.json"):
        if (source / extra).is_file():
            shutil.copyfile(source / extra, directory / extra)
    return directory


def reference(family: str) -> dict[str, np.ndarray]:
    """transformers' numbers for the family's checkpoint: `logits` [2, SEQ_LEN, VOCAB] of
    TOKENS (and `logits_reversed` of TOKENS[:, ::-1]), and `loss` and `grad_norm` on the batch
    of step 1 of run_config's run (step_one_batch); for Llama also `prompt_ids` ([bos] + PROMPT
    in train_bpe's tokenizer) and `greedy_ids`, the NEW_TOKENS ids its
    generate(do_sample=False) picks after them."""
    with np.load(FIXTURES / family / "reference.npz") as data:
        return dict(data)


def fingerprint(family: str) -> dict:
    """What transformers was given for reference(family): moments of the weights (compared with
    a tolerance: numpy's float32 normals may differ by an ulp between C libraries, and then the
    fixtures still hold) and sha256 of the integer inputs (TOKENS, step_one_batch)."""
    flat = np.concatenate([w.ravel() for w in weights(family).values()]).astype(np.float64)
    ramp = np.arange(flat.size) % 1000 / 1000  # a permuted or shifted stream changes this one
    cfg = run_config(
        family, Path("unused"), *STEP_ONE, f"training.micro_batch_size={STEP_ONE_BATCH}"
    )
    return {
        "weights": [float(flat.sum()), float((flat**2).sum()), float((flat * ramp).sum())],
        "tokens": hashlib.sha256(TOKENS.astype("<i8").tobytes()).hexdigest(),
        "step_one_batch": hashlib.sha256(step_one_batch(cfg).astype("<i8").tobytes()).hexdigest(),
    }


def overrides(family: str, directory: Path) -> tuple[str, ...]:
    return (*SPECS[family][1], f"model.init_from=hf:{directory}")


def run_config(family: str, directory: Path, *extra: str) -> Config:
    """A one-device run on synthetic data of SEQ_LEN tokens from the checkpoint in `directory`."""
    return compose_config(
        *overrides(family, directory),
        "data=synthetic",
        f"data.seq_len={SEQ_LEN}",
        "model.mesh_shape=[[1,1],[fsdp,tp]]",
        *extra,
    )


STEP_ONE = ("training.steps=1", "training.warmup_steps=1", "training.eval_every=0")
STEP_ONE_BATCH = 4  # training.micro_batch_size of the one-step runs


def step_one_batch(cfg: Config) -> np.ndarray:
    """[STEP_ONE_BATCH, SEQ_LEN + 1]: the batch of step 1 of a run of `cfg`, as its iterator
    produces it."""
    from meshtrain.data import BatchIterator, build_dataset

    data = build_dataset(cfg.data, split="train", vocab_size=cfg.model.vocab_size)
    iterator = BatchIterator(
        data,
        global_batch=STEP_ONE_BATCH,
        accum_steps=1,
        rows=slice(0, STEP_ONE_BATCH),
        seed=cfg.training.seed,
    )
    return next(iterator)[0]
