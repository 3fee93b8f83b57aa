"""The mixture-of-experts layer: its output and gradients against a dense reference (every expert
on every token), capacity mode's drops, the routing statistics against Hugging Face's formulas,
LoRA and QLoRA on the experts (against experts with merged weights, their dropout, merging), the
model.moe checks, and (slow) parity with transformers' Qwen3-MoE and Mixtral blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshtrain.config.moe import MoeConfig, check_moe
from meshtrain.config.schema import DEFAULT_LOGICAL_AXIS_RULES
from meshtrain.errors import ConfigError
from meshtrain.models.capacity import expert_capacity
from meshtrain.models.lora import (
    AdapterDropout,
    LoraSpec,
    merge_adapters,
    merged_weight,
    row_keys,
    split_adapters,
)
from meshtrain.models.moe import MoeFeedForward
from meshtrain.models.quantize import quantize
from meshtrain.models.routing import combined_aux_loss, routing_stats
from meshtrain.observe.communication import account_collectives
from meshtrain.parallel.mesh import build_mesh, parse_mesh_shape

RULES = dict(DEFAULT_LOGICAL_AXIS_RULES) | {"experts": None, "expert_mlp": "tp"}
D, F, E, K = 8, 6, 4, 2
NAMES = ("router", "gate", "up", "down")


def _layer(*, d=D, f=F, e=E, k=K, seed=0, **options) -> MoeFeedForward:
    options = {"activation": "silu", **options}
    return MoeFeedForward(
        d_model=d,
        expert_dim=f,
        num_experts=e,
        top_k=k,
        init_std=0.5,
        rules=RULES,
        rngs=nnx.Rngs(seed),
        **options,
    )


def _params(layer: MoeFeedForward) -> dict[str, jax.Array]:
    """The layer's parameters, its adapters' included, by name."""
    return dict(nnx.to_pure_dict(nnx.state(layer)))


def _apply(layer: MoeFeedForward):
    """The layer as a function of its parameters (a dict of arrays), x, an optional mask and an
    optional adapter dropout."""
    graphdef = nnx.graphdef(layer)

    def apply(params, x, mask=None, dropout=None):
        return nnx.merge(graphdef, params)(x, dropout, mask=mask)

    return apply


def _dense_reference(params, x, *, score, normalize, act=jax.nn.silu, keep=None):
    """Every expert applied to every token, weighted by its routing weight (zero where it is not
    among the token's top K, or where `keep` [N, E] is false)."""
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ params["router"]
    if score == "softmax":
        scores = jnp.exp(logits - logits.max(-1, keepdims=True))
        scores = scores / scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + jnp.exp(-logits))
    ranks = jnp.argsort(jnp.argsort(-scores, axis=-1), axis=-1)
    weights = jnp.where(ranks < K, scores, 0.0)  # [N, E]
    if normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    if keep is not None:
        weights = weights * keep
    hidden = act(jnp.einsum("ND,EDF->NEF", flat, params["gate"]))
    hidden = hidden * jnp.einsum("ND,EDF->NEF", flat, params["up"])
    outputs = jnp.einsum("NEF,EFD->NED", hidden, params["down"])
    return jnp.einsum("NE,NED->ND", weights, outputs).reshape(x.shape)


def _output_and_grads(apply, reference, params, x, probe):
    """(output, gradients of Σ output · probe wrt the parameters and x) of the layer and of the
    reference, in one jitted call."""

    def layer_loss(params, x):
        return jnp.sum(apply(params, x)[0] * probe)

    def reference_loss(params, x):
        return jnp.sum(reference(params, x) * probe)

    @jax.jit
    def both(params, x):
        return (
            (apply(params, x)[0], jax.grad(layer_loss, argnums=(0, 1))(params, x)),
            (reference(params, x), jax.grad(reference_loss, argnums=(0, 1))(params, x)),
        )

    return both(params, x)


def _inputs(seed=1, shape=(2, 5, D)):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    probe = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return x, probe


def _assert_close(actual, expected, tol=1e-5):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("score", "normalize", "activation"),
    [
        ("softmax", True, "silu"),  # Mixtral; Qwen3-MoE's checkpoints (norm_topk_prob: true)
        ("softmax", False, "silu"),  # Qwen3-MoE's config default (norm_topk_prob: false)
        ("sigmoid", True, "gelu"),
    ],
)
def test_dropless_output_and_gradients_equal_every_expert_on_every_token(
    score, normalize, activation
):
    """Dropless: the output, and the gradients wrt x, router, gate, up and down, are those of
    the dense reference (1e-5, fp32)."""
    layer = _layer(score=score, normalize_top_k=normalize, activation=activation)
    act = jax.nn.silu if activation == "silu" else lambda g: jax.nn.gelu(g, approximate=True)
    x, probe = _inputs()

    def reference(params, x):
        return _dense_reference(params, x, score=score, normalize=normalize, act=act)

    (y, grads), (y_ref, grads_ref) = _output_and_grads(
        _apply(layer), reference, _params(layer), x, probe
    )
    assert y.shape == x.shape and y.dtype == x.dtype
    _assert_close(y, y_ref)
    for name in NAMES:
        assert float(jnp.abs(grads[0][name]).max()) > 0, name
        _assert_close(grads[0][name], grads_ref[0][name])
    _assert_close(grads[1], grads_ref[1])


