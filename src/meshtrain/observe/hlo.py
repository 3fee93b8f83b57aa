"""A reader for the text of a compiled HLO module (`compiled.as_text()`): instructions, shapes,
how often each computation runs per call, and replica groups as lists of device ids.

Only what the communication accounting needs is parsed. The text format is XLA's
(https://openxla.org/xla/operation_semantics); replica groups come in three spellings, all
expanded here: explicit lists `{{0,1},{2,3}}`, iota `[2,4]<=[4,2]T(1,0)`, and mesh axes
`mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}` (xla/hlo/ir/replica_group.cc).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

# Bytes per element by HLO element type; sub-byte types are stored one per byte unless packed.
DTYPE_BYTES: dict[str, float] = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,<=]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_METADATA = re.compile(r",?\s*metadata=\{[^{}]*\}")
_CALLEE = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([^\s,{}]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> float:
        # Elements of unknown types (token, opaque) count as 0 bytes.
        return math.prod(self.dims) * DTYPE_BYTES.get(self.dtype, 0)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def parse_shape(text: str) -> list[Array]:
    """Every array in an HLO shape; a tuple shape gives its elements in order."""
    arrays = []
    for dtype, dims in _ARRAY.findall(text):
        sizes = tuple(int(d.replace("<=", "")) for d in dims.split(",") if d)
        arrays.append(Array(dtype, sizes))
    return arrays


def _closing(text: str, start: int) -> int:
    """Index of the bracket that closes the one at text[start]."""
    opening, closing = text[start], {"(": ")", "{": "}", "[": "]"}[text[start]]
    depth = 0
    for i in range(start, len(text)):
        if text[i] == opening:
            depth += 1
        elif text[i] == closing:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {opening!r} in HLO: {text[start : start + 80]!r}")


@dataclass
class Instruction:
    name: str
    opcode: str
    shape_text: str  # the result's shape as written, e.g. "f32[8,128]" or a tuple "(f32[2], s32[])"
    operands: list[str]
    arguments: str  # the text inside the operand parentheses, e.g. "0" for parameter(0)
    attributes: str  # everything after the operand list, metadata removed
    op_name: str  # the jax-level name from the metadata, e.g. "jit(step)/while/body/..."
    computation: str

    @cached_property
    def shape(self) -> list[Array]:
        """The arrays of the result's shape (a tuple's elements in order). Parsed when first
        read: the accounting reads few of a module's shapes, and a loop's tuple shapes are long."""
        return parse_shape(self.shape_text)

    def attribute(self, key: str) -> str | None:
        """The raw value of `key=...`, with balanced brackets, or None."""
        match = re.search(rf"(?:^|[\s,]){re.escape(key)}=", self.attributes)
        if match is None:
            return None
        start = match.end()
        if self.attributes[start] in "{[(":
            return self.attributes[start : _closing(self.attributes, start) + 1]
        end = re.search(r",\s|$", self.attributes[start:])
        return self.attributes[start : start + end.start()]

    @property
    def callees(self) -> list[str]:
        names = _CALLEE.findall(self.attributes)
        for group in _BRANCHES.findall(self.attributes):
            names.extend(n.strip().lstrip("%") for n in group.split(",") if n.strip())
        return names

    @property
    def trip_count(self) -> int | None:
        match = _TRIP_COUNT.search(self.attributes)
        return int(match.group(1)) if match else None


def _parse_instruction(name: str, rest: str, computation: str) -> Instruction | None:
    # A tuple shape is parenthesised (and may hold spaces); an array shape is one word.
    end = _closing(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
    shape, tail = rest[:end], rest[end:]
    opcode = _OPCODE.match(tail)
    if opcode is None:
        return None
    open_paren = opcode.end() - 1
    close_paren = _closing(tail, open_paren)
    arguments = tail[open_paren + 1 : close_paren]
    operands = re.findall(r"%([^\s,()]+)", arguments)
    attributes = tail[close_paren + 1 :]
    op_name = _OP_NAME.search(attributes)
    return Instruction(
        name=name,
        opcode=opcode.group(1),
        shape_text=shape,
        operands=operands,
        arguments=arguments,
        attributes=_METADATA.sub("", attributes),
        op_name=op_name.group(1) if op_name else "",
        computation=computation,
    )


@dataclass
class HloModule:
    name: str
    entry: str
    computations: dict[str, list[Instruction]]  # in the order of the text (callees first)
    by_name: dict[str, Instruction] = field(default_factory=dict)
    roots: dict[str, str] = field(default_factory=dict)  # computation → its ROOT instruction
    _users: dict[str, list[Instruction]] | None = None

    def users(self, name: str) -> list[Instruction]:
        """The instructions that take `name` as an operand."""
        if self._users is None:
            self._users = defaultdict(list)
            for instructions in self.computations.values():
                for instruction in instructions:
                    for operand in dict.fromkeys(instruction.operands):
                        self._users[operand].append(instruction)
        return self._users.get(name, [])

    def execution_counts(self) -> tuple[dict[str, float], set[str]]:
        """How often each computation runs per execution of the entry, and the computations
        whose count assumed 1 iteration of a while loop whose trip count XLA did not know.

        A while loop's body runs `known_trip_count` times per execution of its caller. Each
        execution of a conditional runs one of its n branches, which branch is known only at
        run time, so each branch counts 1/n of the conditional's executions: exact when the
        branches do the same collectives (Gemma 3's local and global layers under
        model.scan_layers gather the same weights), their mean otherwise. Every other callee
        (fusions, calls, async wrappers) runs once per execution of its caller.
        """
        counts: dict[str, float] = defaultdict(float)
        unknown: set[str] = set()
        counts[self.entry] = 1
        # The text lists callees before callers, so the reverse order visits callers first.
        for computation in reversed(list(self.computations)):
            count = counts.get(computation, 0)
            if count == 0:
                continue
            for instruction in self.computations[computation]:
                if instruction.opcode in ("async-update", "async-done"):
                    continue  # they name the computation their async-start already ran
                factor = 1.0
                if instruction.opcode == "conditional":
                    factor = 1 / max(len(instruction.callees), 1)
                if instruction.opcode == "while":
                    trips = instruction.trip_count
                    factor = 1 if trips is None else trips
                    if trips is None:
                        body = instruction.attribute("body")
                        unknown.add((body or "").lstrip("%"))
                for callee in instruction.callees:
                    counts[callee] += count * factor
                    if computation in unknown:
                        unknown.add(callee)
        return dict(counts), unknown


def parse_module(text: str) -> HloModule:
    """Parses `compiled.as_text()` (one HloModule) into computations of instructions."""
    header = re.search(r"^HloModule\s+([^\s,]+)", text, flags=re.MULTILINE)
    module = HloModule(name=header.group(1) if header else "", entry="", computations={})
    current: str | None = None
    for line in text.splitlines():
        if current is None:
            match = _COMPUTATION.match(line)
            if match:
                current = match.group(2)
                module.computations[current] = []
                if match.group(1):
                    module.entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        instruction = _parse_instruction(match.group(2), match.group(3), current)
        if instruction is not None:
            module.computations[current].append(instruction)
            module.by_name[instruction.name] = instruction
            if match.group(1):
                module.roots[current] = instruction.name
    return module


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _iota_spec(text: str) -> np.ndarray:
    """`[d0,d1]T(1,0)` or `[d0]` (a device assignment) as an id array."""
    match = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
    if match is None:
        return np.array(_ints(text))
    return _iota(_ints(match.group(1)), _ints(match.group(2)) if match.group(2) else None)


def _mesh_groups(text: str) -> np.ndarray:
    """Groups of a mesh-axes replica group list: devices that differ only along the listed axes.

    A listed axis is a whole mesh axis `'a'` or a sub-axis `'a':(pre)size`: the factor of size
    `size` of axis a whose major factors multiply to `pre` (Shardy's notation).
    """
    mesh = re.match(r"mesh\[([^\]]*)\]", text)
    if mesh is None:
        raise ValueError(f"unrecognised replica groups {text!r}")
    axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
    index = {name: i for i, (name, _) in enumerate(axes)}
    sizes = [int(size) for _, size in axes]
    assignment = text.find("device_ids=(")
    if assignment >= 0:
        start = assignment + len("device_ids=")
        ids = _iota_spec(text[start + 1 : _closing(text, start)]).reshape(sizes)
    else:
        ids = np.arange(math.prod(sizes)).reshape(sizes)
    refs_text = text[text.rfind("{") + 1 : text.rfind("}")] if text.endswith("}") else ""
    refs = [
        (index[name], (int(pre), int(size)) if pre else None)
        for name, pre, size in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", refs_text)
    ]
    # Split each mesh axis into factors, major to minor, so that each listed (sub-)axis is one.
    factors: list[int] = []
    position: dict[int, int] = {}  # ref index → its factor
    for dim, size in enumerate(sizes):
        on_dim = [(k, sub) for k, (d, sub) in enumerate(refs) if d == dim]
        prefix = 1
        for k, sub in sorted(on_dim, key=lambda ref: (ref[1] or (1, size))[0]):
            pre, sub_size = sub or (1, size)
            if pre != prefix:
                factors.append(pre // prefix)
                prefix = pre
            position[k] = len(factors)
            factors.append(sub_size)
            prefix *= sub_size
        if prefix != size:
            factors.append(size // prefix)
    grouped = [position[k] for k in range(len(refs))]
    rest = [a for a in range(len(factors)) if a not in grouped]
    group_size = math.prod(factors[a] for a in grouped)
    return ids.reshape(factors).transpose(rest + grouped).reshape(-1, group_size)


_REPLICA_GROUPS = re.compile(
    r"replica_groups=("
    r"\{(?:[^{}]|\{[^{}]*\})*\}"  # explicit {{0,1},{2,3}} or {}
    r"|\[\d+,\d+\]<=\[[\d,]+\](?:T\([\d,]+\))?"  # iota [2,4]<=[4,2]T(1,0)
    r"|mesh\[[^\]]*\](?:, device_ids=\((?:[^()]|\([^()]*\))*\))?(?: \{[^}]*\})?"  # mesh axes
    r")"
)


def replica_groups(instruction: Instruction, num_devices: int) -> np.ndarray:
    """A collective's replica groups as an int array [groups, devices per group] of logical
    device ids (positions in the executable's device assignment); none listed: all devices."""
    match = _REPLICA_GROUPS.search(instruction.attributes)
    text = match.group(1) if match else "{}"
    if re.fullmatch(r"\{\s*\}", text):
        return np.arange(num_devices).reshape(1, -1)
    if text.startswith("{"):
        return np.array([_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])])
    if text.startswith("["):
        groups, group_size, dims, perm = re.fullmatch(
            r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text
        ).groups()
        ids = _iota(_ints(dims), _ints(perm) if perm else None)
        return ids.reshape(int(groups), int(group_size))
    return _mesh_groups(text)


