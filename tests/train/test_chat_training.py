"""Fine-tuning on chat data: the loss is the trained tokens' mean over the whole global batch,
whatever the mesh, accumulation or pipeline split, and equal to the loss computed by hand."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.config import compose_config
from helpers.paths import REPO
from helpers.runs import train_tiny

from meshtrain.data import BatchIterator
from meshtrain.data.chat.marks import DOCUMENT_START, NOT_TRAINED
from meshtrain.models.abstract import merge_model
from meshtrain.train.documents import DocumentBoundaries, TokenFormat
from meshtrain.train.optimizer import build_optimizer
from meshtrain.train.setup import prepare
from meshtrain.train.state import create_train_state, state_shardings

GEMMA = REPO / "tests" / "fixtures" / "chat" / "gemma3" / "tokenizer.json"


def test_flagged_tokens_give_the_mask_and_the_conversations():
    T, S = NOT_TRAINED, DOCUMENT_START
    tokens = jnp.asarray([[S | T | 5, T | 6, 7, 8, S | T | 9, T | 1, 2, T | 0, T | 0]])
    inputs, targets, mask, segment_ids, positions = TokenFormat(
        documents=DocumentBoundaries(-1, -1), flagged=True
    ).read(tokens)
    np.testing.assert_array_equal(inputs, [[5, 6, 7, 8, 9, 1, 2, 0]])
    np.testing.assert_array_equal(targets, [[6, 7, 8, 9, 1, 2, 0, 0]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 0, 0, 1, 0, 0]])
    np.testing.assert_array_equal(segment_ids, [[1, 1, 1, 1, 2, 2, 2, 2]])
    np.testing.assert_array_equal(positions, [[0, 1, 2, 3, 0, 1, 2, 3]])
    plain = TokenFormat(pad_id=0).read(jnp.asarray([[5, 6, 0, 0]]))
    np.testing.assert_array_equal(plain[2], [[1, 0, 0]])
    assert plain[3] is None


@pytest.fixture(scope="module")
def uneven_chats(tmp_path_factory):
    """Conversations of very different lengths and shares of trained tokens: long system
    prompts with one-word answers, and short prompts with long answers."""
    path = tmp_path_factory.mktemp("uneven") / "chats.jsonl"
    rng = np.random.default_rng(0)
    lines = []
    for i in range(64):
        words = " ".join(f"w{j}" for j in rng.integers(0, 99, rng.integers(1, 30)))
        long_prompt = i % 2 == 0
        messages = [
            {"role": "system", "content": words if long_prompt else "Be brief."},
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": "yes" if long_prompt else words},
        ]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _chat(chats):
    """The chat data, and the tiny model with the tokenizer's vocabulary."""
    return (
        "data=chat",
        f"data.paths=[{chats}]",
        f"data.tokenizer={GEMMA}",
        "data.cache_dir=null",
        "model.vocab_size=512",
        "data.seq_len=64",
    )


def _run(tmp_path, chats, mesh, micro, devices, *extra):
    result = train_tiny(
        tmp_path,
        *_chat(chats),
        f"model.mesh_shape={mesh}",
        f"training.micro_batch_size={micro}",
        "training.steps=2",
        "training.log_every=1",
        "training.eval_every=0",
        "checkpoint.every_steps=0",
        *extra,
        devices=devices,
    )
    return np.array([[h["loss"], h["grad_norm"]] for h in result.history])  # [steps, 2]


# (mesh, micro-batch, devices, extra): every case trains on the same global batch of 8.
SPLITS = [
    ("[[8,1],[fsdp,tp]]", 1, 8, ()),
    ("[[4,2],[fsdp,tp]]", 2, 8, ()),
    ("[[1,1],[fsdp,tp]]", 8, 1, ()),  # the whole batch at once
    pytest.param(
        "[[2,4],[pp,fsdp]]", 2, 8, ("training.pipeline.microbatches=2",), marks=pytest.mark.slow
    ),  # 20 s
]


@pytest.fixture(scope="module")
def one_device(uneven_chats, tmp_path_factory):
    """One device, the global batch of 8 in 4 micro-batches of 2: their trained tokens differ,
    so a loss averaged per micro-batch would not be the global batch's mean."""
    accumulation = ("training.gradient_accumulation_steps=4",)
    return _run(
        tmp_path_factory.mktemp("one"), uneven_chats, "[[1,1],[fsdp,tp]]", 2, 1, *accumulation
    )


@pytest.mark.parametrize(("mesh", "micro", "devices", "extra"), SPLITS)
@pytest.mark.slow
def test_the_loss_and_gradients_do_not_depend_on_the_split(
    uneven_chats, one_device, tmp_path, mesh, micro, devices, extra
):
    split = _run(tmp_path, uneven_chats, mesh, micro, devices, *extra)
    # Step 1: the loss and gradient norm at the same weights; step 2: after the same update.
    np.testing.assert_allclose(split, one_device, rtol=1e-6)


def test_the_loss_is_the_trained_tokens_mean_over_the_global_batch(uneven_chats, one_device):
    """The logged step-1 loss (of the one-device run, accumulated over 4 micro-batches) against
    one computed by hand from the model's logits: the sum of the trained targets' -log p over
    the global batch, divided by their number."""

    logged = one_device[0, 0]
    cfg = compose_config(*_chat(uneven_chats))
    setup = prepare(cfg, jax.devices()[:1])
    tx = build_optimizer(cfg.training)
    with jax.set_mesh(setup.mesh):
        state = create_train_state(
            cfg.model, tx, state_shardings(setup.model, tx, setup.mesh), cfg.training.seed
        )
    batch = next(
        BatchIterator(setup.train_data, global_batch=8, accum_steps=1, rows=slice(0, 8), seed=0)
    )[0]
    inputs, targets, mask, segment_ids, positions = setup.token_format.read(jnp.asarray(batch))
    with jax.set_mesh(setup.mesh):  # one compiled forward, not one program per operation
        logits = jax.jit(lambda p, *x: merge_model(setup.model, p)(*x))(
            state.params, inputs, positions, segment_ids
        )
    logits = logits.astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    by_hand = float(jnp.sum(nll * mask) / jnp.sum(mask))
    assert 0 < float(jnp.sum(mask)) < mask.size / 2  # most tokens are prompt and padding
    np.testing.assert_allclose(logged, by_hand, rtol=1e-5)