def test_ample_capacity_drops_nothing_and_equals_dropless():
    """With capacity_factor = E / K every expert can take every token: nothing is dropped, and
    the output, the statistics and the gradients are the dropless layer's (and the reference's)."""
    x, probe = _inputs(seed=2)
    dropless, capped = _layer(), _layer(capacity_factor=E / K)

    def reference(params, x):
        return _dense_reference(params, x, score="softmax", normalize=True)

    (y, grads), (y_ref, grads_ref) = _output_and_grads(
        _apply(capped), reference, _params(capped), x, probe
    )
    _assert_close(y, y_ref)
    for name in NAMES:
        _assert_close(grads[0][name], grads_ref[0][name])
    _assert_close(grads[1], grads_ref[1])
    y_dropless, stats_dropless = jax.jit(_apply(dropless))(_params(dropless), x)
    y_capped, stats_capped = jax.jit(_apply(capped))(_params(capped), x)
    _assert_close(y_capped, y_dropless)
    assert float(stats_capped.dropped) == 0.0 == float(stats_dropless.dropped)
    for field in ("aux_loss", "z_loss", "expert_load", "router_prob"):
        _assert_close(getattr(stats_capped, field), getattr(stats_dropless, field))


# Each token's two experts, fixed through the router: expert 0 gets tokens 0, 1, 2, 3, 5, 7;
# expert 1 tokens 0, 2, 4, 6; expert 2 tokens 1, 4, 5, 7; expert 3 tokens 3, 6.
PICKS = [(0, 1), (0, 2), (0, 1), (0, 3), (1, 2), (0, 2), (3, 1), (2, 0)]
# capacity_factor 0.5: C = ceil(0.5 · 8 tokens · 2 / 4) = 2, so each expert keeps its first two
# tokens: expert 0 drops 2, 3, 5, 7; expert 1 drops 4, 6; expert 2 drops 5, 7: 8 in all.
KEPT = {(0, 0), (1, 0), (0, 1), (2, 1), (1, 2), (4, 2), (3, 3), (6, 3)}  # (token, expert)


def test_small_capacity_drops_the_late_assignments_which_add_nothing():
    """A router that picks PICKS: with C = 2 the dropped count is the 8 counted by hand, the
    output is the reference's with the dropped assignments' weights zeroed, and a token whose
    two assignments both dropped (5 and 7) gets exactly 0."""
    layer = _layer(capacity_factor=0.5)
    params = _params(layer)
    router = np.zeros((D, E), np.float32)
    router[:E, :E] = np.eye(E)  # logits: x's first E features; the rest do not route
    params["router"] = jnp.asarray(router)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, len(PICKS), D)).astype(np.float32)
    x[0, :, :E] = 0.0
    for token, (first, second) in enumerate(PICKS):
        x[0, token, first], x[0, token, second] = 3.0, 2.0
    keep = np.zeros((len(PICKS), E), np.float32)
    for token, expert in KEPT:
        keep[token, expert] = 1.0
    assert expert_capacity(0.5, len(PICKS), K, E) == 2
    y, stats = jax.jit(_apply(layer))(params, jnp.asarray(x))
    assert float(stats.dropped) == 8.0
    expected = _dense_reference(params, x, score="softmax", normalize=True, keep=keep)
    _assert_close(y, expected)
    assert np.all(np.asarray(y)[0, [5, 7]] == 0.0)
    assert np.all(np.abs(np.asarray(y)[0, [0, 1, 2, 3, 4, 6]]).max(-1) > 0)
    _assert_close(stats.expert_load, np.array([6, 4, 4, 2]) / (len(PICKS) * K))


def _softmax(logits):
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _hf_load_balancing(layers_logits, top_k, mask=None):
    """transformers' load_balancing_loss_func in numpy (float64), after its source: over a
    list of layers' logits [N, E], the top-k assignment counts and the softmax probabilities
    summed over the layers and the (masked) tokens, divided by the rows, then
    E · Σ_e fraction_e · prob_e."""
    num_experts = layers_logits[0].shape[-1]
    counts, prob_sum, rows = np.zeros(num_experts), np.zeros(num_experts), 0.0
    weight = np.ones(layers_logits[0].shape[0]) if mask is None else mask.astype(np.float64)
    for logits in layers_logits:
        probs = _softmax(logits.astype(np.float64))
        selected = np.argsort(-probs, axis=-1)[:, :top_k]
        for token, experts in enumerate(selected):
            counts[experts] += weight[token]
        prob_sum += (probs * weight[:, None]).sum(0)
        rows += weight.sum()
    return num_experts * np.sum(counts / rows * prob_sum / rows)


