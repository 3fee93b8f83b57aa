"""Who this process is in a run: explicit config, torchrun-style variables or a detected cluster.

Reads only the environment and the `distributed` config, never JAX, so that the Hydra config
(which decides where each process writes) and the launcher can use it before JAX starts.
Precedence, key by key: `distributed.*` config (including a forced `cluster_detection`), then
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE (torchrun's names; they count processes, and a process
may own several devices), then a cluster JAX detects itself (Open MPI, SLURM), then JAX's own
JAX_COORDINATOR_ADDRESS. With none of them the run is a single process.

Under torchrun itself (its agent sets TORCHELASTIC_RUN_ID for its workers) the agent serves its
rendezvous store on MASTER_PORT, so process 0's coordinator takes the next port, MASTER_PORT + 1
(or `distributed.coordinator_port`). An elastic node count (`--nnodes=1:4`) is refused: the mesh
and each process's share of the batch are fixed at start-up.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from meshtrain.config.run_record import pending_record_name
from meshtrain.config.schema import ClusterDetection, DistributedConfig, choices
from meshtrain.errors import ConfigError

TORCHRUN_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
# The cluster detection methods of jax.distributed.initialize (jax/_src/clusters, jax 0.12).
CLUSTER_METHODS = choices(ClusterDetection)
SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)
OMPI_URI = "OMPI_MCA_orte_hnp_uri"
# Set by torchrun's agent for each process it starts, and by nothing else we know of.
TORCHRUN_AGENT_VAR = "TORCHELASTIC_RUN_ID"
# Under torchrun, JAX's coordinator (and the roll call) listen this far above MASTER_PORT, which
# torchrun's agent holds for its own rendezvous store (TCPStore) for the whole run.
TORCHRUN_COORDINATOR_OFFSET = 1
# The part of the run directory after outputs/<experiment.name>/ (configs/config.yaml); the
# launcher sets it once for all its processes, so that `${now:}` is not resolved per process.
RUN_ID_VAR = "MESHTRAIN_RUN_ID"


@dataclass(frozen=True)
class TorchrunEnv:
    """MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and the optional LOCAL_RANK, LOCAL_WORLD_SIZE."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    by_torchrun: bool = False  # started by torchrun's agent, which holds MASTER_PORT

    @property
    def coordinator_address(self) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"{host}:{self.master_port}"


@dataclass(frozen=True)
class ProcessSpec:
    """How this process joins a multi-process run; None fields are left to JAX's cluster detection."""

    source: str  # what the values came from, for logs and errors
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    local_device_ids: list[int] | None
    cluster_detection: str | None  # passed to jax.distributed.initialize
    coordinator_origin: str = ""  # where the coordinator's port comes from, for the start-up line

    @property
    def fully_known(self) -> bool:
        """Address, count and id are all known, so no cluster detection is needed."""
        return None not in (self.coordinator_address, self.num_processes, self.process_id)


def env_int(environ: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    """The integer value of an environment variable, or a ConfigError naming it."""
    raw = environ[name]
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; set it to a whole number") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be at least {minimum}")
    return value


def read_torchrun_env(environ: Mapping[str, str]) -> TorchrunEnv | None:
    """The torchrun-style variables, all four or none; None when none is set."""
    present = [name for name in TORCHRUN_VARS if environ.get(name, "") != ""]
    if not present:
        return None
    missing = [name for name in TORCHRUN_VARS if name not in present]
    if missing:
        raise ConfigError(
            f"the torchrun-style environment is incomplete: {', '.join(present)} "
            f"{'is' if len(present) == 1 else 'are'} set but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not; set all of {', '.join(TORCHRUN_VARS)}, "
            "or none of them for a single process"
        )
    port = env_int(environ, "MASTER_PORT", minimum=1)
    if port > 65535:
        raise ConfigError(f"MASTER_PORT={port} is not a TCP port; use one in 1..65535, e.g. 29500")
    rank = env_int(environ, "RANK")
    world_size = env_int(environ, "WORLD_SIZE", minimum=1)
    if rank >= world_size:
        raise ConfigError(
            f"RANK={rank} is not below WORLD_SIZE={world_size}; RANK numbers the processes "
            f"0..{world_size - 1} (WORLD_SIZE counts processes, not devices)"
        )
    local_rank = env_int(environ, "LOCAL_RANK") if environ.get("LOCAL_RANK") else None
    local_world = (
        env_int(environ, "LOCAL_WORLD_SIZE", minimum=1) if environ.get("LOCAL_WORLD_SIZE") else None
    )
    if local_rank is not None and local_world is not None and local_rank >= local_world:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world}; "
            f"LOCAL_RANK numbers this machine's processes 0..{local_world - 1}"
        )
    return TorchrunEnv(
        environ["MASTER_ADDR"],
        port,
        rank,
        world_size,
        local_rank,
        local_world,
        by_torchrun=environ.get(TORCHRUN_AGENT_VAR, "") != "",
    )