def source_target_pairs(instruction: Instruction) -> np.ndarray:
    """A collective-permute's (source, target) pairs of logical device ids, [pairs, 2]."""
    text = instruction.attribute("source_target_pairs") or "{}"
    return np.array([_ints(p) for p in re.findall(r"\{(\d+,\d+)\}", text)]).reshape(-1, 2)


def fusion_count(module: HloModule) -> int:
    """The fusion instructions of a compiled module: roughly the kernels it launches on a GPU."""
    return sum(
        instruction.opcode == "fusion"
        for instructions in module.computations.values()
        for instruction in instructions
    )


def cudnn_attention_calls(module: HloModule) -> int:
    """Calls of cuDNN's fused attention (forward and backward) in a compiled GPU module."""
    return sum(
        instruction.opcode == "custom-call"
        and "cudnn$fmha" in (instruction.attribute("custom_call_target") or "")
        for instructions in module.computations.values()
        for instruction in instructions
    )


def matmul_flops(module: HloModule) -> float:
    """The FLOPs of a compiled module's matrix products per execution (2 per multiply-add):
    every `dot`, in fusions and loop bodies too, times how often its computation runs
    (HloModule.execution_counts). What the compiled program multiplies, to hold against what it
    should: a LoRA step computes no weight gradient of its frozen base."""
    counts, _ = module.execution_counts()
    return sum(
        dot_flops(module, instruction) * counts.get(computation, 0)
        for computation, instructions in module.computations.items()
        for instruction in instructions
        if instruction.opcode == "dot"
    )


def dot_flops(module: HloModule, dot: Instruction) -> float:
    """2 × the result's elements × the contracted elements of one execution of `dot`."""
    lhs = module.by_name[dot.operands[0]].shape[0]
    contracting = _ints(dot.attribute("lhs_contracting_dims") or "{}")
    return 2.0 * math.prod(dot.shape[0].dims) * math.prod(lhs.dims[d] for d in contracting)
