"""Exceptions reported as one line without a traceback: bad user input (exit code 2), lost processes (1)."""


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key, the value and the fix."""

    exit_code = 2


class DistributedError(RuntimeError):
    """Another process of a multi-process run is missing, died or differs; one line, exit code 1."""

    exit_code = 1


def error_line(message: str) -> str:
    """The one line every entry point prints for an error (meshtrain.cli.exit.fail)."""
    return f"meshtrain: error: {message}"