def _logsumexp(logits):
    top = logits.max(-1)
    return top + np.log(np.exp(logits - top[:, None]).sum(-1))


def test_aux_and_z_loss_are_hugging_faces_formulas_and_differentiate_like_them():
    """aux_loss is load_balancing_loss_func's value for the layer's logits, with and without a
    mask; z_loss the mean of logsumexp²; the aux loss's gradient wrt the router is that of the
    same formula written in jnp."""
    layer = _layer()
    params = _params(layer)
    x, _ = _inputs(seed=4, shape=(2, 6, D))
    mask = np.array([[1] * 6, [1] * 4 + [0] * 2], bool)
    apply = _apply(layer)

    def aux(params, x, mask):
        return apply(params, x, mask)[1].aux_loss

    def reference_aux(params, x, mask):
        logits = x.reshape(-1, D) @ params["router"]
        probs = jax.nn.softmax(logits, axis=-1)
        picked = jnp.sum(jax.nn.one_hot(jax.lax.top_k(probs, K)[1], E), axis=1)  # [N, E]
        weight = mask.reshape(-1, 1).astype(jnp.float32)
        tokens = jnp.sum(weight)
        return E * jnp.sum(
            jnp.sum(picked * weight, 0) / tokens * jnp.sum(probs * weight, 0) / tokens
        )

    @jax.jit
    def run(params, x, mask):
        full, masked = apply(params, x)[1], apply(params, x, mask)[1]
        grads = jax.grad(aux)(params, x, mask)["router"]
        return full, masked, grads, jax.grad(reference_aux)(params, x, mask)["router"]

    full, masked, grad, grad_ref = run(params, x, jnp.asarray(mask))
    logits = np.asarray(x, np.float64).reshape(-1, D) @ np.asarray(params["router"], np.float64)
    _assert_close(full.aux_loss, _hf_load_balancing([logits], K))
    _assert_close(masked.aux_loss, _hf_load_balancing([logits], K, mask.reshape(-1)))
    _assert_close(full.z_loss, np.mean(_logsumexp(logits) ** 2))
    kept = mask.reshape(-1)
    _assert_close(masked.z_loss, np.mean(_logsumexp(logits[kept]) ** 2))
    _assert_close(full.router_prob, _softmax(logits).mean(0))
    assert float(jnp.abs(grad).max()) > 0
    _assert_close(grad, grad_ref)


def test_several_layers_aux_loss_is_hugging_faces_over_the_stacked_logits():
    """combined_aux_loss of two layers' statistics is load_balancing_loss_func's value for the
    tuple of the two layers' logits (not the mean of their aux_loss)."""
    rng = np.random.default_rng(5)
    layers = [rng.standard_normal((10, E)).astype(np.float32) for _ in range(2)]
    stats = []
    for logits in layers:
        probs = jax.nn.softmax(jnp.asarray(logits), axis=-1)
        experts = jax.lax.top_k(probs, K)[1]
        stats.append(
            routing_stats(
                jnp.asarray(logits), probs, experts, None, score="softmax", dropped=jnp.zeros(())
            )
        )
    combined = combined_aux_loss(
        jnp.stack([s.expert_load for s in stats]), jnp.stack([s.router_prob for s in stats]), K
    )
    _assert_close(combined, _hf_load_balancing(layers, K))
    for logits, s in zip(layers, stats, strict=True):
        _assert_close(s.aux_loss, _hf_load_balancing([logits], K))


def test_bf16_input_gives_a_bf16_output_near_the_fp32_one():
    """The output is in x's dtype; in bf16 (fp32 parameters cast, fp32 routing) it stays within
    bf16 rounding of the fp32 output, in both modes."""
    x, _ = _inputs(seed=8)
    x = x.astype(jnp.bfloat16).astype(jnp.float32)  # the same routing input in both dtypes
    for capacity_factor in (None, 2.0):
        layer = _layer(capacity_factor=capacity_factor)
        apply, params = jax.jit(_apply(layer)), _params(layer)
        y32, stats32 = apply(params, x)
        y16, stats16 = apply(params, x.astype(jnp.bfloat16))
        assert y16.dtype == jnp.bfloat16 and stats16.aux_loss.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(y16, np.float32), y32, rtol=0.05, atol=0.05)
        _assert_close(stats16.aux_loss, stats32.aux_loss)


