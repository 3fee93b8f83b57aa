"""What a checkpoint directory holds, and reading it back verified, into any sharding.

A checkpoint is one directory of three or four orbax items, committed atomically (orbax writes
it under a temporary name and renames it once every process has finished):

    params/        the model parameters, one array per parameter, stored in shards
    train_state/   the rest of the state (training's: step, optimizer state, RNG key, non-finite
                   record); any pytree of arrays: this package knows nothing of training
    data/          host arrays of the data position, when it has any (a policy-gradient run
                   inside a generation: the completions it still trains on), whole numpy arrays
    meta/          JSON: format, step, data position (its arrays' shapes and dtypes, where data/
                   holds them), resolved config, fingerprint of every array

A run writes one per saved step, `<checkpoint.dir>/<step>/`; `meshtrain.export` writes params/ and
meta/ only, so an export is also a valid `checkpoint.load_params` source.

Arrays are named by their tree path joined with dots ("params.blocks.0.attn.q"): this is the one
place where nested-dict keys, the ints of the model's block list included, become strings. The
arrays themselves round-trip with int keys because every restore is given a target tree.

orbax detects truncated files and broken JSON, but not changed bytes inside a data file: those
would restore silently as wrong numbers. So each save records a fingerprint per array and each
read recomputes and compares it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

PARAMS, TRAIN_STATE, DATA, META = "params", "train_state", "data", "meta"
DATA_ARRAYS = "data_arrays"  # meta's key: name → {"shape", "dtype"} of each array in data/
FORMAT = 1  # meta["format"]; bump when the layout changes


class CorruptCheckpoint(Exception):
    """A checkpoint whose files cannot be read, or whose arrays do not match their fingerprints."""


def named_leaves(tree: Any) -> dict[str, Any]:
    """Leaves of a tree by dotted path name, e.g. {"blocks.0.attn.q": array}."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="."): leaf for path, leaf in flat}


def _as_uint32(x: jax.Array) -> jax.Array:
    """The bits of each element, widened to uint32 (float32 → its bit pattern, bf16 → 16 bits)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _fingerprint(x: jax.Array) -> jax.Array:
    """uint32 []: Σ bits[i] · (2i + 1) mod 2³², i the row-major index of each element.

    Integer sums wrap exactly, so the value does not depend on the sharding or on the order of
    the reduction. Odd weights are invertible mod 2³², so any single changed element changes it;
    more damage goes unnoticed only if its changes happen to cancel, and the position weights
    make that unlikely for moved or swapped elements too.
    """
    index = jnp.zeros(x.shape, jnp.uint32)
    for dim in range(x.ndim):  # row-major linear index, wrapping like the sum
        index = index * jnp.uint32(x.shape[dim]) + jax.lax.broadcasted_iota(
            jnp.uint32, x.shape, dim
        )
    return jnp.sum(_as_uint32(x) * (2 * index + 1), dtype=jnp.uint32)


_fingerprints = jax.jit(lambda tree: jax.tree.map(_fingerprint, tree))


def fingerprints(tree: Any, prefix: str = "") -> dict[str, int]:
    """Name → fingerprint of every array in `tree` (one small host transfer)."""
    values = jax.device_get(_fingerprints(tree))
    return {prefix + name: int(value) for name, value in named_leaves(values).items()}


def save_args(
    params: Any, rest: Any, meta: dict[str, Any], data: dict[str, np.ndarray] | None = None
) -> ocp.args.Composite:
    """The orbax items of one checkpoint: the parameters, the rest of the state (any pytree of
    arrays), the data position's host arrays (if any) and meta, which gets the fingerprints of
    all of them and the shapes of the data arrays."""
    data = data or {}
    if data:
        meta = {
            **meta,
            DATA_ARRAYS: {
                k: {"shape": list(v.shape), "dtype": v.dtype.name} for k, v in data.items()
            },
        }
    meta = {
        "format": FORMAT,
        **meta,
        "fingerprints": {
            **fingerprints(params, f"{PARAMS}."),
            **fingerprints(rest, f"{TRAIN_STATE}."),
            **fingerprints(data, f"{DATA}."),
        },
    }
    items = {
        PARAMS: ocp.args.StandardSave(params),
        TRAIN_STATE: ocp.args.StandardSave(rest),
        META: ocp.args.JsonSave(meta),
    }
    if data:
        items[DATA] = ocp.args.StandardSave(data)
    return ocp.args.Composite(**items)


def is_checkpoint(path: Path) -> bool:
    """A committed checkpoint (or export): params/ and meta/ inside a finalized directory."""
    return (
        path.is_dir()
        and (path / PARAMS).is_dir()
        and (path / META).is_dir()
        and ocp.path.step.is_path_finalized(path)
    )


def committed_steps(directory: Path) -> list[int]:
    """Steps with a committed checkpoint `<directory>/<step>`, ascending; temporary dirs ignored."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and is_checkpoint(p))


def find_checkpoints(path: Path) -> list[Path]:
    """Checkpoints a user path names, newest first: the checkpoint itself, a directory of steps
    (checkpoint.dir), or a run directory holding checkpoints/. Empty if none. The paths are
    absolute: orbax reads no other."""
    path = path.resolve()
    if is_checkpoint(path):
        return [path]
    for directory in (path, path / "checkpoints"):
        steps = committed_steps(directory)
        if steps:
            return [directory / str(step) for step in reversed(steps)]
    return []


def _reader() -> ocp.Checkpointer:
    return ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(
            **{
                PARAMS: ocp.PyTreeCheckpointHandler(),
                TRAIN_STATE: ocp.PyTreeCheckpointHandler(),
                DATA: ocp.PyTreeCheckpointHandler(),
                META: ocp.JsonCheckpointHandler(),
            }
        )
    )


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:200]}{'...' if len(text) > 200 else ''}"


