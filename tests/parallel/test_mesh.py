"""mesh_shape parsing, -1 resolution, axis order and the one-line errors."""

import jax
import pytest

from meshtrain.errors import ConfigError
from meshtrain.parallel.mesh import (
    MESH_AXES,
    MeshSpec,
    build_mesh,
    devices_by_host,
    parse_mesh_shape,
)


@pytest.mark.parametrize(
    ("mesh_shape", "expected"),
    [
        ([[1, 1], ["fsdp", "tp"]], {"dp": 1, "pp": 1, "fsdp": 1, "ep": 1, "cp": 1, "tp": 1}),
        ([[8, 1], ["fsdp", "tp"]], {"dp": 1, "pp": 1, "fsdp": 8, "ep": 1, "cp": 1, "tp": 1}),
        ([[4, 2], ["fsdp", "tp"]], {"dp": 1, "pp": 1, "fsdp": 4, "ep": 1, "cp": 1, "tp": 2}),
        ([[-1, 2], ["fsdp", "tp"]], {"dp": 1, "pp": 1, "fsdp": 4, "ep": 1, "cp": 1, "tp": 2}),
        ([[2, -1], ["fsdp", "tp"]], {"dp": 1, "pp": 1, "fsdp": 2, "ep": 1, "cp": 1, "tp": 4}),
        ([[2, 4], ["tp", "fsdp"]], {"dp": 1, "pp": 1, "fsdp": 4, "ep": 1, "cp": 1, "tp": 2}),
        ([[8], ["fsdp"]], {"dp": 1, "pp": 1, "fsdp": 8, "ep": 1, "cp": 1, "tp": 1}),
        (
            [[2, 2, 2], ["dp", "fsdp", "tp"]],
            {"dp": 2, "pp": 1, "fsdp": 2, "ep": 1, "cp": 1, "tp": 2},
        ),
        (
            [[2, 2, 2], ["pp", "fsdp", "tp"]],
            {"dp": 1, "pp": 2, "fsdp": 2, "ep": 1, "cp": 1, "tp": 2},
        ),
        ([[2, 4], ["ep", "fsdp"]], {"dp": 1, "pp": 1, "fsdp": 4, "ep": 2, "cp": 1, "tp": 1}),
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
            "model.mesh_shape [[4,2],[data,tp]]: unknown axis 'data'; known axes are dp, pp, fsdp, ep, cp, tp, "
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
        ("4x2", "model.mesh_shape='4x2' is not [[sizes],[names]]"),
    ],
)
def test_parse_mesh_shape_errors(mesh_shape, message):
    with pytest.raises(ConfigError) as err:
        parse_mesh_shape(mesh_shape, 8)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("platform", "hint"),
    [
        (
            "cpu",
            "; on a CPU, fake 16 devices with XLA_FLAGS=--xla_force_host_platform_device_count=16 "
            "or plan.fake_devices=16",
        ),
        ("gpu", ""),
        (None, ""),
    ],
)
def test_too_large_a_mesh_on_a_cpu_says_how_to_fake_devices(platform, hint):
    with pytest.raises(ConfigError) as err:
        parse_mesh_shape([[16, 1], ["fsdp", "tp"]], 8, platform=platform)
    assert str(err.value) == (
        "model.mesh_shape [[16,1],[fsdp,tp]] uses 16 devices but 8 are visible; use "
        "[[8,1],[fsdp,tp]] or [[4,2],[fsdp,tp]], or -1 for one size (e.g. [[-1,1],[fsdp,tp]])"
        + hint
    )


def test_a_loaded_models_mesh_names_no_training_key():
    # meshtrain-eval and meshtrain-generate have no plan.fake_devices: only XLA's flag.
    with pytest.raises(ConfigError) as err:
        parse_mesh_shape([[16, 1], ["fsdp", "tp"]], 8, platform="cpu", training=False)
    assert str(err.value).endswith(
        "; on a CPU, fake 16 devices with XLA_FLAGS=--xla_force_host_platform_device_count=16"
    )


def test_too_small_a_mesh_on_a_cpu_needs_no_faked_devices():
    with pytest.raises(ConfigError) as err:
        parse_mesh_shape([[3, 1], ["fsdp", "tp"]], 8, platform="cpu")
    assert "fake" not in str(err.value)