@pytest.mark.slow  # 5 s; tests/train/test_moe_training.py trains on ep meshes by default
def test_the_layer_runs_sharded_on_a_mesh_as_on_one_device():
    """On an fsdp=4 × tp=2 mesh of the faked CPU devices (the expert hidden width over tp), both
    modes, with and without expert adapters, give the one-device output."""
    spec = parse_mesh_shape([[4, 2], ["fsdp", "tp"]], 8, platform="cpu")
    mesh = build_mesh(spec, jax.devices()[:8])
    x, _ = _inputs(seed=6, shape=(4, 4, D))
    for capacity_factor, lora in ((None, None), (1.0, None), (None, SPEC), (1.0, SPEC)):
        layer = _layer(capacity_factor=capacity_factor, lora=lora)
        apply, params = jax.jit(_apply(layer)), _with_random_b(layer)
        y, _ = apply(params, x)
        with jax.set_mesh(mesh):
            y_sharded, stats = apply(params, x)
        _assert_close(y_sharded, y)
        assert (float(stats.dropped) > 0) == (capacity_factor is not None)


EP_FSDP, EP_FSDP_TP = [[4, 2], ["ep", "fsdp"]], [[2, 2, 2], ["ep", "fsdp", "tp"]]


@pytest.mark.parametrize(
    ("capacity_factor", "exchange", "adapters", "mesh_shape"),
    [
        (1.0, {"all-to-all"}, False, EP_FSDP),
        (None, {"all-gather", "reduce-scatter"}, False, EP_FSDP),
        pytest.param(1.0, {"all-to-all"}, True, EP_FSDP, marks=pytest.mark.slow),
        (None, {"all-gather", "reduce-scatter"}, True, EP_FSDP_TP),
        pytest.param(1.0, {"all-to-all"}, True, EP_FSDP_TP, marks=pytest.mark.slow),
        pytest.param(None, set(), True, [[4, 2], ["fsdp", "tp"]], marks=pytest.mark.slow),
    ],
)
def test_on_ep_capacity_mode_exchanges_buffers_all_to_all_and_dropless_gathers(
    capacity_factor, exchange, adapters, mesh_shape
):
    """8 experts over ep=4 (fsdp=2): the output, the gradients and the dropped picks are one
    device's, and the tokens travel over ep as the mode says: capacity mode's buffers by
    all-to-all (and nothing gathered over ep: the buffers it sends hold capacity_factor · N·K/ep
    rows each), dropless's tokens by all-gather and its outputs back by reduce-scatter. With
    adapters on every expert projection and their dropout in training, the dropped-out inputs
    and down's mask travel in buffers of their own, and give one device's numbers too. With tp,
    each device holds half of every expert's hidden width (and of its adapters' and dropout
    mask's), and the partial outputs are summed over tp: the same numbers; without ep, each
    device runs every expert on its own tokens and nothing crosses a mesh axis but tp's sum."""
    layer = MoeFeedForward(
        d_model=D,
        expert_dim=F,
        num_experts=8,
        top_k=K,
        init_std=0.5,
        rules=dict(DEFAULT_LOGICAL_AXIS_RULES),
        rngs=nnx.Rngs(3),
        activation="silu",
        capacity_factor=capacity_factor,
        lora=LoraSpec(rank=3, scale=1.5, targets=ADAPTED, dropout=0.5) if adapters else None,
    )
    apply, params = _apply(layer), _with_random_b(layer)
    x, probe = _inputs(seed=7, shape=(8, 6, D))
    keys = row_keys(jax.random.key(5), jnp.arange(8, dtype=jnp.int32))
    dropout = AdapterDropout(keys, 1) if adapters else None

    @jax.jit
    def output_and_grads(params, x):
        def loss(params, x):
            y, stats = apply(params, x, None, dropout)
            return jnp.sum(y * probe), (y, stats.dropped)

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    grads, (y, dropped) = output_and_grads(params, x)
    mesh = build_mesh(parse_mesh_shape(mesh_shape, 8, platform="cpu"), jax.devices())
    with jax.set_mesh(mesh):
        grads_ep, (y_ep, dropped_ep) = output_and_grads(params, x)
        hlo = output_and_grads.lower(params, x).compile().as_text()
    _assert_close(y_ep, y)
    assert set(grads[0]) == set(NAMES) | (
        {f"{n}_lora_{ab}" for n in ADAPTED for ab in "ab"} if adapters else set()
    )
    for name in grads[0]:
        _assert_close(grads_ep[0][name], grads[0][name])
    _assert_close(grads_ep[1], grads[1])
    assert int(dropped_ep) == int(dropped)
    assert (int(dropped) > 0) == (capacity_factor is not None)
    collectives = account_collectives(hlo, mesh).collectives
    layer_over_ep = {  # the layer's own, the dropped count's sum aside
        c.kind
        for c in collectives
        if "shard_map" in c.op_name and "ep" in c.mesh_axes and c.shapes[0].startswith("f32")
    }
    assert layer_over_ep == exchange
    forward_sums_over_tp = [  # of down's partial outputs (the backward's are the transpose's)
        c for c in collectives if "tp" in c.mesh_axes and "jvp()/shard_map/psum" in c.op_name
    ]
    assert bool(forward_sums_over_tp) == ("tp" in mesh_shape[1])


