"""`python -m meshtrain.eval`: the same command as `meshtrain-eval` (meshtrain.cli.eval).

A package holding only its `__main__` shim (the top level keeps to a handful of modules); the
harness itself is meshtrain.harness."""
