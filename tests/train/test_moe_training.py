"""A mixture of experts in training (model.moe; the Qwen3-MoE family of tests/helpers/tiny_hf:
8 experts, 3 per token, from random weights): three steps give one device's losses, gradient
norms and auxiliary losses on ep, fsdp and tp meshes (1e-5); the auxiliary losses are added to
the objective's loss as model.moe's coefficients say and logged; capacity mode with room for
every token is dropless; a checkpoint's logits and greedy continuation on ep meshes are one
device's; what a mesh cannot hold is refused in one line."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_hf
from helpers.config import compose_config
from helpers.runs import train_tiny
from helpers.tiny_hf import SPECS

from meshtrain.config.validate import check_against_mesh
from meshtrain.errors import ConfigError
from meshtrain.inference.generate import generate_ids
from meshtrain.parallel.mesh import parse_mesh_shape
from meshtrain.weights.load import load_hf

MOE = (
    *SPECS["qwen3_moe"][1],
    "data=synthetic",
    "data.seq_len=32",
    "training.global_batch_size=8",
    "training.steps=3",
    "training.log_every=1",
    "training.warmup_steps=1",
    "training.eval_every=0",
    "model.moe.aux_loss_coef=0.01",
    "model.moe.z_loss_coef=0.001",
)
LOGGED = ("loss", "grad_norm", "moe/aux_loss", "moe/z_loss", "moe/load_min", "moe/load_max")


def _curves(result) -> np.ndarray:
    """[steps, LOGGED]: what each step logged."""
    return np.array([[h[name] for name in LOGGED] for h in result.history])


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return _curves(train_tiny(tmp_path_factory.mktemp("one"), *MOE, devices=1))


def test_the_auxiliary_losses_are_logged_and_added_to_the_loss(one_device, tmp_path):
    """Step 1 (the same weights): the loss with the coefficients is the next-token loss plus
    0.01 · aux + 0.001 · z; the load-balancing loss is near top_k = 3 for a fresh router (an
    even load gives exactly top_k), every expert takes some tokens and none all of them."""
    without = train_tiny(
        tmp_path,
        *MOE,
        "model.moe.aux_loss_coef=0.0",
        "model.moe.z_loss_coef=0.0",
        "training.steps=1",
        devices=1,
    )
    loss, _, aux, z, load_min, load_max = one_device[0]
    np.testing.assert_allclose(loss, without.history[0]["loss"] + 0.01 * aux + 0.001 * z, rtol=1e-6)
    assert 3.0 <= aux < 3.3
    assert z > 0
    assert 0.3 < load_min < 1.0 < load_max < 2.0
    assert without.history[0]["moe/dropped"] == 0


@pytest.mark.parametrize(
    "mesh",
    [
        "[[2,4],[ep,fsdp]]",
        pytest.param("[[2,2,2],[ep,fsdp,tp]]", marks=pytest.mark.slow),
        pytest.param("[[4,2],[ep,tp]]", marks=pytest.mark.slow),
        pytest.param("[[2,2,2],[ep,cp,fsdp]]", marks=pytest.mark.slow),
    ],
)
def test_any_mesh_with_ep_gives_the_losses_of_one_device(one_device, mesh, tmp_path):
    """And the plan counts an eighth of the experts per device: 2 layers × gate, up, down of
    8 experts [64, 32] in fp32, split 8 ways."""
    result = train_tiny(tmp_path, *MOE, f"model.mesh_shape={mesh}")
    np.testing.assert_allclose(_curves(result), one_device, rtol=1e-5)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["expert_bytes"] == 2 * 3 * 8 * 64 * 32 * 4 // 8


@pytest.mark.slow  # one run, 6 s
def test_capacity_mode_with_room_for_every_token_is_dropless(one_device, tmp_path):
    """capacity_factor = E / top_k: each expert may take every token of a micro-batch."""
    result = train_tiny(tmp_path, *MOE, "model.moe.capacity_factor=2.67")
    np.testing.assert_allclose(_curves(result), one_device, rtol=1e-5)
    assert [h["moe/dropped"] for h in result.history] == [0.0, 0.0, 0.0]


@pytest.mark.slow  # two runs, 12 s
def test_capacity_mode_drops_the_same_picks_on_ep_as_on_one_device(tmp_path):
    """capacity_factor = 1: picks drop, the same ones whether the experts are on one device or
    split over ep=2 (their buffers exchanged by all-to-all), so every logged number agrees."""
    capacity = (*MOE, "model.moe.capacity_factor=1.0")
    one = train_tiny(tmp_path / "one", *capacity, devices=1)
    split = train_tiny(tmp_path / "ep", *capacity, "model.mesh_shape=[[2,4],[ep,fsdp]]")
    np.testing.assert_allclose(_curves(split), _curves(one), rtol=1e-5)
    dropped = [h["moe/dropped"] for h in one.history]
    assert [h["moe/dropped"] for h in split.history] == dropped
    assert min(dropped) > 0


@pytest.mark.parametrize(
    ("model", "mesh", "message"),
    [
        (
            SPECS["qwen3_moe"][1],
            "[[3,2],[ep,fsdp]]",
            "ep=3 in model.mesh_shape does not divide model.moe.num_experts=8; use ep in "
            "{1, 2, 4, 8} (divisors of model.moe.num_experts=8)",
        ),
        (
            ("model=tiny",),
            "[[2,4],[ep,fsdp]]",
            "ep=2 in model.mesh_shape splits the experts of a mixture of experts, but model "
            "tiny has none (model.moe.num_experts=0); put those devices on dp or fsdp",
        ),
        (
            (*SPECS["qwen3_moe"][1], "model.moe.capacity_factor=1.5"),
            "[[2,4],[cp,fsdp]]",
            "model.moe.capacity_factor=1.5 counts each expert's capacity along whole sequences, "
            "which cp=2 in model.mesh_shape splits; set model.moe.capacity_factor=null (dropless) "
            "or put those devices on another axis",
        ),
        (
            SPECS["qwen3_moe"][1],
            "[[2,4],[pp,fsdp]]",
            "model.mesh_shape has pp=2, but the pipeline schedules do not carry a mixture of "
            "experts' auxiliary losses yet; put those devices on ep, fsdp or dp",
        ),
    ],
)
def test_what_a_mesh_cannot_hold_is_one_line(model, mesh, message):
    cfg = compose_config(*model, f"model.mesh_shape={mesh}", "training.global_batch_size=24")
    devices = 6 if mesh.startswith("[[3,2]") else 8
    with pytest.raises(ConfigError) as error:
        check_against_mesh(cfg, parse_mesh_shape(cfg.model.mesh_shape, devices))
    assert str(error.value) == message


@pytest.mark.slow  # 8 s each
@pytest.mark.parametrize("mesh", [[[2, 4], ["ep", "fsdp"]], [[2, 2, 2], ["ep", "fsdp", "tp"]]])
def test_a_mixture_of_experts_gives_one_devices_logits_and_decodes_on_ep(tmp_path, mesh):
    """The tiny Qwen3-MoE checkpoint loaded on an ep mesh: the logits of 2 rows and a greedy
    continuation of one (a decode step of a single row runs its experts unsplit) are one
    device's."""
    directory = tiny_hf.write_checkpoint("qwen3_moe", tmp_path / "hf")
    one, split = load_hf(directory), load_hf(directory, mesh)
    tokens = jnp.asarray(tiny_hf.TOKENS, jnp.int32)
    np.testing.assert_allclose(
        np.asarray(split(tokens)), np.asarray(one(tokens)), rtol=1e-5, atol=1e-5
    )
    prompt = [int(t) for t in tiny_hf.TOKENS[0, :8]]
    np.testing.assert_array_equal(generate_ids(split, prompt, 6), generate_ids(one, prompt, 6))