SPEC = LoraSpec(rank=3, scale=1.5, targets=("gate", "up", "down"))
ADAPTED = ("gate", "up", "down")


def _with_random_b(layer: MoeFeedForward, seed=11) -> dict[str, jax.Array]:
    """The layer's parameters with every adapter's B drawn at random (a fresh one is zero)."""
    params = _params(layer)
    rng = np.random.default_rng(seed)
    for name in ADAPTED:
        if f"{name}_lora_b" in params:
            shape = params[f"{name}_lora_b"].shape
            params[f"{name}_lora_b"] = jnp.asarray(0.5 * rng.standard_normal(shape), jnp.float32)
    return params


def _merged_by_hand(params, scale):
    """The base parameters with each expert's weight W_e + scale · A_e·B_e (jnp, so that the
    reference differentiates wrt A and B)."""
    merged = {name: params[name] for name in NAMES}
    for name in ADAPTED:
        if f"{name}_lora_a" in params:
            a, b = params[f"{name}_lora_a"], params[f"{name}_lora_b"]
            merged[name] = params[name] + scale * jnp.einsum("Eir,Ero->Eio", a, b)
    return merged


def _lora_reference(params, x, scale, dropout, rate):
    """Every expert on every token, each adapter its own term x·W_e + s·(x'·A_e)·B_e (softmax,
    normalised, silu), its input x' dropped out as the layer promises: x with one mask per token
    and projection for gate and up, and for down the hidden of the token's k-th pick times entry
    [b, t, k] of the mask AdapterDropout.apply draws for a [B, T, K, F] array."""
    flat = x.reshape(-1, D)
    tokens = flat.shape[0]
    scores = jax.nn.softmax(flat @ params["router"], axis=-1)
    top, picks = jax.lax.top_k(scores, K)  # [N, K]
    weights = jnp.zeros((tokens, E)).at[jnp.arange(tokens)[:, None], picks].set(top)
    weights = weights / weights.sum(-1, keepdims=True)
    keep = dropout.apply(jnp.ones((*x.shape[:2], K, F), x.dtype), "down", rate).reshape(-1, K, F)
    keep_e = jnp.zeros((tokens, E, F)).at[jnp.arange(tokens)[:, None], picks].set(keep)

    def adapter(name, inputs, spec):
        low = jnp.einsum(f"{spec},Eir->NEr", inputs, params[f"{name}_lora_a"])
        return scale * jnp.einsum("NEr,Ero->NEo", low, params[f"{name}_lora_b"])

    def gate_or_up(name):
        dropped = dropout.apply(x, name, rate).reshape(-1, D)
        return jnp.einsum("ND,EDF->NEF", flat, params[name]) + adapter(name, dropped, "Ni")

    hidden = jax.nn.silu(gate_or_up("gate")) * gate_or_up("up")  # [N, E, F]
    outputs = jnp.einsum("NEF,EFD->NED", hidden, params["down"])
    outputs = outputs + adapter("down", hidden * keep_e, "NEi")
    return jnp.einsum("NE,NED->ND", weights, outputs).reshape(x.shape)


