"""The harness's model on a tiny random Llama: its log-likelihoods are the model's own (a full
forward pass and a log-softmax, here in numpy), requests of any length and number compile one
program per length bucket, generation stops at the tasks' stop strings with the tokens
meshtrain's generate picks, a mesh gives the numbers of one device, and evaluate_in_place
evaluates a model's arrays as they are, compiling nothing the second time.
(Against lm-eval's own hf model and transformers: test_parity.py, slow.)"""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from flax import nnx
from helpers.harness import EXAMPLE_TASKS, MAX_LENGTH, METRICS, TASKS, write_tiny_llama

pytest.importorskip("lm_eval", reason="the eval extra (lm_eval) is not installed")

import meshtrain
from meshtrain.harness.engine import Generation
from meshtrain.harness.lm import MeshtrainLM
from meshtrain.harness.run import evaluate_in_place
from meshtrain.inference.generate import generate_ids


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return meshtrain.load_hf(checkpoint), meshtrain.build_tokenizer(str(checkpoint))


@pytest.fixture(scope="module")
def lm(loaded):
    model, tokenizer = loaded
    return MeshtrainLM.from_model(model, tokenizer, max_length=MAX_LENGTH, batch_tokens=1024)


def _requests(count: int, seed: int = 0) -> list[tuple[None, list[int], list[int]]]:
    """(None, context, continuation) ids: contexts of 1 to 300 tokens (some longer than
    max_length + 1, which lose their start), continuations of 1 to 8."""
    rng = np.random.default_rng(seed)
    return [
        (
            None,
            rng.integers(3, 512, rng.integers(1, 301)).tolist(),
            rng.integers(3, 512, c).tolist(),
        )
        for c in rng.integers(1, 9, count)
    ]


def _reference(model, requests) -> list[tuple[float, bool]]:
    """Each request scored alone: its last max_length + 1 tokens through the model (right
    padded to one shape), log-softmax in float64."""
    wholes = [(c + k)[-(MAX_LENGTH + 1) :] for _, c, k in requests]
    tokens = np.zeros((len(wholes), MAX_LENGTH), np.int32)
    for row, whole in enumerate(wholes):
        tokens[row, : len(whole) - 1] = whole[:-1]
    logits = np.asarray(model(tokens), np.float64)  # [N, MAX_LENGTH, V]
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    answers = []
    for row, ((_, _, continuation), whole) in enumerate(zip(requests, wholes, strict=True)):
        positions = np.arange(len(whole) - 1 - len(continuation), len(whole) - 1)
        picked = logprobs[row, positions, continuation]
        greedy = logits[row, positions].argmax(-1) == continuation
        answers.append((picked.sum(), bool(greedy.all())))
    return answers


def _compiles(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]


def test_loglikelihoods_are_the_models_and_compile_one_program_per_bucket(loaded, lm, caplog):
    model, _ = loaded
    requests = _requests(120)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        ours = lm._loglikelihood_tokens(requests, disable_tqdm=True)
        lm._loglikelihood_tokens(_requests(200, seed=1), disable_tqdm=True)
        compiled = _compiles(caplog)
        again = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    # Rows of 32, 64, 128 or 256 tokens (harness.packing): at most four programs for any
    # number of requests of any length; repeating them compiles nothing.
    assert 2 <= len(compiled) <= 4 and all("jit(score)" in m for m in compiled), compiled
    assert _compiles(caplog) == compiled
    assert again == ours
    theirs = _reference(model, requests)
    np.testing.assert_allclose([s for s, _ in ours], [s for s, _ in theirs], rtol=1e-5)
    assert [g for _, g in ours] == [g for _, g in theirs]


@pytest.mark.parametrize(
    ("mesh", "row_multiple"),
    [
        ([[4, 2], ["fsdp", "tp"]], 4),  # the batch's rows are split over fsdp
        ([[2, 4], ["cp", "fsdp"]], 4),  # and each row's 32 tokens over cp, in 4 chunks
        ([[4, 2], ["cp", "tp"]], 1),
    ],
)
def test_a_mesh_gives_the_numbers_of_one_device(checkpoint, lm, loaded, mesh, row_multiple):
    model, tokenizer = loaded
    sharded = meshtrain.load_hf(checkpoint, mesh)
    on_mesh = MeshtrainLM.from_model(sharded, tokenizer, max_length=MAX_LENGTH, batch_tokens=256)
    assert on_mesh.engine.row_multiple == row_multiple
    requests = [(None, c[:20], k) for _, c, k in _requests(24, seed=2)]  # one bucket: 32
    ours = on_mesh._loglikelihood_tokens(requests, disable_tqdm=True)
    one_device = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    np.testing.assert_allclose(ours, one_device, rtol=1e-5)
    # Generation on the same mesh picks the same ids.
    prompt = lm.tok_encode("def function_5(value):")
    (new,) = on_mesh.engine.generate([Generation(tuple(prompt), ("\x00",), 12)])
    assert new == generate_ids(model, prompt, 12).tolist()  # (no eos among them)


