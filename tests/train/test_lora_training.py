"""LoRA training: one step equals a hand-written reference (the plain model with W + alpha/r·A·B,
differentiated by A and B, the same AdamW) on every kind of mesh; the base never moves; bad
model.lora input is one line before anything compiles."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.config import compose_config
from helpers.paths import REPO
from helpers.runs import train_tiny

from meshtrain.data import BatchIterator, build_dataset
from meshtrain.errors import ConfigError
from meshtrain.models.abstract import abstract_model, merge_model
from meshtrain.models.initialization import initial_params
from meshtrain.models.lora import join_adapters, merge_adapters, split_adapters
from meshtrain.observe.hlo import matmul_flops, parse_module
from meshtrain.parallel.mesh import build_mesh, parse_mesh_shape
from meshtrain.train.compilation import compile_train_step
from meshtrain.train.describe import describe
from meshtrain.train.optimizer import build_optimizer
from meshtrain.train.setup import prepare
from meshtrain.train.state import state_shardings
from meshtrain.weights.lora_base import lora_summary

RUN = (
    "data=synthetic",
    "data.seq_len=32",
    "training.global_batch_size=8",
    "training.steps=1",
    "training.warmup_steps=1",
    "training.learning_rate=0.01",
    # Adam's first update is lr·g/(|g| + eps): with the default eps of 1e-8 it is lr·sign(g),
    # which hides the gradient's value and amplifies the rounding of gradients near eps; with
    # eps 1 (|g| < 0.1 here) it is lr·g, so the comparison checks the gradients themselves.
    "training.adam_eps=1.0",
    "training.eval_every=0",
    "checkpoint.every_steps=0",
    "model.lora.rank=4",
    "model.lora.alpha=8",
    "model.lora.targets=[q,k,v,o,gate,up,down]",
)


def _unstacked(tree, num_layers):
    """Stacked blocks [L, ...] (scan_layers) → {layer: ...} as the unscanned model holds them."""
    if isinstance(tree["blocks"], dict) and 0 in tree["blocks"]:
        return tree
    blocks = {i: jax.tree.map(lambda a, i=i: a[i], tree["blocks"]) for i in range(num_layers)}
    return {**tree, "blocks": blocks}


def _reference_step(cfg, batch, token_format):
    """(loss, adapters after one AdamW step): the plain model (no LoRA) whose weights are
    W + alpha/r·A·B, differentiated with respect to A and B on one device, in fp64 (so that
    the comparison measures meshtrain's fp32 rounding alone)."""
    model_cfg = dataclasses.replace(
        cfg.model, scan_layers=False, mesh_shape=[[1, 1], ["fsdp", "tp"]]
    )
    plain_cfg = dataclasses.replace(model_cfg, lora=dataclasses.replace(model_cfg.lora, rank=0))
    spec = parse_mesh_shape(model_cfg.mesh_shape, 1, platform="cpu")
    mesh = build_mesh(spec, jax.devices()[:1])
    with jax.set_mesh(mesh):
        lora_model = abstract_model(model_cfg, mesh, spec)
        plain_model = abstract_model(plain_cfg, mesh, spec)
        adapters, base = split_adapters(
            initial_params(model_cfg, cfg.training.seed, lora_model.param_shardings)
        )
        inputs, targets, mask, segment_ids, positions = token_format.read(jnp.asarray(batch))
        scale = cfg.model.lora.alpha / cfg.model.lora.rank

        def loss_of(adapters):
            params = merge_adapters(join_adapters(adapters, base), scale)
            logits = merge_model(plain_model, params)(inputs, positions, segment_ids)
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
            return jnp.sum(nll * mask) / jnp.sum(mask)

        with jax.enable_x64(True):
            adapters, base = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (adapters, base))
            loss, grads = jax.value_and_grad(loss_of)(adapters)
            tx = build_optimizer(cfg.training)
            updates, _ = tx.update(grads, tx.init(adapters), adapters)
            return float(loss), jax.device_get(optax.apply_updates(adapters, updates))


def _first_batch(cfg):
    data = build_dataset(cfg.data, split="train", vocab_size=cfg.model.vocab_size)
    rows = cfg.training.global_batch_size
    iterator = BatchIterator(data, global_batch=rows, accum_steps=1, rows=slice(0, rows), seed=0)
    return next(iterator)[0]


