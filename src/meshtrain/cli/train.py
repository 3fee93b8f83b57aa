"""`python run_training.py` (or `meshtrain-train`): Hydra composes the config, bad input
becomes one line and exit code 2.

Hydra reports its own composition errors (unknown keys, wrong types) as several lines and exit
code 1; we ask it to raise them instead and print one line that names the key and the fix.
`HYDRA_FULL_ERROR=1` (or `MESHTRAIN_DEBUG=1`) shows the full traceback instead.

Before JAX starts its backend, the command also turns on JAX's persistent compilation cache
(training.compilation_cache_dir) and, on GPU, adds meshtrain's default XLA flags
(training.xla_gpu_flags); docs/performance.md.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import logging
import os
import pkgutil
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from meshtrain.cli.exit import EXIT_CHECKPOINT_WRITE, EXIT_NONFINITE, fail, fail_now
from meshtrain.config.caches import AUTO_CACHE, cache_dir
from meshtrain.config.hydra import (
    CHECKOUT_CONFIGS,
    list_entry_keys,
    register_configs,
    to_config,
    unknown_entry_key_message,
    unknown_key_message,
)
from meshtrain.config.run_record import discard_run_record
from meshtrain.distributed.environment import register_run_dir_resolvers
from meshtrain.distributed.xla_flags import merge_xla_flags
from meshtrain.errors import ConfigError, DistributedError, did_you_mean
from meshtrain.units import MIB

if TYPE_CHECKING:
    from meshtrain.checkpoint.writes import CheckpointWriteError

log = logging.getLogger(__name__)

# At import as well as in make_main: a Hydra launcher that runs the jobs in other processes
# (submitit) imports this module there and resolves `hydra.output_subdir` without make_main.
register_run_dir_resolvers()
# Read once at import, before main() sets HYDRA_FULL_ERROR for its own use.
_USER_WANTS_TRACEBACK = "1" in (
    os.environ.get("HYDRA_FULL_ERROR"),
    os.environ.get("MESHTRAIN_DEBUG"),
)


def _wants_traceback() -> bool:
    return _USER_WANTS_TRACEBACK


def _entry_index(err: BaseException, list_key: str, key: str) -> int | None:
    """The index of the first entry holding `key` in the list that a failed `list_key=[...]`
    override sets (Hydra's message repeats it as `+list_key=[...]`), or None if unknown."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    prefix = f"+{list_key}="
    for line in str(err).splitlines():
        _, found, override = line.partition(prefix)
        if not found:
            continue
        try:
            value = OverridesParser.create().parse_override(f"{list_key}={override}").value()
        except HydraException:
            return None
        entries = value if isinstance(value, list) else []
        return next((i for i, e in enumerate(entries) if isinstance(e, dict) and key in e), None)
    return None


def _unknown_key_message(err: BaseException, cause: OmegaConfBaseException, key: str) -> str:
    """unknown_key_message, or unknown_entry_key_message when the key is inside an entry of a
    list of the schema (a data.mixture source), where OmegaConf names the key alone."""
    entry = getattr(cause, "object_type", None)
    list_key = next((name for name, kind in list_entry_keys() if kind is entry), None)
    if list_key is None:
        return unknown_key_message(key)
    index = _entry_index(err, list_key, key)
    return unknown_entry_key_message(key, list_key, entry, index)


def describe_config_error(err: BaseException) -> str:
    """One line for a Hydra/OmegaConf composition error, naming the key and what to do."""
    if isinstance(err, MissingConfigException) and err.options and err.missing_cfg_file:
        group, _, choice = err.missing_cfg_file.rpartition("/")
        return (
            f"{group}={choice} is not a config in configs/{group}/"
            f"{did_you_mean(choice, err.options)}; choose one of: {', '.join(err.options)}"
        )
    cause = err
    while cause.__cause__ is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None) or "?"
        detail = str(getattr(cause, "msg", "") or cause).splitlines()[0]
        if "not in struct" in detail or ("Key '" in detail and "not" in detail):
            return _unknown_key_message(err, cause, key)
        return (
            f"bad value for '{key}': {detail}; see `python run_training.py --cfg job` for its type"
        )
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "Could not override" in first or "Could not append" in first:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        return " ".join(lines[:3])
    return first


# meshtrain's XLA flags for GPU runs (docs/performance.md), each added to XLA_FLAGS unless it is
# set there already: the latency-hiding scheduler overlaps collectives with compute, and larger
# combine thresholds merge the many small per-parameter collectives of FSDP into fewer, larger ones.
DEFAULT_XLA_GPU_FLAGS: dict[str, str] = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_all_reduce_combine_threshold_bytes": str(128 * MIB),
    "xla_gpu_all_gather_combine_threshold_bytes": str(128 * MIB),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(64 * MIB),
}
_GPU_PLATFORMS = ("cuda", "gpu", "rocm")