def test_fresh_expert_adapters_have_the_layout_and_change_nothing():
    """gate, up and down get A [E, *in, r] and B [E, r, *out] as LoRAParams with the experts
    axis, A uniform within ±1/sqrt(in) from the lora stream after the base draws, B zero; the
    router gets none; the base parameters and (B zero) the output, in both modes, are those of
    the same seed without LoRA, exactly."""
    x, _ = _inputs(seed=12)
    for capacity_factor in (None, 1.0):
        plain = _layer(capacity_factor=capacity_factor)
        adapted = _layer(capacity_factor=capacity_factor, lora=SPEC)
        adapters, base = split_adapters(_params(adapted))
        assert sorted(base) == sorted(NAMES)
        assert sorted(adapters) == sorted(
            f"{n}{s}" for n in ADAPTED for s in ("_lora_a", "_lora_b")
        )
        for name in NAMES:
            np.testing.assert_array_equal(base[name], _params(plain)[name])
        for name, fan_in in (("gate", D), ("up", D), ("down", F)):
            a_param, b_param = (
                getattr(adapted, f"{name}_lora_a"),
                getattr(adapted, f"{name}_lora_b"),
            )
            assert isinstance(a_param, nnx.LoRAParam) and isinstance(b_param, nnx.LoRAParam)
            weight_axes = getattr(adapted, name).get_metadata()["logical_axes"]
            assert a_param.get_metadata()["logical_axes"] == (*weight_axes[:2], "lora_rank")
            assert b_param.get_metadata()["logical_axes"] == (
                "experts",
                "lora_rank",
                weight_axes[2],
            )
            out = D if name == "down" else F
            assert a_param.shape == (E, fan_in, 3) and b_param.shape == (E, 3, out)
            a = np.asarray(a_param[...])
            assert 0 < np.abs(a).max() <= 1 / np.sqrt(fan_in)
            assert not np.any(np.asarray(b_param[...]))
        y, _ = jax.jit(_apply(adapted))(_params(adapted), x)
        y_plain, _ = jax.jit(_apply(plain))(_params(plain), x)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y_plain))


def test_an_attention_only_spec_adds_no_expert_adapter():
    layer = _layer(lora=LoraSpec(rank=3, scale=1.5, targets=("q", "v")))
    assert sorted(_params(layer)) == sorted(NAMES)
    x, _ = _inputs(seed=13)
    y, _ = jax.jit(_apply(layer))(_params(layer), x)
    plain = _layer()
    _assert_close(y, jax.jit(_apply(plain))(_params(plain), x)[0], tol=0)


@pytest.mark.parametrize(
    ("capacity_factor", "targets"),
    [
        pytest.param(None, ("gate", "up", "down"), marks=pytest.mark.slow),
        (E / K, ("gate", "up", "down")),
        (None, ("up", "down")),
    ],
)
def test_expert_adapters_equal_experts_with_merged_weights_and_differentiate_alike(
    capacity_factor, targets
):
    """With B random, the output and the gradients wrt x, the base parameters, A and B are those
    of the dense reference whose expert e's weight is W_e + alpha/r · A_e·B_e (1e-5, fp32), in
    dropless and in (ample) capacity mode; an untargeted projection has no adapter."""
    spec = LoraSpec(rank=3, scale=1.5, targets=targets)
    layer = _layer(capacity_factor=capacity_factor, lora=spec)
    params = _with_random_b(layer)
    assert "gate_lora_a" in params if "gate" in targets else "gate_lora_a" not in params
    x, probe = _inputs(seed=14)

    def reference(params, x):
        merged = _merged_by_hand(params, spec.scale)
        return _dense_reference(merged, x, score="softmax", normalize=True)

    (y, grads), (y_ref, grads_ref) = _output_and_grads(_apply(layer), reference, params, x, probe)
    _assert_close(y, y_ref)
    assert sorted(grads[0]) == sorted(params)
    for name in params:
        assert float(jnp.abs(grads[0][name]).max()) > 0, name
        _assert_close(grads[0][name], grads_ref[0][name])
    _assert_close(grads[1], grads_ref[1])
    base = {name: params[name] for name in NAMES}
    y_base = _dense_reference(base, x, score="softmax", normalize=True)
    assert float(jnp.abs(y - y_base).max()) > 1e-2  # the adapters do add something


def test_merging_folds_every_experts_adapter_and_gives_the_adapters_output():
    """merge_adapters on a block's parameter tree holding the layer's as its mlp: each expert's
    weight becomes W_e + alpha/r · A_e·B_e, the adapters are gone, and the layer without LoRA on
    the merged weights gives the adapted layer's output (both modes)."""
    x, _ = _inputs(seed=15)
    for capacity_factor in (None, 1.0):
        layer = _layer(capacity_factor=capacity_factor, lora=SPEC)
        params = _with_random_b(layer)
        merged = merge_adapters({"blocks": {0: {"mlp": params}}}, SPEC.scale)["blocks"][0]["mlp"]
        assert sorted(merged) == sorted(NAMES)
        for name in ADAPTED:
            a, b = np.asarray(params[f"{name}_lora_a"]), np.asarray(params[f"{name}_lora_b"])
            for e in range(E):
                expected = np.asarray(params[name])[e] + SPEC.scale * a[e] @ b[e]
                _assert_close(merged[name][e], expected)
        y, _ = jax.jit(_apply(layer))(params, x)
        plain = _layer(capacity_factor=capacity_factor)
        y_merged, _ = jax.jit(_apply(plain))(merged, x)
        _assert_close(y_merged, y)


