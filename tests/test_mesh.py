"""mesh_shape parsing, -1 resolution, axis order and the one-line errors."""

import jax
import pytest

from meshtrain.errors import ConfigError
from meshtrain.mesh import MESH_AXES, build_mesh, parse_mesh_shape


@pytest.mark.parametrize(
    ("mesh_shape", "expected"),
    [
        ([[1, 1], ["fsdp", "tp"]], {"dp": 1, "fsdp": 1, "tp": 1}),
        ([[8, 1], ["fsdp", "tp"]], {"dp": 1, "fsdp": 8, "tp": 1}),
        ([[4, 2], ["fsdp", "tp"]], {"dp": 1, "fsdp": 4, "tp": 2}),
        ([[-1, 2], ["fsdp", "tp"]], {"dp": 1, "fsdp": 4, "tp": 2}),
        ([[2, -1], ["fsdp", "tp"]], {"dp": 1, "fsdp": 2, "tp": 4}),
        ([[2, 4], ["tp", "fsdp"]], {"dp": 1, "fsdp": 4, "tp": 2}),
        ([[8], ["fsdp"]], {"dp": 1, "fsdp": 8, "tp": 1}),
        ([[2, 2, 2], ["dp", "fsdp", "tp"]], {"dp": 2, "fsdp": 2, "tp": 2}),
    ],
)
def test_parse_mesh_shape(mesh_shape, expected):
    num_devices = 1 if mesh_shape[0] == [1, 1] else 8
    assert parse_mesh_shape(mesh_shape, num_devices).sizes == expected


@pytest.mark.parametrize(
    ("mesh_shape", "message"),
    [
        (
            [[3, 1], ["fsdp", "tp"]],
            "model.mesh_shape [[3,1],[fsdp,tp]] uses 3 devices but 8 are visible; use "
            "[[8,1],[fsdp,tp]] or [[4,2],[fsdp,tp]], or -1 for one size (e.g. [[-1,1],[fsdp,tp]])",
        ),
        (
            [[4, 2], ["data", "tp"]],
            "model.mesh_shape [[4,2],[data,tp]]: unknown axis 'data'; known axes are dp, fsdp, tp, "
            "e.g. [[8,1],[fsdp,tp]]",
        ),
        (
            [[4, 2, 1], ["fsdp", "tp"]],
            "model.mesh_shape [[4,2,1],[fsdp,tp]] has 3 sizes but 2 axis names; give one size per "
            "name, e.g. [[8,1],[fsdp,tp]]",
        ),
        (
            [[-1, -1], ["fsdp", "tp"]],
            "model.mesh_shape [[-1,-1],[fsdp,tp]] has more than one -1; only one size may be -1",
        ),
        (
            [[-1, 3], ["fsdp", "tp"]],
            "model.mesh_shape [[-1,3],[fsdp,tp]]: the other sizes multiply to 3, which does not "
            "divide the 8 visible devices; use [[8,1],[fsdp,tp]] or [[4,2],[fsdp,tp]], or -1 for "
            "one size (e.g. [[-1,1],[fsdp,tp]])",
        ),
        (
            [[2, 4], ["fsdp", "fsdp"]],
            "model.mesh_shape [[2,4],[fsdp,fsdp]] names an axis twice; name each axis once",
        ),
        ([[0, 8], ["fsdp", "tp"]], "sizes must be positive integers or one -1"),
        (
            [[2, 4], ["pp", "tp"]],
            "axis 'pp' is reserved (pipeline parallelism is not supported yet)",
        ),
        ("4x2", "model.mesh_shape='4x2' is not [[sizes],[names]]"),
    ],
)
def test_parse_mesh_shape_errors(mesh_shape, message):
    with pytest.raises(ConfigError) as err:
        parse_mesh_shape(mesh_shape, 8)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_build_mesh_puts_tp_innermost():
    mesh = build_mesh(parse_mesh_shape([[2, 4], ["tp", "fsdp"]], 8))
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 4, "tp": 2}
    # Neighbouring device ids (the fastest links on a GPU box) share a tp group.
    ids = [[d.id for d in row] for row in mesh.devices[0]]
    assert all(abs(row[1] - row[0]) == 1 for row in ids)
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