def test_build_mesh_puts_tp_innermost():
    mesh = build_mesh(parse_mesh_shape([[2, 4], ["tp", "fsdp"]], 8))
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"dp": 1, "pp": 1, "fsdp": 4, "ep": 1, "cp": 1, "tp": 2}
    # Neighbouring device ids (the fastest links on a GPU box) share a tp group.
    ids = [[d.id for d in row] for row in mesh.devices[0, 0, :, 0, 0]]
    assert all(abs(row[1] - row[0]) == 1 for row in ids)
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


class FakeDevice:
    """What devices_by_host reads of a jax.Device."""

    def __init__(self, process_index: int, id: int) -> None:
        self.process_index, self.id, self.platform = process_index, id, "gpu"


def _processes(processes: int, local: int) -> list[FakeDevice]:
    # jax.devices() order is not promised; shuffle it to show the result does not depend on it.
    devices = [FakeDevice(p, p * 100 + i) for p in range(processes) for i in range(local)]
    return devices[1::2] + devices[::2]


@pytest.mark.parametrize(
    ("sizes", "hosts", "local"),
    [
        ((2, 1, 4, 1, 1, 2), ["a", "b"], 8),  # [[2,4,2],[dp,fsdp,tp]] on 2 machines × 8 GPUs
        ((1, 1, 4, 1, 1, 2), ["a", "b"], 4),
        ((2, 1, 2, 1, 1, 2), ["a", "b", "c", "d"], 2),
        ((2, 1, 4, 1, 1, 1), ["a", "b"], 4),
        ((2, 1, 2, 1, 1, 2), ["a", "a", "b", "b"], 2),  # 2 processes per machine
        (
            (1, 1, 2, 1, 1, 4),
            ["a", "b", "a", "b"],
            2,
        ),  # ... numbered across machines, tp over a machine
        (
            (1, 1, 4, 1, 1, 2),
            ["a"] * 8,
            1,
        ),  # one process per GPU on one machine: tp across processes
        ((1, 2, 2, 1, 1, 2), ["a", "b"], 4),  # [[2,2,2],[pp,fsdp,tp]]: a pipeline stage per machine
    ],
)
def test_tp_stays_within_a_host_and_dp_fsdp_span_hosts(sizes, hosts, local):
    spec = MeshSpec(dict(zip(MESH_AXES, sizes, strict=True)))
    grid = devices_by_host(spec, _processes(len(hosts), local), hosts)  # [dp, pp, fsdp, ep, cp, tp]
    assert grid.shape == sizes
    for group in grid.reshape(-1, sizes[-1]):  # every tp group lies on one host
        assert len({hosts[d.process_index] for d in group}) == 1
    # Each process holds one contiguous block of the (dp × pp × fsdp) positions.
    rows = grid.reshape(-1, sizes[-1])  # [positions, tp]
    for process in range(len(hosts)):
        held = [i for i, row in enumerate(rows) if process in {d.process_index for d in row}]
        assert held == list(range(held[0], held[-1] + 1)), (process, held)
    if hosts == ["a", "b"] and sizes[0] == 2:  # dp across machines: one replica per machine
        assert {d.process_index for d in grid[0].ravel()} == {0}
        assert {d.process_index for d in grid[1].ravel()} == {1}
    if hosts == ["a", "b"] and sizes[1] == 2:  # pp across machines: one stage per machine
        assert {d.process_index for d in grid[:, 0].ravel()} == {0}
        assert {d.process_index for d in grid[:, 1].ravel()} == {1}


def test_tp_across_hosts_is_refused():
    with pytest.raises(ConfigError) as err:
        devices_by_host(
            MeshSpec({"dp": 1, "pp": 1, "fsdp": 1, "ep": 1, "cp": 1, "tp": 8}),
            _processes(2, 4),
            ["a", "b"],
        )
    assert str(err.value) == (
        "model.mesh_shape [[1,1,1,1,1,8],[dp,pp,fsdp,ep,cp,tp]]: tp=8 does not divide the 4 devices of each of "
        "the 2 hosts, so tp groups would span hosts; tp stays within a host (its fast links): "
        "use tp in {1, 2, 4} and put the rest on fsdp or dp"
    )
    # On one host, the same tp over two processes is fine.
    grid = devices_by_host(
        MeshSpec({"dp": 1, "pp": 1, "fsdp": 1, "ep": 1, "cp": 1, "tp": 8}),
        _processes(2, 4),
        ["a", "a"],
    )
    assert [d.id for d in grid.ravel()] == [0, 1, 2, 3, 100, 101, 102, 103]