def test_merged_weight_batches_experts_and_layers_and_keeps_dense_weights():
    """merged_weight of [E, D, F] experts, of [L, E, D, F] stacked experts and of a stacked
    dense q [L, D, N, H] adds each matrix's own A·B; an unstacked dense q is as before."""
    rng = np.random.default_rng(16)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    w, a, b = normal(E, D, F), normal(E, D, 3), normal(E, 3, F)
    expected = np.stack([w[e] + 0.5 * a[e] @ b[e] for e in range(E)])
    _assert_close(merged_weight(w, a, b, 0.5), expected)
    w, a, b = normal(2, E, D, F), normal(2, E, D, 3), normal(2, E, 3, F)
    expected = np.stack(
        [np.stack([w[i, e] + 0.5 * a[i, e] @ b[i, e] for e in range(E)]) for i in range(2)]
    )
    _assert_close(merged_weight(w, a, b, 0.5), expected)
    w, a, b = normal(2, D, 2, 5), normal(2, D, 3), normal(2, 3, 2, 5)
    expected = np.stack(
        [w[i] + 0.5 * (a[i] @ b[i].reshape(3, -1)).reshape(D, 2, 5) for i in (0, 1)]
    )
    _assert_close(merged_weight(w, a, b, 0.5), expected)
    w, a, b = normal(D, 2, 5), normal(D, 3), normal(3, 2, 5)
    _assert_close(merged_weight(w, a, b, 0.5), w + 0.5 * (a @ b.reshape(3, -1)).reshape(D, 2, 5))


@pytest.mark.parametrize("capacity_factor", [pytest.param(None, marks=pytest.mark.slow), E / K])
def test_expert_adapter_dropout_is_per_token_deterministic_and_per_sequence(capacity_factor):
    """In training, the adapters' inputs are dropped out as _lora_reference spells out (gate's
    and up's x per token before dispatch; down's hidden per token and pick); the same keys give
    the same output, another layer index another; two equal sequences get different masks from
    different keys and equal ones from equal keys, and a sequence's output is the same alone as
    in a batch."""
    spec = LoraSpec(rank=3, scale=1.5, targets=ADAPTED, dropout=0.5)
    layer = _layer(capacity_factor=capacity_factor, lora=spec)
    params = _with_random_b(layer)
    apply = jax.jit(_apply(layer))
    x, _ = _inputs(seed=17)
    keys = row_keys(jax.random.key(3), jnp.arange(2, dtype=jnp.int32))
    dropout = AdapterDropout(keys, 2)
    y, _ = apply(params, x, None, dropout)
    _assert_close(y, _lora_reference(params, x, spec.scale, dropout, spec.dropout))
    np.testing.assert_array_equal(np.asarray(apply(params, x, None, dropout)[0]), np.asarray(y))
    assert float(jnp.abs(y - apply(params, x)[0]).max()) > 1e-3  # dropout changed something
    assert float(jnp.abs(y - apply(params, x, None, dropout.at_layer(5))[0]).max()) > 1e-3
    twins = jnp.stack([x[0], x[0]])
    y_twins, _ = apply(params, twins, None, dropout)
    assert float(jnp.abs(y_twins[0] - y_twins[1]).max()) > 1e-3
    same = AdapterDropout(jnp.stack([keys[0], keys[0]]), 2)
    y_same, _ = apply(params, twins, None, same)
    np.testing.assert_array_equal(np.asarray(y_same[0]), np.asarray(y_same[1]))
    alone, _ = apply(params, x[:1], None, AdapterDropout(keys[:1], 2))
    _assert_close(alone[0], y[0])


