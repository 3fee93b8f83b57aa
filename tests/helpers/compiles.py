"""The programs each test compiles, counted (MESHTRAIN_TEST_COMPILES=FILE; tests/conftest.py):
JAX's monitoring events of the compiles, traces and lowerings in the test's own process (not in
the children it starts), so that a change that makes a test compile less is measured, and a
test that compiles hundreds of small eager programs is found. Each line of FILE:
`compiles<TAB>compile s<TAB>traces<TAB>trace s<TAB>lowering s<TAB>node id`."""

from __future__ import annotations

import jax.monitoring

# JAX's event names (jax._src.dispatch) → the column they add to.
EVENTS = {
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
}


class CompileCounter:
    """Counts and times the events of EVENTS from its creation on, per test (`line`)."""

    def __init__(self) -> None:
        self._seen: dict[str, list[float]] = {}
        jax.monitoring.register_event_duration_secs_listener(self._heard)

    def _heard(self, event: str, duration: float, **_: object) -> None:
        if event in EVENTS:
            self._seen.setdefault(EVENTS[event], []).append(duration)

    def line(self, nodeid: str) -> str:
        """The line of the test that just ran, and a fresh count for the next one."""
        seen, self._seen = self._seen, {}
        compiles, traces, lowers = (seen.get(k, []) for k in ("compile", "trace", "lower"))
        return (
            f"{len(compiles)}\t{sum(compiles):.2f}\t{len(traces)}\t{sum(traces):.2f}\t"
            f"{sum(lowers):.2f}\t{nodeid}\n"
        )