def _relative(ours, theirs):
    return float(np.abs(np.asarray(ours) - np.asarray(theirs)).max() / np.abs(theirs).max())


MESHES = [
    pytest.param("[[1,1],[fsdp,tp]]", 1, (), id="1x1", marks=pytest.mark.slow),
    pytest.param("[[4,2],[fsdp,tp]]", 8, (), id="fsdp4-tp2", marks=pytest.mark.slow),
    pytest.param("[[2,2,2],[pp,fsdp,tp]]", 8, (), id="pp2-gpipe", marks=pytest.mark.slow),
    pytest.param(
        "[[2,2,2],[pp,fsdp,tp]]",
        8,
        ("training.pipeline.schedule=1f1b", "training.pipeline.microbatches=2"),
        id="pp2-1f1b",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "[[2,4],[dp,fsdp]]",
        8,
        (
            "training.gradient_accumulation_steps=2",
            "training.micro_batch_size=1",
            "training.global_batch_size=16",
        ),
        id="dp2-fsdp4-accum2",
        marks=pytest.mark.slow,
    ),
    # The adapters' backward under cp: einsums over [B, T, ...] (models.lora.adapter_output).
    pytest.param("[[2,4],[cp,fsdp]]", 8, (), id="cp2-fsdp4", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("mesh", "devices", "extra"), MESHES)
def test_one_lora_step_equals_the_hand_written_reference(tmp_path, mesh, devices, extra):
    result = train_tiny(tmp_path, *RUN, f"model.mesh_shape={mesh}", *extra, devices=devices)
    cfg = result.setup.cfg
    loss, adapters = _reference_step(cfg, _first_batch(cfg), result.setup.token_format)
    assert abs(result.history[0]["loss"] - loss) <= 1e-6 * loss
    ours = _unstacked(jax.device_get(result.state.params), cfg.model.num_layers)
    # fp32 sums of the gradients over the batch's 256 tokens, against fp64: 1.2e-6 at most
    # measured over these meshes.
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(adapters), strict=True):
        assert _relative(a, b) <= 2e-6
    # Only the adapters trained: the base is the seed's, bit for bit, and B has moved.
    spec = result.setup.mesh_spec
    with jax.set_mesh(result.setup.mesh):
        fresh = initial_params(cfg.model, cfg.training.seed, result.setup.model.param_shardings)
    _, base = split_adapters(fresh)
    frozen = result.state.frozen
    for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert spec is not None and all(
        float(np.abs(b).max()) > 0
        for path, b in jax.tree_util.tree_flatten_with_path(ours)[0]
        if str(path[-1].key).endswith("_lora_b")
    )


