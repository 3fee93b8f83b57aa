"""model_args: each key and value checked, a bad one named in one line."""

from __future__ import annotations

import pytest

from meshtrain.errors import ConfigError
from meshtrain.harness.options import (
    ModelArgs,
    parse_mesh_shape,
    parse_model_args,
    split_model_args,
)


def test_values_are_converted():
    args = parse_model_args(
        split_model_args(
            "checkpoint=/ckpt,max_length=512,batch_tokens=1024,add_bos_token=false,"
            "dtype=bfloat16,mesh_shape=fsdp:4/tp:2"
        )
    )
    assert args == ModelArgs(
        checkpoint="/ckpt",
        max_length=512,
        batch_tokens=1024,
        add_bos_token=False,
        dtype="bfloat16",
        mesh_shape=[[4, 2], ["fsdp", "tp"]],
    )
    # lm-eval converts numbers and booleans itself, and adds its own batch_size and device.
    args = parse_model_args(
        {"checkpoint": "/c", "max_length": 64, "add_bos_token": True, "batch_size": 1}
    )
    assert (args.max_length, args.add_bos_token) == (64, True)
    assert parse_mesh_shape('[[8],["fsdp"]]') == [[8], ["fsdp"]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"checkpoint": "/c", "batch_tokenz": "8"},
            "model_args key 'batch_tokenz' does not exist (did you mean 'batch_tokens'?); the "
            "keys are checkpoint, tokenizer, mesh_shape, dtype, max_length, batch_tokens, "
            "add_bos_token, generate_batch, max_gen_toks",
        ),
        ({}, "model_args needs checkpoint=DIRECTORY (a meshtrain or Hugging Face one)"),
        ({"checkpoint": "/c", "dtype": "float16"}, "must be one of float32, bfloat16"),
        ({"checkpoint": "/c", "max_length": "1.5"}, "max_length='1.5' must be an integer >= 2"),
        ({"checkpoint": "/c", "batch_tokens": "0"}, "batch_tokens='0' must be an integer >= 1"),
        ({"checkpoint": "/c", "add_bos_token": "yes"}, "add_bos_token='yes' must be true or"),
        ({"checkpoint": "/c", "mesh_shape": "fsdp=4"}, "mesh_shape='fsdp=4' is neither JSON"),
    ],
)
def test_bad_model_args_name_the_key(args, message):
    with pytest.raises(ConfigError) as err:
        parse_model_args(args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_split_model_args():
    assert split_model_args(" a=1, b=x=y ,") == {"a": "1", "b": "x=y"}
    with pytest.raises(ConfigError, match="--model-args item 'oops' is not key=value"):
        split_model_args("a=1,oops")
