"""The experiment trackers of a run (logging.trackers): TensorBoard, W&B and MLflow each get
every logged step's metrics under the same names, the run's resolved config and its name.

Only process 0 opens them (observe.metrics.MetricsWriter). Each lives in a module of this
package, imported only when named: tensorboard, wandb_tracker, mlflow_tracker; what they are
told about the run, and the names of its metrics, is run_info.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from meshtrain.config.trackers import EXTRA, LoggingConfig
from meshtrain.errors import ConfigError, first_line
from meshtrain.observe.trackers.run_info import RunInfo, Tracker


def _open_tensorboard(settings: LoggingConfig, run: RunInfo) -> Tracker:
    from meshtrain.observe.trackers.tensorboard import TensorBoardTracker

    return TensorBoardTracker(run)


def _open_wandb(settings: LoggingConfig, run: RunInfo) -> Tracker:
    from meshtrain.observe.trackers.wandb_tracker import WandbTracker

    return WandbTracker(settings.wandb, run)


def _open_mlflow(settings: LoggingConfig, run: RunInfo) -> Tracker:
    from meshtrain.observe.trackers.mlflow_tracker import MlflowTracker

    return MlflowTracker(settings.mlflow, run)


_OPENERS: dict[str, Callable[[LoggingConfig, RunInfo], Tracker]] = {
    "tensorboard": _open_tensorboard,
    "wandb": _open_wandb,
    "mlflow": _open_mlflow,
}


def open_trackers(settings: LoggingConfig, run: RunInfo) -> list[Tracker]:
    """The trackers logging.trackers names, opened in its order (on process 0 only); if one
    fails to open, those opened before it are closed."""
    opened: list[Tracker] = []
    try:
        for name in settings.trackers:
            try:
                opened.append(_OPENERS[name](settings, run))
            except ModuleNotFoundError as err:  # installed when checked, broken since
                raise ConfigError(
                    f"logging.trackers: {name} cannot import {err.name}; "
                    f"pip install -e '.[{EXTRA}]', or drop {name} from logging.trackers"
                ) from err
            except ConfigError:
                raise
            except Exception as err:  # a server that refused, a store that cannot be opened
                raise ConfigError(
                    f"logging.trackers: {name} could not start its run ({_first_line(err)}); "
                    f"fix logging.{name}'s settings, or drop {name} from logging.trackers "
                    "(MESHTRAIN_DEBUG=1 shows the traceback)"
                ) from err
    except BaseException:
        close_trackers(opened, failed=True)
        raise
    return opened


def _first_line(err: BaseException) -> str:
    line = first_line(err)
    return f"{type(err).__name__}: {line}" if line else type(err).__name__


def close_trackers(trackers: Sequence[Tracker], *, failed: bool) -> None:
    """Closes every tracker, even when one of them raises (the first error is raised after)."""
    error: BaseException | None = None
    for tracker in trackers:
        try:
            tracker.close(failed=failed)
        except Exception as err:  # the others still close
            error = error or err
    if error is not None:
        raise error