@pytest.mark.slow
def test_the_optimizer_and_the_checkpoints_hold_the_adapters_only(tmp_path):
    # What the state holds does not depend on the mesh: one device (the run of the slow
    # test_one_lora_step_equals_the_hand_written_reference[1x1]).
    result = train_tiny(tmp_path, *RUN, "model.mesh_shape=[[1,1],[fsdp,tp]]", devices=1)
    adapters = jax.tree.leaves(result.state.params)
    count = sum(a.size for a in adapters)
    moments = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(result.state.opt_state)[0]
        if any(getattr(key, "name", None) in ("mu", "nu") for key in path)
    ]
    assert sum(a.size for a in moments) == 2 * count  # Adam's two moments of the adapters
    cfg = result.setup.cfg.model
    d, n, h, k, f = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.num_kv_heads, cfg.mlp_dim
    per_layer = 4 * ((d + n * h) * 2 + (d + k * h) * 2 + (d + f) * 3)
    assert count == cfg.num_layers * per_layer


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("model.lora.alpha=32",),
            "model.lora.alpha set but model.lora.rank=0 (LoRA off); set model.lora.rank (e.g. "
            "16) to train adapters, or drop those keys",
        ),
        (
            ("model.lora.rank=-4",),
            "model.lora.rank=-4 must be positive (e.g. 16), or 0 for no LoRA",
        ),
        (
            ("model.lora.rank=4", "model.lora.targets=[q,lm_head]"),
            "model.lora.targets entry 'lm_head' names no projection; use names among q, k, v, "
            "o, gate, up, down or a pattern over them (e.g. 'q|v')",
        ),
        (
            ("model.lora.rank=4", "model.lora.targets=[qproj]"),
            "model.lora.targets entry 'qproj' names no projection (did you mean 'q_proj'?); use "
            "names among q, k, v, o, gate, up, down or a pattern over them (e.g. 'q|v')",
        ),
        (
            ("model.lora.rank=4", "model.lora.base_dtype=nf4", "model.lora.quant_block=24"),
            "model.lora.base_dtype=nf4, projection k: model.lora.quant_block=24 does not divide "
            "the input size 128 (axis 0 of a weight of shape (128, 8, 16)); use 16 or 32",
        ),
        (
            ("model.lora.rank=100000",),
            "model.lora.rank=100000 exceeds projection q's smaller side (128), where an adapter "
            "of rank 128 already spans every update; set model.lora.rank <= 128 (e.g. 16)",
        ),
        (
            ("model.lora.rank=4", "model.lora.quant_block=32"),
            "model.lora.quant_block=32 set but model.lora.base_dtype=compute quantises nothing; "
            "set model.lora.base_dtype=nf4 (or int8), or drop model.lora.quant_block",
        ),
        (
            ("model.lora.rank=4", "model.lora.base_dtype=nf4", "model.lora.quant_block=7"),
            "model.lora.base_dtype=nf4, projection k: model.lora.quant_block=7 is odd, and nf4 "
            "packs two 4-bit codes per byte within a block; use 8 or 4",
        ),
    ],
)
def test_bad_lora_input_is_one_line_before_anything_compiles(overrides, message):
    cfg = compose_config("data=synthetic", "model.mesh_shape=[[1,1],[fsdp,tp]]", *overrides)
    with pytest.raises(ConfigError) as err:
        prepare(cfg, jax.devices()[:1], with_data=False)
    assert str(err.value) == message
    assert f"meshtrain: error: {message}\n" in (REPO / "docs" / "finetuning.md").read_text()


def test_a_pattern_string_selects_the_projections_a_list_does():
    # The docs' form (model.lora.targets='q|v') as well as a list.
    lines = []
    for targets in ("'q|v'", "[q,v]", "[q_proj,v_proj]"):
        cfg = compose_config("data=synthetic", "model.lora.rank=4", f"model.lora.targets={targets}")
        setup = prepare(cfg, jax.devices()[:1], with_data=False)
        lines.append(lora_summary(cfg.model, setup.model))
    assert lines[0] == lines[1] == lines[2]
    assert lines[0].startswith("LoRA: rank 4, alpha 16 on q, v: 5,120 trainable parameters")


def test_adapters_larger_than_half_the_base_are_warned_of(caplog):
    def warnings(rank):
        cfg = compose_config("data=synthetic", f"model.lora.rank={rank}")
        caplog.clear()
        with caplog.at_level("WARNING"):
            describe(prepare(cfg, jax.devices()[:1], with_data=False))
        return [r.getMessage() for r in caplog.records if "the adapters hold" in r.getMessage()]

    assert warnings(16) == []
    # Rank 128 on every projection of the tiny model: 128 · (in + out) per projection, 819,200
    # in 2 layers, against the base's 639,616 (in · out per projection, embedding and norms).
    (line,) = warnings(128)
    assert line == (
        "the adapters hold 128% as many parameters as the base: LoRA saves little over full "
        "fine-tuning here; a smaller model.lora.rank (e.g. 16) is what it is for"
    )


def _dropout_history(tmp_path, mesh, devices, *extra):
    result = train_tiny(
        tmp_path,
        *RUN,
        "training.steps=2",
        "training.log_every=1",
        "model.lora.dropout=0.3",
        f"model.mesh_shape={mesh}",
        *extra,
        devices=devices,
    )
    return np.array([[h["loss"], h["grad_norm"]] for h in result.history])