def read_meta(path: Path) -> dict[str, Any]:
    """The JSON item; raises CorruptCheckpoint if it is missing or unreadable."""
    try:
        meta = _reader().restore(path, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[
            META
        ]
    except Exception as err:
        raise CorruptCheckpoint(f"{path / META} is unreadable ({_one_line(err)})") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "fingerprints" not in meta:
        raise CorruptCheckpoint(f"{path / META} is not a meshtrain checkpoint description")
    return meta


def saved_params(path: Path) -> Any:
    """The saved parameter tree as ShapeDtypeStructs, from metadata only (no array is read).

    Its dict keys are strings ("0", not 0): metadata carries no key types. Compare it with a
    model's parameters through `named_leaves`, or use it as a target for whole numpy arrays.
    """
    try:
        tree = _reader().metadata(path).item_metadata[PARAMS].tree
    except Exception as err:
        raise CorruptCheckpoint(
            f"{path / PARAMS} metadata is unreadable ({_one_line(err)})"
        ) from err
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype), tree)


def first_param_mismatch(saved: Any, abstract_params: Any) -> str | None:
    """How the saved parameters differ from the model's, naming the first parameter; None if equal."""
    saved, expected = named_leaves(saved), named_leaves(abstract_params)
    for name, leaf in expected.items():
        shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
        if name not in saved:
            return f"the model's parameter {name} {shape} is not in the checkpoint"
        if tuple(saved[name].shape) != shape:
            return f"parameter {name} has shape {tuple(saved[name].shape)} in the checkpoint but {shape} in the model"
        if np.dtype(saved[name].dtype) != dtype:
            return f"parameter {name} is {np.dtype(saved[name].dtype)} in the checkpoint but {dtype} in the model"
    extra = sorted(set(saved) - set(expected))
    if extra:
        return f"the checkpoint has a parameter {extra[0]}, which the model does not have"
    return None


def first_state_mismatch(meta: dict[str, Any], expected_rest: Any) -> str | None:
    """How the saved optimizer state, step and records differ in structure from `expected_rest`
    (this run's train state without its parameters), naming the first array; None if alike.
    The saved names come from the description's fingerprints, so no array is read."""
    prefix = f"{TRAIN_STATE}."
    saved = {name[len(prefix) :] for name in meta["fingerprints"] if name.startswith(prefix)}
    expected = set(named_leaves(expected_rest))
    missing, extra = sorted(expected - saved), sorted(saved - expected)
    if missing:
        return f"this run's train state has {missing[0]}, which the checkpoint does not"
    if extra:
        return f"the checkpoint's train state has {extra[0]}, which this run's does not"
    return None


def _restore_args(abstract: Any) -> Any:
    """Shapes with shardings: each process reads only its shards. Without: whole numpy arrays."""
    return jax.tree.map(
        lambda leaf: (
            ocp.ArrayRestoreArgs(
                restore_type=jax.Array,
                sharding=leaf.sharding,
                global_shape=leaf.shape,
                dtype=leaf.dtype,
            )
            if getattr(leaf, "sharding", None) is not None
            else ocp.RestoreArgs(restore_type=np.ndarray)
        ),
        abstract,
    )


def _read_items(
    path: Path, targets: dict[str, Any], meta: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restores the named array items into their targets and checks every fingerprint against
    the description `meta` (read from `path` if not given)."""
    meta = read_meta(path) if meta is None else meta
    args = {
        item: ocp.args.PyTreeRestore(item=target, restore_args=_restore_args(target))
        for item, target in targets.items()
    }
    try:
        restored = _reader().restore(path, args=ocp.args.Composite(**args))
    except Exception as err:
        raise CorruptCheckpoint(f"{path} has unreadable arrays ({_one_line(err)})") from err
    saved = meta["fingerprints"]
    for item in targets:
        for name, value in fingerprints(restored[item], f"{item}.").items():
            if saved.get(name) != value:
                raise CorruptCheckpoint(
                    f"{path}: array {name} does not match the fingerprint written with it "
                    "(its files were changed or damaged after the save)"
                )
    return {item: restored[item] for item in targets}, meta


def read_state(
    path: Path, abstract_params: Any, abstract_rest: Any
) -> tuple[Any, Any, dict[str, Any]]:
    """(parameters, rest of the state, meta), each array read straight into the sharding of its
    abstract target (a tree of ShapeDtypeStructs); the data position's arrays, if the checkpoint
    has any, read whole into meta["data"]."""
    meta = read_meta(path)
    saved_data = meta.get(DATA_ARRAYS, {})
    targets = {PARAMS: abstract_params, TRAIN_STATE: abstract_rest}
    if saved_data:
        targets[DATA] = {
            name: jax.ShapeDtypeStruct(tuple(a["shape"]), np.dtype(a["dtype"]))
            for name, a in saved_data.items()
        }
    items, meta = _read_items(path, targets, meta)
    if saved_data:
        meta["data"] = {**meta["data"], **items[DATA]}
    return items[PARAMS], items[TRAIN_STATE], meta


def read_params(path: Path, abstract_params: Any = None) -> tuple[Any, dict[str, Any]]:
    """The parameters alone, into the shardings of `abstract_params`; leaves without a
    sharding, or all of them when it is None, come back as whole numpy arrays."""
    if abstract_params is None:
        abstract_params = saved_params(path)
    items, meta = _read_items(path, {PARAMS: abstract_params})
    return items[PARAMS], meta
