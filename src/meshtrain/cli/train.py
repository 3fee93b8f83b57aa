"""`python run_training.py` (or `meshtrain-train`): Hydra composes the config, bad input
becomes one line and exit code 2.

Hydra reports its own composition errors (unknown keys, wrong types) as several lines and exit
code 1; we ask it to raise them instead and print one line that names the key and the fix.
`HYDRA_FULL_ERROR=1` (or `MESHTRAIN_DEBUG=1`) shows the full traceback instead.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from meshtrain.cli.exit import EXIT_NONFINITE, fail
from meshtrain.config.hydra import register_configs, to_config
from meshtrain.distributed.environment import register_run_dir_resolvers
from meshtrain.errors import ConfigError, DistributedError

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


def describe_config_error(err: BaseException) -> str:
    """One line for a Hydra/OmegaConf composition error, naming the key and what to do."""
    cause = err
    while cause.__cause__ is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None) or "?"
        detail = str(getattr(cause, "msg", "") or cause).splitlines()[0]
        if "not in struct" in detail or ("Key '" in detail and "not" in detail):
            return (
                f"unknown config key '{key}'; check the spelling, or list the keys with "
                "`python run_training.py --cfg job`"
            )
        return (
            f"bad value for '{key}': {detail}; see `python run_training.py --cfg job` for its type"
        )
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "Could not override" in first or "Could not append" in first:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        return " ".join(lines[:3])
    return first


def train_from_hydra(cfg: DictConfig) -> None:
    """The Hydra task: typed config → training run in Hydra's output directory."""
    # Imported here so `--help` and `--cfg job` answer without starting JAX.
    from meshtrain.distributed.devices import use_fake_cpu_devices
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
        with shared_failures():
            # Before anything touches a JAX device; all processes agree on process 0's run dir.
            run_dir = join_run(config.distributed, Path(HydraConfig.get().runtime.output_dir))
            if config.training.dry_run:
                dry_run(config, run_dir)
                return
            result = train(config, run_dir)
    except (ConfigError, DistributedError, NonFiniteError) as err:
        if _wants_traceback():
            raise
        fail(str(err), EXIT_NONFINITE if isinstance(err, NonFiniteError) else err.exit_code)
    if result.stopped_by is not None:  # saved after SIGTERM/SIGINT: "stopped, resumable"
        sys.exit(exit_code_for(result.stopped_by))


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
    for candidate in (Path(__file__).resolve().parents[3] / "configs", Path.cwd() / "configs"):
        if (candidate / "config.yaml").is_file():
            return candidate
    fail("no configs/config.yaml found: run meshtrain-train from a meshtrain checkout")


def main() -> None:
    """`meshtrain-train [overrides...]`: the same command as `python run_training.py`."""
    make_main(default_config_dir())()
