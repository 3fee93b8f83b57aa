"""Who a process is: explicit config, torchrun-style variables, SLURM / Open MPI, in that order."""

import os

import pytest

from meshtrain.config import DistributedConfig
from meshtrain.distributed.environment import (
    check_fixed_node_count,
    env_process_id,
    first_slurm_host,
    hydra_output_subdir,
    read_torchrun_env,
    resolve_process_spec,
    torchrun_agent_argv,
)
from meshtrain.errors import ConfigError

TORCHRUN = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "5", "WORLD_SIZE": "8"}
SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "3",
}


def spec(environ, agent_argv=(), **config):
    return resolve_process_spec(DistributedConfig(**config), environ, agent_argv)


def test_nothing_set_is_a_single_process():
    assert spec({}) is None
    assert spec({"LOCAL_RANK": "0"}) is None  # LOCAL_RANK alone starts nothing
    assert spec({**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert spec({**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1"}) is None


def test_torchrun_variables_count_processes():
    got = spec(TORCHRUN)
    assert (got.coordinator_address, got.num_processes, got.process_id) == ("10.0.0.1:29500", 8, 5)
    assert got.cluster_detection == "deactivate"  # a SLURM job around it must not override it
    assert got.local_device_ids is None
    assert got.fully_known


def test_torchrun_local_rank_picks_the_accelerator_only_with_several_processes_per_machine():
    several = {**TORCHRUN, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert spec(several).local_device_ids == [1]
    assert spec({**several, "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}).local_device_ids is None
    # Our launcher assigns devices itself; faked CPU devices have no ids to pick.
    assert spec({**several, "JAX_LOCAL_DEVICE_IDS": "2,3"}).local_device_ids is None
    assert spec({**several, "JAX_PLATFORMS": "cpu"}).local_device_ids is None


def test_explicit_config_wins_key_by_key():
    got = spec(TORCHRUN, coordinator_address="10.0.0.1:29501", local_device_ids=[0, 1])
    assert got.coordinator_address == "10.0.0.1:29501"  # e.g. torchrun's own store holds 29500
    assert (got.num_processes, got.process_id, got.local_device_ids) == (8, 5, [0, 1])
    alone = spec({}, coordinator_address="h:1234", num_processes=4, process_id=3)
    assert (alone.source, alone.coordinator_address, alone.num_processes) == ("config", "h:1234", 4)


def test_jax_coordinator_address_with_explicit_count_and_id():
    got = spec({"JAX_COORDINATOR_ADDRESS": "h:1234"}, num_processes=2, process_id=1)
    assert (got.source, got.coordinator_address, got.num_processes, got.process_id) == (
        "JAX_COORDINATOR_ADDRESS",
        "h:1234",
        2,
        1,
    )
    assert got.fully_known


def test_explicit_cluster_detection_beats_the_torchrun_variables():
    got = spec(TORCHRUN, cluster_detection="mpi4py")
    assert got.cluster_detection == "mpi4py"
    assert (got.coordinator_address, got.num_processes, got.process_id) == (None, None, None)


def test_slurm_and_open_mpi_give_jax_s_own_coordinator_address():
    got = spec(SLURM)
    assert got.source == "slurm cluster"
    # The first node; port 4242 % 4096 + 61440, as jax/_src/clusters/slurm_cluster.py picks it.
    assert (got.coordinator_address, got.num_processes, got.process_id) == ("node01:61586", 8, 3)
    assert got.fully_known  # so the roll call runs
    assert got.cluster_detection is None  # JAX still gives task SLURM_LOCALID its GPU
    assert spec({**SLURM, "JAX_COORDINATOR_PORT": "4000"}).coordinator_address == "node01:4000"
    ompi = {
        "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.1,10.1.0.1:34911",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_RANK": "2",
    }
    got = spec({**SLURM, **ompi})  # JAX's order: Open MPI first
    assert got.source == "ompi cluster"
    # Job 1531576320 / 4096 = 373920; 373920 % 4096 + 61440 = 62624.
    assert (got.coordinator_address, got.num_processes, got.process_id) == ("10.0.0.1:62624", 4, 2)


@pytest.mark.parametrize(
    ("node_list", "first"),
    [
        ("node7", "node7"),
        ("node7,gpu2", "node7"),
        ("node[07-15],gpu2", "node07"),
        ("node[07,09-15]", "node07"),
        ("gpu-a[3]", "gpu-a3"),
    ],
)
def test_first_slurm_host(node_list, first):
    assert first_slurm_host(node_list) == first
    # torchrun-style variables win over the cluster.
    assert spec({**SLURM, **TORCHRUN}).process_id == 5


@pytest.mark.parametrize(
    ("environ", "config", "message"),
    [
        (
            {"MASTER_ADDR": "h", "RANK": "0", "WORLD_SIZE": "2"},
            {},
            "the torchrun-style environment is incomplete: MASTER_ADDR, RANK, WORLD_SIZE are set "
            "but MASTER_PORT is not",
        ),
        ({**TORCHRUN, "RANK": "8"}, {}, "RANK=8 is not below WORLD_SIZE=8"),
        ({**TORCHRUN, "RANK": "two"}, {}, "RANK='two' is not an integer"),
        ({**TORCHRUN, "WORLD_SIZE": "0"}, {}, "WORLD_SIZE=0 must be at least 1"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, {}, "MASTER_PORT=70000 is not a TCP port"),
        (
            {**TORCHRUN, "LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "4"},
            {},
            "LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4",
        ),
        (
            TORCHRUN,
            {"coordinator_address": "10.0.0.1"},
            "distributed.coordinator_address='10.0.0.1' is not host:port",
        ),
        (
            TORCHRUN,
            {"process_id": 9},
            "process id 9 (distributed.process_id or RANK) is not in 0..7",
        ),
        ({}, {"process_id": 1}, "distributed.process_id set, but no coordinator, process count"),
        (
            {"JAX_COORDINATOR_ADDRESS": "h:1234"},
            {},
            "JAX_COORDINATOR_ADDRESS is set but the number of processes",
        ),
        ({}, {"cluster_detection": "pbs"}, "distributed.cluster_detection='pbs' is not a JAX"),
        (
            {**TORCHRUN, "TORCHELASTIC_RUN_ID": "none", "MASTER_PORT": "65535"},
            {},
            "MASTER_PORT=65535 under torchrun: meshtrain's coordinator takes MASTER_PORT+1=65536, "
            "which is not a TCP port; choose a lower --master_port, or set "
            "distributed.coordinator_port",
        ),
        (
            TORCHRUN,
            {"coordinator_port": 0},
            "distributed.coordinator_port=0 is not a TCP port; use one in 1..65535",
        ),
        (
            TORCHRUN,
            {"coordinator_port": 29600, "coordinator_address": "10.0.0.1:29601"},
            "distributed.coordinator_port=29600 is the port next to MASTER_ADDR (torchrun), but",
        ),
        ({}, {"coordinator_port": 29600}, "set distributed.coordinator_address=host:port alone"),
        (
            {**TORCHRUN, "TORCHELASTIC_RUN_ID": "none", "PET_NNODES": "1:4"},
            {},
            "torchrun --nnodes=1:4 asks for an elastic number of machines, which meshtrain cannot "
            "follow (the mesh and each process's share of the batch are fixed at start-up); give "
            "a fixed count, e.g. --nnodes=4 (with --max-restarts, a restarted group resumes from "
            "the newest checkpoint)",
        ),
    ],
)
def test_inconsistent_values_are_one_clear_error(environ, config, message):
    with pytest.raises(ConfigError) as err:
        spec(environ, **config)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_read_torchrun_env_none_without_variables():
    assert read_torchrun_env({"LOCAL_RANK": "3"}) is None
    env = read_torchrun_env({**TORCHRUN, "MASTER_ADDR": "fe80::1"})
    assert env.coordinator_address == "[fe80::1]:29500"


def test_only_process_0_writes_the_hydra_subdir():
    assert env_process_id(None, {}) == 0
    assert env_process_id(None, {"RANK": "3"}) == 3
    assert env_process_id(None, SLURM) == 3
    assert env_process_id(2, {"RANK": "3"}) == 2  # distributed.process_id wins
    assert env_process_id(None, {"RANK": "x"}) == 0  # never raises: start-up reports it
    assert hydra_output_subdir(0) == f".hydra-pending-{os.getpid()}"  # .hydra/ once accepted
    assert hydra_output_subdir(1) is None


AGENT = {**TORCHRUN, "TORCHELASTIC_RUN_ID": "none", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}


def test_under_torchrun_the_coordinator_takes_the_port_after_its_store():
    """torchrun's agent (TORCHELASTIC_RUN_ID) holds MASTER_PORT for its own store."""
    got = spec(AGENT)
    assert got.coordinator_address == "10.0.0.1:29501"
    assert got.coordinator_origin == (
        "MASTER_PORT+1, since torchrun's agent holds MASTER_PORT=29500 for its own store"
    )
    assert got.source == "torchrun agent (MASTER_ADDR, RANK, WORLD_SIZE, LOCAL_RANK)"
    assert (got.num_processes, got.process_id, got.local_device_ids) == (8, 5, [1])
    assert spec({**AGENT, "MASTER_ADDR": "fe80::1"}).coordinator_address == "[fe80::1]:29501"
    # The same variables set by hand or by meshtrain.launch: MASTER_PORT itself is free.
    assert spec(TORCHRUN).coordinator_address == "10.0.0.1:29500"
    assert spec(TORCHRUN).coordinator_origin == ""


def test_coordinator_port_overrides_the_derived_port():
    for environ in (AGENT, TORCHRUN):
        got = spec(environ, coordinator_port=29533)
        assert got.coordinator_address == "10.0.0.1:29533"
        assert got.coordinator_origin == "distributed.coordinator_port"


@pytest.mark.parametrize(
    ("argv", "environ", "refused"),
    [
        (["torchrun", "--nnodes=1:4", "--nproc_per_node=2", "run_training.py"], {}, True),
        (["torchrun", "--nnodes", "2:3", "run_training.py"], {}, True),
        (["torchrun", "--nnodes=2", "run_training.py"], {"PET_NNODES": "1:4"}, False),
        (["torchrun", "--nnodes=4:4", "run_training.py"], {}, False),
        (["torchrun", "--nproc_per_node=4", "run_training.py"], {}, False),
        ([], {"PET_NNODES": "1:2"}, True),
    ],
)
def test_an_elastic_node_count_is_refused(argv, environ, refused):
    if not refused:
        check_fixed_node_count(argv, environ)
        assert spec({**AGENT, **environ}, agent_argv=argv) is not None
        return
    with pytest.raises(ConfigError, match="asks for an elastic number of machines"):
        spec({**AGENT, **environ}, agent_argv=argv)
    # The same variables without torchrun's agent: no torchrun command line to check.
    assert spec({**TORCHRUN, **environ}, agent_argv=argv) is not None


def test_the_agent_command_line_is_read_only_under_torchrun():
    assert torchrun_agent_argv({}) == []
    assert isinstance(torchrun_agent_argv({"TORCHELASTIC_RUN_ID": "x"}), list)