def torchrun_agent_argv(environ: Mapping[str, str]) -> list[str]:
    """The command line of torchrun's agent, this process's parent (Linux), when torchrun started
    this process; [] otherwise. The agent passes its --nnodes to nobody, so it is read there."""
    if environ.get(TORCHRUN_AGENT_VAR, "") == "":
        return []
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]


def _torchrun_nnodes(agent_argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """torchrun's --nnodes value ("2", "1:4"), from its command line or PET_NNODES; None: unknown."""
    for i, arg in enumerate(agent_argv):
        if arg == "--nnodes" and i + 1 < len(agent_argv):
            return agent_argv[i + 1]
        if arg.startswith("--nnodes="):
            return arg.split("=", 1)[1]
    return environ.get("PET_NNODES") or None


def check_fixed_node_count(agent_argv: Sequence[str], environ: Mapping[str, str]) -> None:
    """Refuses torchrun's elastic node count (--nnodes=MIN:MAX, MIN < MAX): the processes, the
    mesh and each process's rows of the batch are fixed when the run starts."""
    nnodes = _torchrun_nnodes(agent_argv, environ)
    low, sep, high = (nnodes or "").partition(":")
    if sep and low.strip() != high.strip():
        raise ConfigError(
            f"torchrun --nnodes={nnodes} asks for an elastic number of machines, which meshtrain "
            "cannot follow (the mesh and each process's share of the batch are fixed at "
            f"start-up); give a fixed count, e.g. --nnodes={high.strip() or low.strip()} "
            "(with --max-restarts, a restarted group resumes from the newest checkpoint)"
        )


def _torchrun_coordinator(env: TorchrunEnv, port: int | None) -> tuple[str, str]:
    """(coordinator address, why that port) for torchrun-style variables: MASTER_ADDR with
    `port` (distributed.coordinator_port), else MASTER_PORT, or MASTER_PORT + 1 under torchrun."""
    host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
    if port is not None:
        if not 1 <= port <= 65535:
            raise ConfigError(
                f"distributed.coordinator_port={port} is not a TCP port; use one in 1..65535 "
                "that no other program holds on process 0's machine, or null"
            )
        return f"{host}:{port}", "distributed.coordinator_port"
    if not env.by_torchrun:
        return env.coordinator_address, ""
    port = env.master_port + TORCHRUN_COORDINATOR_OFFSET
    if port > 65535:
        raise ConfigError(
            f"MASTER_PORT={env.master_port} under torchrun: meshtrain's coordinator takes "
            f"MASTER_PORT+{TORCHRUN_COORDINATOR_OFFSET}={port}, which is not a TCP port; choose a "
            "lower --master_port, or set distributed.coordinator_port"
        )
    return (
        f"{host}:{port}",
        f"MASTER_PORT+{TORCHRUN_COORDINATOR_OFFSET}, since torchrun's agent holds "
        f"MASTER_PORT={env.master_port} for its own store",
    )


def _torchrun_device_ids(env: TorchrunEnv, environ: Mapping[str, str]) -> list[int] | None:
    """torchrun's convention on accelerators: with several processes per machine, each uses the
    device numbered LOCAL_RANK. Our launcher assigns devices itself (JAX_LOCAL_DEVICE_IDS)."""
    if (
        env.local_rank is None
        or (env.local_world_size or 1) <= 1
        or "JAX_LOCAL_DEVICE_IDS" in environ
        or environ.get("JAX_PLATFORMS", "") == "cpu"
    ):
        return None
    return [env.local_rank]


def _cluster_port(job_id: int, environ: Mapping[str, str]) -> int:
    """JAX's coordinator port for a cluster job: JAX_COORDINATOR_PORT, or one of the 4096
    ports below 65536 picked by the job id."""
    if "JAX_COORDINATOR_PORT" in environ:
        return env_int(environ, "JAX_COORDINATOR_PORT", minimum=1)
    return job_id % 2**12 + 65536 - 2**12


def first_slurm_host(node_list: str) -> str:
    """The first host of a SLURM node list: "node7", "node7,gpu2", "node[07-15],gpu2" and
    "node[07,09-15]" all give the first node, "node7" or "node07"."""
    match = re.match(r"([^,\[]*)(?:\[([^,\-\]]*))?", node_list)
    return match.group(1) + (match.group(2) or "")


def _ompi_coordinator(uri: str, environ: Mapping[str, str]) -> str:
    """The launcher's first address in OMPI_MCA_orte_hnp_uri ("1531576320.0;tcp://10.0.0.1,...:34911")."""
    match = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
    if match is None:
        raise ConfigError(f"{OMPI_URI}={uri!r} holds no tcp:// address of the Open MPI launcher")
    host = match.group(1) or f"[{match.group(2)}]"
    job = uri.split(".", 1)[0]
    if not job.isdigit():
        raise ConfigError(f"{OMPI_URI}={uri!r} does not start with the Open MPI job id")
    job_id = int(job) // 2**12  # Open MPI job ids are multiples of 2^12
    return f"{host}:{_cluster_port(job_id, environ)}"


def detect_cluster(environ: Mapping[str, str]) -> tuple[str, str, int, int] | None:
    """(method, coordinator address, process count, process id) of an Open MPI or SLURM job,
    checked in JAX's order. The address is the one JAX derives itself (jax/_src/clusters): the
    first node of the job step and a port picked by the job id."""
    if OMPI_URI in environ:
        return (
            "ompi",
            _ompi_coordinator(environ[OMPI_URI], environ),
            env_int(environ, "OMPI_COMM_WORLD_SIZE", minimum=1),
            env_int(environ, "OMPI_COMM_WORLD_RANK"),
        )
    if all(name in environ for name in SLURM_VARS):
        host = first_slurm_host(environ["SLURM_STEP_NODELIST"])
        port = _cluster_port(env_int(environ, "SLURM_JOB_ID"), environ)
        return (
            "slurm",
            f"{host}:{port}",
            env_int(environ, "SLURM_NTASKS", minimum=1),
            env_int(environ, "SLURM_PROCID"),
        )
    return None


def check_coordinator_address(address: str, key: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(
            f"{key}={address!r} is not host:port; write e.g. 10.0.0.1:29500 (process 0's "
            "address and a free port)"
        )


def resolve_process_spec(
    cfg: DistributedConfig, environ: Mapping[str, str], agent_argv: Sequence[str] = ()
) -> ProcessSpec | None:
    """How this process joins the run; None: a single process. `agent_argv`: the command line
    of torchrun's agent, when torchrun started this process (torchrun_agent_argv)."""
    if cfg.cluster_detection is not None and cfg.cluster_detection not in CLUSTER_METHODS:
        raise ConfigError(
            f"distributed.cluster_detection={cfg.cluster_detection!r} is not a JAX cluster "
            f"detection method; use one of {', '.join(CLUSTER_METHODS)}, or null"
        )
    torchrun = None if cfg.cluster_detection else read_torchrun_env(environ)
    cluster = None if torchrun or cfg.cluster_detection else detect_cluster(environ)
    local_ids: list[int] | None = None
    detection: str | None = None
    origin = ""
    if cfg.coordinator_port is not None and (torchrun is None or cfg.coordinator_address):
        raise ConfigError(
            f"distributed.coordinator_port={cfg.coordinator_port} is the port next to MASTER_ADDR "
            "(torchrun), but MASTER_ADDR is not set or distributed.coordinator_address names a "
            "port already; set distributed.coordinator_address=host:port alone instead"
        )
    if cfg.cluster_detection is not None:
        source, address, num, pid = f"{cfg.cluster_detection} cluster", None, None, None
        detection = cfg.cluster_detection
    elif torchrun is not None:
        source = "torchrun-style environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)"
        if torchrun.by_torchrun:
            check_fixed_node_count(agent_argv, environ)
            source = "torchrun agent (MASTER_ADDR, RANK, WORLD_SIZE, LOCAL_RANK)"
        address, origin = _torchrun_coordinator(torchrun, cfg.coordinator_port)
        num, pid = torchrun.world_size, torchrun.rank
        local_ids = _torchrun_device_ids(torchrun, environ)
    elif cluster is not None:
        method, address, num, pid = cluster
        source = f"{method} cluster"
    elif environ.get("JAX_COORDINATOR_ADDRESS"):
        address = environ["JAX_COORDINATOR_ADDRESS"]
        check_coordinator_address(address, "JAX_COORDINATOR_ADDRESS")
        source, num, pid = "JAX_COORDINATOR_ADDRESS", None, None
    elif None not in (cfg.coordinator_address, cfg.num_processes, cfg.process_id):
        source, address, num, pid = "config", None, None, None
    else:
        given = [
            f"distributed.{key}"
            for key in ("coordinator_address", "num_processes", "process_id", "local_device_ids")
            if getattr(cfg, key) is not None
        ]
        if given and cfg.num_processes != 1:
            raise ConfigError(
                f"{', '.join(given)} set, but no coordinator, process count and process id: "
                "set distributed.coordinator_address, distributed.num_processes and "
                "distributed.process_id (or MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE)"
            )
        return None

    # Explicit config wins key by key, e.g. another port than torchrun's own MASTER_PORT.
    if cfg.coordinator_address is not None:
        check_coordinator_address(cfg.coordinator_address, "distributed.coordinator_address")
        address, origin = cfg.coordinator_address, ""
    num = cfg.num_processes if cfg.num_processes is not None else num
    pid = cfg.process_id if cfg.process_id is not None else pid
    if cfg.local_device_ids is not None:
        local_ids = list(cfg.local_device_ids)
    if num is not None and num < 1:
        raise ConfigError(f"distributed.num_processes={num} must be at least 1")
    if pid is not None and (pid < 0 or (num is not None and pid >= num)):
        raise ConfigError(
            f"process id {pid} (distributed.process_id or RANK) is not in 0..{(num or 1) - 1}; "
            f"number the {num} processes from 0"
        )
    if source == "JAX_COORDINATOR_ADDRESS" and None in (num, pid):
        raise ConfigError(
            "JAX_COORDINATOR_ADDRESS is set but the number of processes and this process's id "
            "are not; set distributed.num_processes and distributed.process_id"
        )
    if num == 1:
        return None
    if cluster is None and None not in (address, num, pid):
        detection = "deactivate"  # everything is known: a SLURM job around us must not override it
    return ProcessSpec(source, address, num, pid, local_ids, detection, origin)


def env_process_id(explicit: int | None = None, environ: Mapping[str, str] | None = None) -> int:
    """This process's id as far as it is known before JAX starts (0 if unknown); never raises."""
    if explicit is not None:
        return int(explicit)
    environ = os.environ if environ is None else environ
    names = ["RANK"]
    if OMPI_URI in environ:
        names.append("OMPI_COMM_WORLD_RANK")
    if all(name in environ for name in SLURM_VARS):
        names.append("SLURM_PROCID")
    for name in names:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def hydra_output_subdir(process_id: int | None) -> str | None:
    """Hydra's `output_subdir`: on process 0 a directory of its own that becomes the run's
    `.hydra/` once the run is accepted (config.run_record); null elsewhere, so that only process 0
    writes a record."""
    return pending_record_name() if env_process_id(process_id) == 0 else None


def register_run_dir_resolvers() -> None:
    """The resolvers configs/config.yaml uses in its `hydra:` section."""
    OmegaConf.register_new_resolver("meshtrain.hydra_subdir", hydra_output_subdir, replace=True)