def _gpu_plugin_installed() -> bool:
    names = [entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")]
    try:
        import jax_plugins  # a namespace package, present with a GPU plugin

        names += [module.name for module in pkgutil.iter_modules(jax_plugins.__path__)]
    except ImportError:
        pass
    return any(kind in name for name in names for kind in ("cuda", "rocm"))


# The device nodes of NVIDIA's and AMD's GPU drivers: no GPU is usable on a host without them.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")


def gpu_present() -> bool:
    return any(Path(node).exists() for node in GPU_DEVICE_NODES)


def gpu_expected(platforms: str | None) -> bool:
    """Whether JAX will run on a GPU, decided before its backend starts: `platforms` (JAX_PLATFORMS
    or jax_platforms) names one, or is unset and a CUDA or ROCm plugin is installed on a host
    with a GPU."""
    if platforms:
        return any(p.strip() in _GPU_PLATFORMS for p in platforms.split(","))
    return _gpu_plugin_installed() and gpu_present()


def skip_gpu_plugin_without_gpu() -> bool:
    """A GPU plugin installed on a host without a GPU (the gpu-compile extra on a laptop, for
    plan.target) would print its failure to start at every run: when JAX_PLATFORMS is unset,
    there is no GPU and no TPU runtime, JAX is told to use the CPU. Returns whether it was.
    Must run before JAX starts its backend."""
    import jax  # here, so that `--help` and `--cfg job` need no JAX

    from meshtrain.distributed.devices import use_cpu

    if jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS"):
        return False
    if not _gpu_plugin_installed() or gpu_present() or importlib.util.find_spec("libtpu"):
        return False
    use_cpu("a GPU plugin without a GPU")
    return True


def configure_xla_gpu_flags(enabled: bool, *, gpu_target: bool = False) -> list[str]:
    """Adds DEFAULT_XLA_GPU_FLAGS that XLA_FLAGS lacks, when `enabled` (training.xla_gpu_flags)
    and a GPU will be used, or compiled for (`gpu_target`: plan.target); returns the flags
    added. Must run before JAX starts its backend."""
    import jax  # here, so that `--help` and `--cfg job` need no JAX

    platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS")
    if not enabled or not (gpu_target or gpu_expected(platforms)):
        return []
    existing = os.environ.get("XLA_FLAGS", "")
    merged = merge_xla_flags(existing, DEFAULT_XLA_GPU_FLAGS)
    added = merged[len(existing.strip()) :].split()
    if added:
        os.environ["XLA_FLAGS"] = merged
        log.info("XLA flags for GPU added (training.xla_gpu_flags): %s", " ".join(added))
    return added


def compilation_cache_dir(
    setting: str | None, *, env_dir: str | None, enabled: bool = True
) -> str | None:
    """The directory of JAX's persistent compilation cache for training.compilation_cache_dir =
    `setting`: auto → `env_dir` ($JAX_COMPILATION_CACHE_DIR) if set, else <cache root>/jax, and
    none at all if JAX's cache is disabled (`enabled` false: JAX_ENABLE_COMPILATION_CACHE=false);
    a directory → that directory; null → None (off)."""
    if setting is None:
        return None
    if setting == AUTO_CACHE:
        if not enabled:
            return None
        return env_dir or str(cache_dir(AUTO_CACHE, "jax"))
    return str(cache_dir(setting, "jax"))


def configure_compilation_cache(setting: str | None, *, deviceless: bool = False) -> str | None:
    """Turns JAX's persistent compilation cache on in compilation_cache_dir(setting), or off;
    returns the directory. Must run before the first compile. Every compile is cached (JAX
    caches only those of 1 s or more by default: the initialisation programs of a small model
    would compile again at each launch), unless $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS
    sets another threshold. `deviceless` (a dry run for plan.target, a GPU this host lacks):
    off, since such programs never run here and JAX cannot load them back without the target's
    client (it warns at every later dry run)."""
    import jax  # here, so that `--help` and `--cfg job` need no JAX

    if setting is None or deviceless:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    directory = compilation_cache_dir(
        setting,
        env_dir=jax.config.jax_compilation_cache_dir,
        enabled=jax.config.jax_enable_compilation_cache,
    )
    if directory is None:  # auto, with JAX's own cache disabled
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


def train_from_hydra(cfg: DictConfig) -> None:
    """The Hydra task: typed config → training run in Hydra's output directory."""
    # Imported here so `--help` and `--cfg job` answer without starting JAX.
    from meshtrain.checkpoint.writes import CheckpointWriteError
    from meshtrain.distributed.devices import compile_here_for, use_fake_cpu_devices
    from meshtrain.distributed.preemption import exit_code_for
    from meshtrain.distributed.runtime import join_run, shared_failures
    from meshtrain.train.dry_run import dry_run
    from meshtrain.train.guard import NonFiniteError
    from meshtrain.train.loop import train

    # Hydra sets the root logger to INFO; JAX's INFO lines (its backend probing, e.g. "Unable to
    # initialize backend 'tpu'") stay hidden, as in any other Python program.
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        config = to_config(cfg)
        use_fake_cpu_devices(config.plan.fake_devices)  # before anything starts JAX's backend
        compile_here_for(config.plan.target)
        skip_gpu_plugin_without_gpu()
        configure_xla_gpu_flags(  # read when the backend starts
            config.training.xla_gpu_flags, gpu_target=config.plan.target is not None
        )
        configure_compilation_cache(  # before any compile
            config.training.compilation_cache_dir, deviceless=config.plan.target is not None
        )
        with shared_failures():
            # Before anything touches a JAX device; all processes agree on process 0's run dir.
            run_dir = join_run(config.distributed, Path(HydraConfig.get().runtime.output_dir))
            if config.training.dry_run:
                dry_run(config, run_dir)
                return
            result = train(config, run_dir)
    except (ConfigError, DistributedError, NonFiniteError) as err:
        output_dir = Path(HydraConfig.get().runtime.output_dir)
        discard_run_record(output_dir)  # a refused command's record (accepted ones are kept)
        _remove_if_only_hydra_files(output_dir)
        if _wants_traceback():
            raise
        fail(str(err), EXIT_NONFINITE if isinstance(err, NonFiniteError) else err.exit_code)
    except CheckpointWriteError as err:
        _stop_after_failed_write(err)
    if result.stopped_by is not None:  # saved after SIGTERM/SIGINT: "stopped, resumable"
        sys.exit(exit_code_for(result.stopped_by))


def _stop_after_failed_write(err: CheckpointWriteError) -> NoReturn:
    """One line and EXIT_CHECKPOINT_WRITE for a checkpoint write the disk failed (with
    HYDRA_FULL_ERROR=1, orbax's held-back log records and the traceback first).

    The process ends with os._exit once the logs are flushed: after a failed write some of
    orbax's writer threads wait minutes for a signal that never comes (the interpreter would
    wait for them at exit), and the others, stopped at interpreter shutdown, print tracebacks
    ("Event loop is closed", "sys.meta_path is None"). Nothing is left to save: the complete
    checkpoints are on disk and the failed one is only a temporary directory.
    """
    if _wants_traceback():
        err.held.show()
        traceback.print_exception(err)
    fail_now(str(err), EXIT_CHECKPOINT_WRITE)


def _remove_if_only_hydra_files(run_dir: Path) -> None:
    """Removes the directory Hydra made for a run that stopped before writing anything (its
    start-up checks failed) and, in the default layout outputs/<name>/<date>/<time>, the
    parents below outputs/ that this leaves empty: a rejected command leaves nothing behind.
    A directory holding any file outside Hydra's `.hydra/` is kept."""
    if not run_dir.is_dir() or any(
        not path.is_dir() and not path.relative_to(run_dir).parts[0].startswith(".hydra")
        for path in run_dir.rglob("*")
    ):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    if not any(parent.name == "outputs" for parent in run_dir.parents[:3]):
        return
    for directory in itertools.takewhile(lambda parent: parent.name != "outputs", run_dir.parents):
        try:
            directory.rmdir()  # only if empty
        except OSError:
            return


def make_main(config_dir: Path) -> Callable[[], None]:
    """The `main()` of run_training.py, reading configs from `config_dir`."""
    register_configs()
    hydra_main = hydra.main(
        config_path=str(config_dir.resolve()), config_name="config", version_base="1.3"
    )(train_from_hydra)

    def main() -> None:
        if _wants_traceback():
            hydra_main()
            return
        os.environ["HYDRA_FULL_ERROR"] = "1"  # let composition errors reach us instead of exit 1
        try:
            hydra_main()
        except (HydraException, OmegaConfBaseException) as err:
            fail(describe_config_error(err))
        finally:
            os.environ.pop("HYDRA_FULL_ERROR", None)

    return main


def default_config_dir() -> Path:
    """configs/ of this checkout (an editable install), else ./configs of the working directory."""
    for candidate in (CHECKOUT_CONFIGS, Path.cwd() / "configs"):
        if (candidate / "config.yaml").is_file():
            return candidate
    fail("no configs/config.yaml found: run meshtrain-train from a meshtrain checkout")


def main() -> None:
    """`meshtrain-train [overrides...]`: the same command as `python run_training.py`."""
    make_main(default_config_dir())()
