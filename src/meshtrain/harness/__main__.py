"""`python -m meshtrain.harness ...`: lm-eval's own command line with `--model meshtrain` known,
e.g. `python -m meshtrain.harness run --model meshtrain --model_args checkpoint=DIR --tasks
hellaswag` (every option of `lm-eval run`). lm-eval 0.4.13 looks its models up in its own
registry only: the `lm-eval` command cannot find a model another package defines, so this one
imports meshtrain's before handing over. A bad model_args key or value is one line, exit 2."""

import importlib.util
import sys

from meshtrain.errors import ConfigError, error_line


def main() -> int:
    if importlib.util.find_spec("lm_eval") is None:
        print(
            error_line("lm-eval is not installed: pip install 'meshtrain[eval]'"), file=sys.stderr
        )
        return 2
    from lm_eval.__main__ import cli_evaluate

    import meshtrain.harness.lm  # noqa: F401  (registers --model meshtrain)

    sys.argv[0] = "python -m meshtrain.harness"
    try:
        cli_evaluate()
    except ConfigError as err:
        print(error_line(str(err)), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