@pytest.mark.parametrize("capacity_factor", [None, E / K])
@pytest.mark.parametrize("fmt", [pytest.param("int8", marks=pytest.mark.slow), "nf4"])
def test_qlora_experts_read_their_quantised_weights_dequantised(fmt, capacity_factor):
    """QLoRA: gate and up [E, D, F] block-quantised along D, down [E, F, D] along F; the layer
    with adapters gives the output, and the adapters' gradients, of the same layer on the
    dequantised weights (and not those of the unquantised ones)."""
    layer = _layer(capacity_factor=capacity_factor, lora=SPEC)
    params = _with_random_b(layer)
    adapters, base = split_adapters(params)
    quantised = {**base, **{name: quantize(base[name], fmt, 2, 1) for name in ADAPTED}}
    dequantised = {**base, **{name: quantised[name][...] for name in ADAPTED}}
    apply = _apply(layer)
    x, probe = _inputs(seed=18)

    @jax.jit
    def run(base):
        def loss(adapters):
            y = apply({**base, **adapters}, x)[0]
            return jnp.sum(y * probe), y

        return jax.grad(loss, has_aux=True)(adapters)

    grads, y = run(quantised)
    grads_ref, y_ref = run(dequantised)
    _assert_close(y, y_ref)
    for name in adapters:
        _assert_close(grads[name], grads_ref[name])
    y_unquantised = jax.jit(apply)(params, x)[0]
    assert float(jnp.abs(y - y_unquantised).max()) > 1e-4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"top_k": 4}, r"model\.moe\.top_k set but model\.moe\.num_experts=0"),
        ({"num_experts": -1}, r"model\.moe\.num_experts=-1 must be positive"),
        (
            {"num_experts": 8, "top_k": 9, "expert_dim": 16},
            r"model\.moe\.top_k=9 exceeds model\.moe\.num_experts=8; set model\.moe\.top_k <= 8",
        ),
        ({"num_experts": 8}, r"model\.moe\.expert_dim=0 must be positive"),
        (
            {"num_experts": 8, "expert_dim": 16, "score": "sigmod"},
            r"model\.moe\.score='sigmod' is not one of softmax, sigmoid \(did you mean 'sigmoid'\?\)",
        ),
        (
            {"num_experts": 8, "expert_dim": 16, "top_k": 1},
            r"normalize_top_k=true with model\.moe\.top_k=1 .* set model\.moe\.normalize_top_k=false",
        ),
        (
            {"num_experts": 8, "expert_dim": 16, "capacity_factor": 0.0},
            r"model\.moe\.capacity_factor=0\.0 must be positive",
        ),
        (
            {"num_experts": 8, "expert_dim": 16, "aux_loss_coef": -0.1},
            r"model\.moe\.aux_loss_coef=-0\.1 must be >= 0",
        ),
    ],
)
def test_check_moe_names_the_key_the_value_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        check_moe(MoeConfig(**overrides))
    assert "\n" not in str(error.value)


def test_check_moe_accepts_dense_and_the_families_settings():
    check_moe(MoeConfig())
    check_moe(MoeConfig(num_experts=8, top_k=2, expert_dim=14336, aux_loss_coef=0.001))
    check_moe(
        MoeConfig(num_experts=128, top_k=8, expert_dim=768, normalize_top_k=False, z_loss_coef=1e-3)
    )
    check_moe(MoeConfig(num_experts=16, top_k=1, expert_dim=64, normalize_top_k=False))
    check_moe(MoeConfig(num_experts=8, expert_dim=32, score="sigmoid", capacity_factor=1.25))


def _hf_block(family: str, norm_topk_prob: bool):
    """transformers' sparse MoE block of `family` (fp32, random weights) and its MoeFeedForward
    twin (the parameters copied in the layout of the module's docstring)."""
    import torch
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    sizes = {"hidden_size": D, "num_experts_per_tok": K, "num_attention_heads": 2}
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(
            **sizes, num_experts=E, moe_intermediate_size=F, norm_topk_prob=norm_topk_prob
        )
        block = Qwen3MoeSparseMoeBlock(config)
    else:
        block = MixtralSparseMoeBlock(
            MixtralConfig(**sizes, num_local_experts=E, intermediate_size=F)
        )
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 0.5)
    block.eval()
    layer = _layer(normalize_top_k=norm_topk_prob)
    gate_up = block.experts.gate_up_proj.detach().numpy()  # [E, 2F, D]
    params = {
        "router": block.gate.weight.detach().numpy().T,  # [E, D] → [D, E]
        "gate": gate_up[:, :F].transpose(0, 2, 1),
        "up": gate_up[:, F:].transpose(0, 2, 1),
        "down": block.experts.down_proj.detach().numpy().transpose(0, 2, 1),  # [E, D, F]
    }
    return block, layer, {name: jnp.asarray(value) for name, value in params.items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "norm_topk_prob"),
    [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)],
)
def test_the_layer_equals_transformers_blocks_and_load_balancing_loss(family, norm_topk_prob):
    """MoeFeedForward with transformers' weights gives its sparse MoE block's output (1e-5,
    fp32), and aux_loss is load_balancing_loss_func's on the block's router logits."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    block, layer, params = _hf_block(family, norm_topk_prob)
    x, _ = _inputs(seed=7, shape=(2, 6, D))
    mask = np.array([[1] * 6, [1] * 3 + [0] * 3], np.int64)
    x_torch = torch.from_numpy(np.array(x))
    with torch.no_grad():
        expected = block(x_torch.clone()).numpy()
        logits = block.gate(x_torch.reshape(-1, D))[0]
        aux = float(load_balancing_loss_func((logits,), E, K))
        aux_masked = float(load_balancing_loss_func((logits,), E, K, torch.from_numpy(mask)))
    apply = jax.jit(_apply(layer))
    y, stats = apply(params, x)
    _, masked = apply(params, x, jnp.asarray(mask, bool))
    _assert_close(y, expected)
    _assert_close(stats.aux_loss, aux)
    _assert_close(masked.aux_loss, aux_masked)
