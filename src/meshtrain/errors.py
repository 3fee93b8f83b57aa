"""The one exception type for bad user input: reported as one line, exit code 2, no traceback."""


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key, the value and the fix."""