def test_generation_stops_at_a_stop_string_with_the_tokens_generate_picks(loaded, lm):
    model, tokenizer = loaded
    prompt = lm.tok_encode("def function_5(value):")
    free = generate_ids(model, prompt, 16, stop_ids=(tokenizer.eos_id,))  # meshtrain's own
    assert free.size == 16
    stop = tokenizer.decode(free[4:6])  # text the model will produce at its 5th-6th tokens
    text = tokenizer.decode(free)
    assert stop.strip() and text.find(stop) > 0
    (new,) = lm.engine.generate([Generation(tuple(prompt), (stop,), 16)])
    assert new == free[: len(new)].tolist() and len(new) <= 6  # stopped once the text held it

    class Request:
        args = ("def function_5(value):", {"until": [stop], "max_gen_toks": 16})

    (answer,) = lm.generate_until([Request()], disable_tqdm=True)
    assert answer == text[: text.find(stop)]
    (capped,) = lm.generate_until(
        [type("R", (), {"args": (Request.args[0], {"until": ["\x00"], "max_gen_toks": 3})})()],
        disable_tqdm=True,
    )
    assert capped == tokenizer.decode(free[:3])


def _request(context: str, until: list[str], max_gen_toks: int):
    return type(
        "Request", (), {"args": (context, {"until": until, "max_gen_toks": max_gen_toks})}
    )()


def test_generate_until_continues_requests_together_as_each_would_alone(loaded, caplog):
    """Requests of two kinds (stop strings, max_gen_toks), 3 at a time (the last batch of each
    kind padded): each answer is its prompt's own greedy ids cut before the first stop string,
    in the requests' order; the prefill and the stretch program compile once per kind and
    prompt bucket."""
    model, tokenizer = loaded
    lm = MeshtrainLM.from_model(model, tokenizer, max_length=MAX_LENGTH, generate_batch=3)
    contexts = [
        "def function_5(value):",
        "import json",
        "The quick brown fox",
        "x = 1",
        "return value * 7 + len(",
        "class A:",
        "for i in range(10):",
    ]
    free = {
        c: generate_ids(model, lm.tok_encode(c), 20, stop_ids=(tokenizer.eos_id,)) for c in contexts
    }
    stop = tokenizer.decode(free[contexts[0]][4:6])  # the first one stops at its 5th-6th ids
    assert stop.strip()
    kinds = [([stop], 20), (["\x00"], 5)]  # the second never stops before its 5 tokens
    requests = [_request(c, *kinds[i % 2]) for i, c in enumerate(contexts)]
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        answers = lm.generate_until(requests, disable_tqdm=True)
    for i, (context, answer) in enumerate(zip(contexts, answers, strict=True)):
        (until,), max_gen_toks = kinds[i % 2]
        ids = free[context][:max_gen_toks]
        ids = ids[:-1] if ids.size and ids[-1] == tokenizer.eos_id else ids
        assert answer == tokenizer.decode(ids).split(until)[0], context
    assert answers[0] == tokenizer.decode(free[contexts[0]]).split(stop)[0] != ""
    assert len(answers[0]) < len(tokenizer.decode(free[contexts[0]]))  # cut at the stop
    lengths = [len(lm.tok_encode(c)) for c in contexts]
    assert lengths == [8, 12, 20, 5, 9, 9, 18]
    # The first kind's longest three (20, 18, 9) in bucket 32, then 8 in 16; the second's (12, 9,
    # 5) in 16: three (kind, bucket) pairs, each the prefill and the stretch.
    compiled = [m for m in _compiles(caplog) if "_begin_program" in m or "_advance_program" in m]
    assert len(compiled) == 6, compiled


def test_evaluate_in_place_reuses_its_programs_for_new_parameters(loaded, caplog):
    model, tokenizer = loaded
    options = dict(limit=3, include_path=[EXAMPLE_TASKS], max_length=MAX_LENGTH)
    first = evaluate_in_place(model, tokenizer, TASKS, **options)
    assert {task: set(m) for task, m in first.items()} == METRICS
    assert all(np.isfinite(v) for m in first.values() for v in m.values())
    assert 0 <= first["meshtrain_choice"]["acc"] <= 1
    # As a training loop calls it: a module rebuilt around arrays of the same shapes (here the
    # same arrays, so the same metrics) compiles nothing.
    rebuilt = nnx.merge(*nnx.split(model))
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        second = evaluate_in_place(rebuilt, tokenizer, TASKS, **options)
    assert _compiles(caplog) == []
    assert second == first


def test_a_hugging_face_checkpoint_takes_bos_as_its_tokenizer_adds_it(tmp_path, caplog):
    # Both tokenizers define <bos> (id 1); only the first one's tokenizer.json adds it.
    caplog.set_level(logging.INFO, logger="meshtrain.harness")
    for bos in (True, False):
        directory = write_tiny_llama(tmp_path / str(bos), bos=bos)
        lm = MeshtrainLM(checkpoint=str(directory), batch_tokens=1024)
        assert lm.add_bos_token is bos
        ids = lm.tok_encode("def f")
        assert (ids[0] == 1) is bos and lm.tok_encode("def f", add_special_tokens=True)[0] == 1
        said = "start with" if bos else "do not start with"
        assert f"evaluation: requests {said} bos, as the tokenizer's own rule says" in caplog.text
    forced = MeshtrainLM(checkpoint=str(directory), batch_tokens=1024, add_bos_token=True)
    assert forced.add_bos_token and forced.tok_encode("def f")[0] == 1


def test_a_loaded_meshtrain_model_starts_requests_with_bos_as_it_was_trained(lm):
    assert lm.add_bos_token and lm.tok_encode("def f")[0] == lm.meshtrain_tokenizer.bos_id
