"""Logits under context parallelism equal transformers' (PyTorch, CPU; the `parity` extra): a
tiny Llama 3 and Gemma 3 (mixed sliding-window and global layers) read from Hugging Face
checkpoints onto a mesh that splits the sequence over cp, on an input as long as their context."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny_hf
from helpers.tiny_hf import LOGIT_TOLERANCE, VOCAB, relative_error

from meshtrain.weights.load import load_hf

pytestmark = pytest.mark.slow

LENGTH = 256  # the checkpoints' max_position_embeddings: 32 chunks of 8 on cp=4 ... 16 on cp=8


@pytest.mark.parametrize(
    ("family", "mesh"),
    [
        ("llama", [[4, 2], ["cp", "fsdp"]]),
        ("gemma3", [[8], ["cp"]]),
        ("gemma3", [[2, 2, 2], ["cp", "fsdp", "tp"]]),
    ],
)
def test_logits_under_cp_equal_transformers(family, mesh, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from helpers import tiny_hf_torch

    directory = tiny_hf.write_checkpoint(family, tmp_path / family)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, LENGTH))
    theirs = tiny_hf_torch.logits(tiny_hf_torch.load(directory), tokens)
    ours = np.asarray(load_hf(directory, mesh=mesh)(tokens))
    assert ours.shape == theirs.shape == (2, LENGTH, VOCAB)
    assert relative_error(ours, theirs) < LOGIT_TOLERANCE