@pytest.mark.slow  # 2 runs, 20 s
def test_lora_and_qlora_on_the_experts_train_alike_on_ep(tmp_path):
    """Adapters on the attention and every expert (nf4 base, blocks of 16): a mesh of ep, fsdp
    and tp (each expert's hidden width, its adapters' and its quantised base's split over tp)
    gives one device's losses, gradient norms and auxiliary losses."""
    lora = ("model.lora.rank=4", "model.lora.base_dtype=nf4", "model.lora.quant_block=16")
    one = train_tiny(tmp_path / "one", *MOE, *lora, devices=1)
    split = train_tiny(tmp_path / "ep", *MOE, *lora, "model.mesh_shape=[[2,2,2],[ep,fsdp,tp]]")
    np.testing.assert_allclose(_curves(split), _curves(one), rtol=1e-5)


@pytest.mark.slow  # 30 steps, 25 s
def test_chat_fine_tuning_and_dpo_take_a_mixture_of_experts(tmp_path):
    """SFT on the shipped addition conversations with Qwen 3's chat template learns (the loss of
    the trained tokens falls by half in 30 steps) and logs the experts' metrics; so does DPO on
    the shipped pairs (its first step's loss is log 2: the policy is its reference)."""
    chat = (
        *MOE[:1],
        *(o for o in MOE[1:] if not o.startswith(("data=", "data.seq_len", "training.steps"))),
        "data=chat",
        "data.paths=[examples/chat/addition.jsonl]",
        "data.tokenizer=tests/fixtures/chat/qwen3",
        "data.seq_len=64",
        "training.steps=30",
        "training.learning_rate=3e-3",
        "training.log_every=10",
    )
    result = train_tiny(tmp_path, *chat, devices=1)
    losses = [h["loss"] for h in result.history]
    assert losses[-1] < 0.5 * losses[0]
    # top_k = 3 is the even load's value; a router whose probabilities lean away from the
    # experts that took more tokens gives a little less (2.999 at step 3 here).
    assert all(2.9 <= h["moe/aux_loss"] < 4.0 for h in result.history)
    dpo = train_tiny(
        tmp_path / "dpo",
        *(o for o in chat if not o.startswith(("data=", "data.paths", "training.steps"))),
        "objective=dpo",
        "data=preference",
        "data.paths=[examples/preference/pairs.jsonl]",
        "training.steps=2",
        devices=1,
    )
    first = dpo.history[0]
    np.testing.assert_allclose(
        first["loss"],
        np.log(2) + 0.01 * first["moe/aux_loss"] + 0.001 * first["moe/z_loss"],
        rtol=1e-5,
    )