@pytest.mark.slow  # five 2-step runs, about 45 s
def test_adapter_dropout_draws_the_same_masks_on_any_mesh(tmp_path):
    """Each sequence's mask comes from its own key: one device, fsdp × tp, and dp with
    gradient groups and accumulation give the same gradient norm at step 1 and loss at step 2
    (B = 0 at step 1: dropout changes the gradient, not the loss)."""
    one = _dropout_history(tmp_path / "one", "[[1,1],[fsdp,tp]]", 1)
    sharded = _dropout_history(tmp_path / "sharded", "[[4,2],[fsdp,tp]]", 8)
    grouped = _dropout_history(
        tmp_path / "grouped",
        "[[2,4],[dp,fsdp]]",
        8,
        "training.gradient_accumulation_steps=2",
        "training.micro_batch_size=1",
        "training.global_batch_size=16",
    )
    np.testing.assert_allclose(sharded, one, rtol=1e-6)
    without = _dropout_history(tmp_path / "without", "[[1,1],[fsdp,tp]]", 1, "model.lora.dropout=0")
    assert abs(without[0, 1] - one[0, 1]) > 1e-3 * one[0, 1]  # dropout changed the gradient
    assert without[0, 0] == one[0, 0]
    sixteen = _dropout_history(
        tmp_path / "sixteen", "[[1,1],[fsdp,tp]]", 1, "training.global_batch_size=16"
    )
    np.testing.assert_allclose(grouped, sixteen, rtol=1e-6)


def test_dropout_zeroes_its_share_and_scales_the_rest():
    from meshtrain.models.lora import AdapterDropout, row_keys

    keys = row_keys(jax.random.key(0), jnp.arange(4, dtype=jnp.int32))
    x = jnp.ones((4, 64, 32), jnp.float32)
    dropped = np.asarray(AdapterDropout(keys, 3).apply(x, "q", 0.25))
    assert set(np.unique(dropped)) == {0.0, np.float32(1 / 0.75)}
    assert abs((dropped == 0).mean() - 0.25) < 0.02
    again = np.asarray(AdapterDropout(keys[2:], 3).apply(x[2:], "q", 0.25))
    np.testing.assert_array_equal(again, dropped[2:])  # a row's mask is its own
    other = np.asarray(AdapterDropout(keys, 3).apply(x, "k", 0.25))
    assert (other != dropped).any()  # and each projection's, each layer's


STEP = (
    "data=synthetic",
    "data.seq_len=32",
    "training.global_batch_size=4",
    "model.mesh_shape=[[1,1],[fsdp,tp]]",
)


def _step_matmul_flops(*overrides: str) -> float:
    """The FLOPs of the matrix products of the compiled train step, one device."""
    setup = prepare(compose_config(*STEP, *overrides), jax.devices()[:1])
    tx = build_optimizer(setup.cfg.training)
    shardings = state_shardings(setup.model, tx, setup.mesh, reference=setup.reference_copy)
    compiled, _ = compile_train_step(setup, tx, shardings)
    return matmul_flops(parse_module(compiled.as_text()))


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param((), id="layers"),
        pytest.param(("model.scan_layers=true",), id="scanned", marks=pytest.mark.slow),
        pytest.param(
            ("model.lora.base_dtype=nf4", "model.lora.quant_block=16"),
            id="qlora",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_the_compiled_lora_step_computes_no_weight_gradient_of_the_base(variant):
    """Full minus LoRA matmul FLOPs, as compiled, is exactly what freezing the base saves (the
    projections' and the tied head's weight gradients) less what the adapters cost (x·A, ·B,
    and their three backward products each); unrolled, the first layer's q, k and v also need
    no input gradient, through the base or the adapters: nothing trainable comes before them."""
    rank = 4
    full = _step_matmul_flops(*[v for v in variant if "lora" not in v])
    lora = _step_matmul_flops(*variant, f"model.lora.rank={rank}")
    m = compose_config().model
    tokens = 4 * 32
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    projections = [(m.d_model, q), (m.d_model, kv), (m.d_model, kv), (q, m.d_model)]
    projections += [(m.d_model, m.mlp_dim)] * 2 + [(m.mlp_dim, m.d_model)]
    weight_gradients = (
        2 * tokens * (m.num_layers * sum(i * o for i, o in projections) + m.d_model * m.vocab_size)
    )
    adapters = 6 * tokens * rank * m.num_layers * sum(i + o for i, o in projections)
    first_layer = 2 * tokens * m.d_model * ((q + 2 * kv) + 3 * rank)  # base, then adapters
    if "model.scan_layers=true" in variant:  # one loop body for every layer: nothing dropped
        first_layer = 0
    assert full - lora == weight_gradients + first_layer - adapters
