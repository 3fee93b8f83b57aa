"""A model fine-tuned on chat data, exported to Hugging Face: transformers gives its logits and
its greedy answers to a templated conversation (parity extra; slow)."""

import numpy as np
import pytest
from helpers.paths import REPO
from helpers.runs import train_tiny

from meshtrain.data.chat.encoder import build_chat_encoder
from meshtrain.inference.generate import generate_chat
from meshtrain.models.abstract import merge_model
from meshtrain.weights.load import load_model

GEMMA = REPO / "tests" / "fixtures" / "chat" / "gemma3"
EXAMPLES = REPO / "examples" / "chat" / "addition.jsonl"
QUESTION = [{"role": "user", "content": "12+7="}]


@pytest.mark.slow  # about 25 s
def test_a_chat_fine_tune_exports_to_transformers_with_its_logits_and_answers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from meshtrain.cli.export import main as export_main

    result = train_tiny(
        tmp_path / "run",
        "data=chat",
        f"data.paths=[{EXAMPLES}]",
        f"data.tokenizer={GEMMA}",
        "data.cache_dir=null",
        "model.vocab_size=512",
        "data.seq_len=64",
        "training.steps=60",
        "training.eval_every=0",
        devices=1,
    )
    assert export_main([str(tmp_path / "run"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    encoder = build_chat_encoder(str(GEMMA))
    prompt = encoder.render_generation_prompt(QUESTION)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (
        tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
        == prompt.ids.tolist()
    )
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation="eager", torch_dtype=torch.float32
    ).eval()
    with torch.no_grad():
        theirs = reloaded(torch.tensor([prompt.ids.tolist()])).logits[0].numpy()
    model = merge_model(result.setup.model, result.state.params)
    ours = np.asarray(model(prompt.ids[None]))[0]
    assert np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)) <= 1e-5
    with torch.no_grad():
        answer = reloaded.generate(
            torch.tensor([prompt.ids.tolist()]),
            do_sample=False,
            max_new_tokens=8,
            eos_token_id=list(prompt.stop_ids),
            pad_token_id=prompt.stop_ids[0],
        )[0, len(prompt.ids) :]
    expected = tokenizer.decode(answer, skip_special_tokens=True)
    assert generate_chat(load_model(tmp_path / "hf"), encoder, QUESTION, 8) == expected
    assert expected.strip().isdigit()  # after 60 steps it answers with a number
    # Told nothing about stops, transformers reads them from generation_config.json, which lists
    # <end_of_turn> beside eos: it stops where meshtrain's --chat stops.
    assert reloaded.generation_config.eos_token_id == list(prompt.stop_ids)
    with torch.no_grad():
        plain = reloaded.generate(
            torch.tensor([prompt.ids.tolist()]), do_sample=False, max_new_tokens=32
        )[0, len(prompt.ids) :]
    assert int(plain[-1]) in prompt.stop_ids and len(plain) < 32
    assert tokenizer.decode(plain, skip_special_tokens=True) == expected
