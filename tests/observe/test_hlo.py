"""Reading compiled HLO: shapes, replica groups in all three spellings, loop trip counts, the
FLOPs of the matrix products."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.observe.hlo import (
    Array,
    matmul_flops,
    parse_module,
    parse_shape,
    replica_groups,
    source_target_pairs,
)


def instruction(attributes: str):
    text = (
        "HloModule m\n\nENTRY %main (p: f32[8]) -> f32[8] {\n"
        "  %p = f32[8]{0} parameter(0)\n"
        f"  ROOT %ar = f32[8]{{0}} all-reduce(%p), channel_id=1, {attributes}, to_apply=%add\n"
        "}\n"
    )
    return parse_module(text).by_name["ar"]


def test_parse_shape():
    assert parse_shape("f32[8,16,128]{2,1,0}") == [Array("f32", (8, 16, 128))]
    shape = "(f32[], bf16[4,2]{1,0}, /*index=2*/s32[3]{0}, pred[2,2]{1,0})"
    assert [str(a) for a in parse_shape(shape)] == ["f32[]", "bf16[4,2]", "s32[3]", "pred[2,2]"]
    assert [a.bytes for a in parse_shape(shape)] == [4, 16, 12, 4]


@pytest.mark.parametrize(
    ("attributes", "expected"),
    [
        ("replica_groups={}", [[0, 1, 2, 3, 4, 5, 6, 7]]),
        ("replica_groups={{0,2},{4,6},{1,3},{5,7}}", [[0, 2], [4, 6], [1, 3], [5, 7]]),
        ("replica_groups=[4,2]<=[8]", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        # iota(8) as [2,2,2], transposed (2,1,0): element (i,j,k) = 4k + 2j + i.
        ("replica_groups=[4,2]<=[2,2,2]T(2,1,0)", [[0, 4], [2, 6], [1, 5], [3, 7]]),
        ("replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", [list(range(8))]),
        (
            "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}",
            [[0, 2, 4, 6], [1, 3, 5, 7]],
        ),
        # Devices placed by a transposed iota: mesh position (a, b) holds device 2·b + a... of [4,2]ᵀ.
        (
            "replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}",
            [[0, 2, 4, 6], [1, 3, 5, 7]],
        ),
        (
            "replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], device_ids=([2,2,2]T(2,1,0)) {'axis_0'}",
            [[0, 1], [4, 5], [2, 3], [6, 7]],
        ),
        # A sub-axis: the middle factor of size 2 of an axis of 8 split as 2 × 2 × 2.
        ("replica_groups=mesh['a'=8] {'a':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        # Two axes grouped together, in the order listed.
        ("replica_groups=mesh['a'=2,'b'=4] {'b','a'}", [[0, 4, 1, 5, 2, 6, 3, 7]]),
    ],
)
def test_replica_group_spellings(attributes, expected):
    groups = replica_groups(instruction(attributes + ", use_global_device_ids=true"), 8)
    assert groups.tolist() == expected


def test_source_target_pairs():
    text = (
        "HloModule m\n\nENTRY %main (p: f32[8]) -> f32[8] {\n"
        "  %p = f32[8]{0} parameter(0)\n"
        "  ROOT %cp = f32[8]{0} collective-permute(%p), channel_id=1, "
        "source_target_pairs={{0,0},{1,2},{2,1},{3,3}}\n}\n"
    )
    pairs = source_target_pairs(parse_module(text).by_name["cp"])
    assert pairs.tolist() == [[0, 0], [1, 2], [2, 1], [3, 3]]


def _loops(module):
    return [
        i
        for instructions in module.computations.values()
        for i in instructions
        if i.opcode == "while"
    ]


def _scan_module(length: int):
    """A jitted lax.scan whose body reduces a sharded array: one all-reduce per iteration."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec(None, "x"))

    def f(xs):  # xs: [length, 8], each row sharded over the 8 devices
        def body(carry, x):
            return jnp.tanh(carry + jnp.sum(x * carry)), None

        return jax.lax.scan(body, jnp.ones(()), xs)[0]

    spec = jax.ShapeDtypeStruct((length, 8), jnp.float32, sharding=sharding)
    return parse_module(jax.jit(f).lower(spec).compile().as_text())


