"""What compiling a run's programs took: the dry run's compile.json (docs/planning.md).

The initialisation (the parameter and optimizer-state programs, meshtrain.models.initialization)
and the train step, each with its compile time and its fusions (about the kernels a GPU
launches), and the attention kernel the step runs; on a GPU target, the cuDNN attention calls
in the compiled step; and the FLOPs of each program's matrix products as compiled.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax

from meshtrain.observe.hlo import cudnn_attention_calls, fusion_count, matmul_flops, parse_module


@dataclass(frozen=True)
class ProgramCompile:
    """One or more programs compiled together: seconds of compiling, fusions, cuDNN calls, and
    the FLOPs of their matrix products per execution (observe.hlo.matmul_flops)."""

    seconds: float
    fusions: int
    cudnn_attention_calls: int
    matmul_flops: float

    def summary(self) -> str:
        """'<seconds> s (<fusions> fusions, <calls> cuDNN attention calls)'."""
        return (
            f"{self.seconds:.1f} s ({self.fusions} fusions, {self.cudnn_attention_calls} cuDNN "
            "attention calls)"
        )


def measure(compiled: Iterable[jax.stages.Compiled], seconds: float) -> ProgramCompile:
    """The fusions and cuDNN attention calls of programs that took `seconds` to compile."""
    modules = [parse_module(program.as_text()) for program in compiled]
    return ProgramCompile(
        seconds=seconds,
        fusions=sum(fusion_count(module) for module in modules),
        cudnn_attention_calls=sum(cudnn_attention_calls(module) for module in modules),
        matmul_flops=sum(matmul_flops(module) for module in modules),
    )


@dataclass(frozen=True)
class CompileReport:
    """The dry run's compiles: for `device` (a GPU target's name, or the devices in use)."""

    device: str
    devices: int
    num_layers: int  # unscanned, a step's compile time grows with it
    attention: str  # "cudnn (auto: NVIDIA H100 80GB HBM3, bfloat16, head_dim 256)"
    init: ProgramCompile
    step: ProgramCompile
    rollout: ProgramCompile | None = None  # a policy-gradient run's sampling program
    reference: ProgramCompile | None = None  # objective.reference=precomputed: its scoring

    def format(self) -> list[str]:
        lines = [
            f"compiled for {self.devices} × {self.device}: initialisation in "
            f"{self.init.seconds:.1f} s ({self.init.fusions} fusions), train step in "
            f"{self.step.summary()}",
        ]
        if self.rollout is not None:
            lines.append(f"compiled the rollouts' sampling program in {self.rollout.summary()}")
        if self.reference is not None:
            lines.append(f"compiled the reference's scoring program in {self.reference.summary()}")
        return lines

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")
