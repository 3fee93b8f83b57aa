"""Exceptions reported as one line without a traceback: bad user input (exit code 2), lost processes (1)."""

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key, the value and the fix."""

    exit_code = 2


class DataError(ConfigError):
    """A data file or record that cannot be used; the message names the file and the line or row."""


class DistributedError(RuntimeError):
    """Another process of a multi-process run is missing, died or differs; one line, exit code 1."""

    exit_code = 1


def require(ok: bool, message: str) -> None:
    """Raises ConfigError(message) unless `ok`: a start-up check in one line."""
    if not ok:
        raise ConfigError(message)


def first_line(err: BaseException) -> str:
    """The first line of an exception's message ("" for none): what a one-line error quotes of
    a library's multi-line one."""
    return (str(err).strip().splitlines() or [""])[0]


def error_line(message: str) -> str:
    """The one line every entry point prints for an error (meshtrain.cli.exit.fail)."""
    return f"meshtrain: error: {message}"


def did_you_mean(value: str, options: Iterable[str]) -> str:
    """ " (did you mean 'x'?)" for the option closest to a misspelt `value`, or "" if none is
    close: the suffix of an error that names an unknown key or choice."""
    best, best_score = None, 0.6  # difflib's own cutoff for "close"
    for option in sorted(options):  # ties go to the first in order: llama3 → llama3_1b
        score = difflib.SequenceMatcher(None, value, option).ratio()
        if score > best_score:
            best, best_score = option, score
    return f" (did you mean '{best}'?)" if best else ""