def test_while_loop_runs_its_trip_count():
    module = _scan_module(5)
    counts, unknown = module.execution_counts()
    assert counts[module.entry] == 1 and not unknown
    (loop,) = _loops(module)
    assert loop.trip_count == 5
    body = loop.attribute("body").lstrip("%")
    assert counts[body] == 5
    reduces = [
        i
        for name, instructions in module.computations.items()
        for i in instructions
        if i.opcode == "all-reduce" and counts.get(name) == 5
    ]
    assert reduces, "the per-iteration all-reduce sits in the loop body"


def test_unknown_trip_count_is_flagged():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec("x"))

    def f(x, n):  # runs until a runtime value: XLA cannot know the trip count
        return jax.lax.while_loop(
            lambda c: c[1] < n, lambda c: (c[0] + jnp.sum(x * c[0]), c[1] + 1), (x[0], 0)
        )[0]

    spec = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)
    module = parse_module(jax.jit(f).lower(spec, 3).compile().as_text())
    _, unknown = module.execution_counts()
    (loop,) = _loops(module)
    assert loop.trip_count is None
    assert loop.attribute("body").lstrip("%") in unknown


def test_groups_index_the_mesh_in_row_major_order():
    """Logical device ids are positions in mesh.devices.flat (jit's device assignment)."""
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.ShapeDtypeStruct(
        (8, 8), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("a", "b"))
    )
    module = parse_module(jax.jit(lambda x: jnp.sum(x, axis=0)).lower(x).compile().as_text())
    groups = [
        replica_groups(i, 8)
        for instructions in module.computations.values()
        for i in instructions
        if i.opcode == "all-reduce"
    ]
    # Summing over "a" reduces across devices that differ in their first mesh coordinate.
    assert any(np.array_equal(g, [[0, 2, 4, 6], [1, 3, 5, 7]]) for g in groups), groups


def test_each_branch_of_a_conditional_counts_a_share_of_its_executions():
    """A scan of 6 steps whose body switches between two branches that each all-reduce once
    (Gemma 3's local and global layers): 6 all-reduces per execution, not 12."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec("x"))

    def f(xs):
        def body(carry, index):
            branches = [
                lambda c: jnp.tanh(c + jnp.sum(xs * c)),
                lambda c: jnp.sin(c * jnp.sum(xs + c)),
            ]
            return jax.lax.switch(index % 2, branches, carry), None

        return jax.lax.scan(body, jnp.ones(()), jnp.arange(6))[0]

    spec = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)
    module = parse_module(jax.jit(f).lower(spec).compile().as_text())
    counts, _ = module.execution_counts()
    (conditional,) = [
        i for c in module.computations.values() for i in c if i.opcode == "conditional"
    ]
    assert [counts[b] for b in conditional.callees] == [3.0, 3.0]  # 6 iterations / 2 branches
    reduces = sum(
        counts.get(name, 0)
        for name, instructions in module.computations.items()
        for i in instructions
        if i.opcode == "all-reduce"
    )
    assert reduces == 6


def test_matmul_flops_count_each_product_as_often_as_it_runs():
    def f(x, w, v):  # x [8, 32] · w [32, 16] once, then [8, 16] · v [16, 16] in a loop of 3
        h = x @ w
        return jax.lax.fori_loop(0, 3, lambda _, h: jnp.tanh(h @ v), h)

    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((8, 32), (32, 16), (16, 16))]
    module = parse_module(jax.jit(f).lower(*shapes).compile().as_text())
    assert matmul_flops(module) == 2 * 8 * 32 * 16 + 3 * (2 * 8 * 16 * 16)
