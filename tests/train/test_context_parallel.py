"""Context parallelism in training: with the sequence split over cp = 2, 4 or 8 (with fsdp, tp
and dp), the loss and every gradient are those of one device (1e-5 relative), for Llama 3 and
Gemma 3 (mixed local and global layers, one key/value head) on packed multi-document batches and
plain causal ones; runs with accumulation, remat and scanned layers give the same losses, and a
checkpoint moves between cp and non-cp meshes; what cp cannot serve is refused in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.config import compose_config
from helpers.runs import train_tiny
from helpers.tiny_hf import SPECS

from meshtrain.config.validate import check_against_mesh
from meshtrain.data import BatchIterator
from meshtrain.errors import ConfigError
from meshtrain.parallel.mesh import parse_mesh_shape
from meshtrain.train.objectives.next_token import token_loss_sum
from meshtrain.train.optimizer import build_optimizer
from meshtrain.train.setup import prepare
from meshtrain.train.state import create_train_state, state_shardings

# The tiny Hugging Face shapes of tests/helpers/tiny_hf: Llama 3 (GQA 4:2; here 1 layer of its 3,
# each layer being the same cp attention and MLP: every kind of parameter, and the gradients
# through attention back to the embeddings) and Gemma 3 (7 layers, 5 local with a window of 16
# and 2 global, here with a single key/value head).
FAMILIES = {
    "llama": (*SPECS["llama"][1], "model.num_layers=1"),
    "gemma3": (*SPECS["gemma3"][1], "model.num_kv_heads=1", "model.scan_layers=true"),
}
TEXT = ("data.seq_len=128",)  # the standard library's source, packed: documents masked
PLAIN = ("data=synthetic", "data.seq_len=128")  # random tokens: plain causal attention
GLOBAL_BATCH = 8


def _loss_and_grads(family: str, data: tuple[str, ...], mesh: str, devices: int):
    cfg = compose_config(
        *FAMILIES[family],
        *data,
        f"model.mesh_shape={mesh}",
        f"training.global_batch_size={GLOBAL_BATCH}",
    )
    setup = prepare(cfg, jax.devices()[:devices])
    tx = build_optimizer(cfg.training)
    batch = next(
        BatchIterator(
            setup.train_data, global_batch=GLOBAL_BATCH, accum_steps=1, rows=slice(0, 8), seed=0
        )
    )[0]

    def loss(params, tokens):
        total, count, _ = token_loss_sum(  # no routing statistics: a dense model
            setup.model, params, tokens, token_format=setup.token_format, compute_dtype=jnp.float32
        )
        return total, count

    with jax.set_mesh(setup.mesh):
        state = create_train_state(
            cfg.model, tx, state_shardings(setup.model, tx, setup.mesh), cfg.training.seed
        )
        (loss_sum, count), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
            state.params, jnp.asarray(batch)
        )
    return float(loss_sum) / float(count), jax.device_get(grads)


@pytest.fixture(scope="module")
def one_device():
    cache = {}

    def reference(family, data):
        if (family, data) not in cache:
            cache[family, data] = _loss_and_grads(family, data, "[[1,1],[fsdp,tp]]", 1)
        return cache[family, data]

    return reference


CASES = [
    ("llama", TEXT, "[[2,4],[cp,fsdp]]"),
    pytest.param(  # one key/value head, repeated for tp's query heads; 8 s
        "gemma3", TEXT, "[[4,2],[cp,tp]]", marks=pytest.mark.slow
    ),
    pytest.param("gemma3", PLAIN, "[[8],[cp]]", marks=pytest.mark.slow),
    pytest.param("llama", PLAIN, "[[4,2],[cp,fsdp]]", marks=pytest.mark.slow),
    pytest.param("llama", TEXT, "[[8],[cp]]", marks=pytest.mark.slow),
    pytest.param("gemma3", TEXT, "[[2,2,2],[dp,cp,fsdp]]", marks=pytest.mark.slow),
    pytest.param("gemma3", TEXT, "[[2,2,2],[cp,fsdp,tp]]", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("family", "data", "mesh"), CASES)
@pytest.mark.slow
def test_the_loss_and_every_gradient_are_one_devices(one_device, family, data, mesh):
    loss, grads = _loss_and_grads(family, data, mesh, 8)
    want_loss, want_grads = one_device(family, data)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    paths = jax.tree_util.tree_flatten_with_path(want_grads)[0]
    for (path, want), got in zip(paths, jax.tree.leaves(grads), strict=True):
        error = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert error < 1e-5, (jax.tree_util.keystr(path), error)


RUN = (
    *FAMILIES["gemma3"],
    "data.seq_len=64",
    "training.global_batch_size=8",
    "training.steps=3",
    "training.log_every=1",
    "training.warmup_steps=1",
    "training.eval_every=0",
)


def _losses(result) -> np.ndarray:
    return np.array([[h["loss"], h["grad_norm"]] for h in result.history])


@pytest.mark.slow  # 2 runs, 25 s
def test_accumulation_remat_and_grouped_reductions_keep_the_losses(tmp_path):
    """3 steps with 2 micro-batches accumulated, full remat and the fsdp reduction every 2
    micro-batches (the gradients computed per device group, train.gradients)."""
    extra = ("training.gradient_accumulation_steps=2", "model.remat=full")
    reference = train_tiny(tmp_path / "one", *RUN, *extra, devices=1)
    split = train_tiny(
        tmp_path / "cp",
        *RUN,
        *extra,
        "training.sync_gradients_every=2",
        "model.mesh_shape=[[2,4],[cp,fsdp]]",
    )
    np.testing.assert_allclose(_losses(split), _losses(reference), rtol=1e-5)


@pytest.mark.slow  # 2 runs, 15 s
def test_a_checkpoint_moves_between_cp_and_non_cp_meshes(tmp_path):
    """Saved on fsdp, resumed with the sequence split over cp: the stored layout does not
    depend on cp, and the loss curve goes on."""
    every = ("training.steps=4", "checkpoint.every_steps=2")
    written = train_tiny(tmp_path / "w", *RUN, *every, "model.mesh_shape=[[8,1],[fsdp,tp]]")
    resumed = train_tiny(
        tmp_path / "r",
        *RUN,
        *every,
        "model.mesh_shape=[[4,2],[cp,fsdp]]",
        f"checkpoint.resume={tmp_path / 'w' / 'checkpoints' / '2'}",
    )
    assert [h["step"] for h in resumed.history] == [3, 4]
    np.testing.assert_allclose(_losses(resumed), _losses(written)[2:], rtol=1e-5)


@pytest.mark.parametrize(
    ("mesh", "overrides", "message"),
    [
        (
            "[[8],[cp]]",
            ["data.seq_len=100"],
            "data.seq_len=100 does not split into 2×cp=16 equal chunks (context parallelism "
            "gives each cp device an early and a late chunk); use a multiple of 16, e.g. "
            "data.seq_len=96",
        ),
        (
            "[[2,4],[pp,cp]]",
            [],
            "model.mesh_shape splits sequences over cp=4 and layers over pp=2: context "
            "parallelism does not run inside pipeline stages yet; drop one of the two axes "
            "(put its devices on fsdp or dp)",
        ),
        (
            "[[4,2],[cp,fsdp]]",
            ["model.lora.rank=4", "model.lora.dropout=0.1"],
            "model.lora.dropout=0.1 with cp=4 in model.mesh_shape: adapter dropout is drawn per "
            "sequence in order, not per cp chunk; drop model.lora.dropout, or train on a mesh "
            "without cp",
        ),
    ],
)
def test_what_cp_cannot_serve_is_one_line(mesh, overrides, message):
    cfg = compose_config(*RUN, f"model.mesh_shape={mesh}", *overrides)
    with pytest.raises(ConfigError) as error:
        check_against_mesh(cfg, parse_mesh_shape(cfg.model.mesh_shape, 8))
    assert str(error.value) == message
