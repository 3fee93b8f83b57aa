"""`python -m meshtrain.generate --chat`: the user's message (or --messages' conversation) is
rendered with the checkpoint tokenizer's chat template, exactly the ids
ChatEncoder.render_generation_prompt gives, and only the assistant's answer is printed, up to the
template's end-of-turn token. A bigram model (tiny_hf's Llama with its blocks switched off and a
head that chains the generation prompt's last token to ANSWER, then to <end_of_turn>) makes the
answer and where it stops known. The slow test compares the greedy answer with transformers'
generate on a checkpoint made by transformers itself."""

from __future__ import annotations

import itertools
import json
import shutil

import numpy as np
import pytest
from helpers import tiny_hf
from helpers.paths import REPO
from safetensors.numpy import load_file, save_file

from meshtrain.cli.generate import main
from meshtrain.data.chat.encoder import build_chat_encoder
from meshtrain.inference import generate as generation
from meshtrain.weights.load import load_hf

CHAT_FIXTURES = REPO / "tests" / "fixtures" / "chat"
QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful assistant."
ANSWER = "The capital is Paris."
END_OF_TURN = 5  # <end_of_turn> in the gemma3 fixture tokenizer; its eos (<eos>) is 1
# A Gemma 3 style template of one's own, for --chat-template.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }} says:\n{{ m.content }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def copy_chat_tokenizer(directory, family="gemma3", *, template=True):
    """The family's fixture tokenizer.json and tokenizer_config.json, into `directory`; without
    its chat_template if not `template`."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(CHAT_FIXTURES / family / "tokenizer.json", directory / "tokenizer.json")
    config = json.loads((CHAT_FIXTURES / family / "tokenizer_config.json").read_text())
    if not template:
        del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    """A checkpoint whose greedy answer to any conversation is ANSWER then <end_of_turn>: the
    attention and MLP outputs are zero, so the logits are the head's of the last token's
    embedding, and the chain from the generation prompt's last token ("\\n") through ANSWER's
    tokens to <end_of_turn> has one-hot embeddings that the head's rows of the next token match."""
    directory = tiny_hf.write_checkpoint("llama", tmp_path_factory.mktemp("bigram"))
    encoder = build_chat_encoder(str(copy_chat_tokenizer(directory) / "tokenizer.json"))
    last = int(encoder.render_generation_prompt([{"role": "user", "content": QUESTION}]).ids[-1])
    answer_ids = encoder.tokenizer.encode(ANSWER).tolist()
    chain = [last, *answer_ids, END_OF_TURN]
    assert len(set(chain)) == len(chain) and encoder.tokenizer.decode(answer_ids) == ANSWER
    tensors = load_file(directory / "model.safetensors")
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor[:] = 0
    tensors["model.norm.weight"][:] = 1
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    head[:] = 0
    for i, (token, after) in enumerate(itertools.pairwise(chain)):
        embed[token] = np.eye(embed.shape[1], dtype=embed.dtype)[i]
        head[after] = np.eye(embed.shape[1], dtype=embed.dtype)[i]
    save_file(tensors, directory / "model.safetensors")
    return directory, encoder, answer_ids


@pytest.fixture
def calls(monkeypatch):
    """What generate_ids_batch is called with and returns, per prompt."""
    seen = []
    original = generation.generate_ids_batch

    def spy(model, prompts, *args, **kwargs):
        new = original(model, prompts, *args, **kwargs)
        for prompt_ids, ids in zip(prompts, new, strict=True):
            seen.append(
                dict(prompt_ids=np.asarray(prompt_ids).tolist(), new=ids.tolist(), **kwargs)
            )
        return new

    monkeypatch.setattr(generation, "generate_ids_batch", spy)
    return seen


def test_chat_answers_the_rendered_prompt_up_to_the_end_of_turn(bigram, calls, capsys):
    directory, encoder, answer_ids = bigram
    # 8 new tokens at most, as test_generate_ids_ends_with_the_first_stop_id_picked asks of the
    # same prompt: the two compile one prefill and one decode step.
    assert main([str(directory), QUESTION, "--chat", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == ANSWER + "\n"
    prompt = encoder.render_generation_prompt([{"role": "user", "content": QUESTION}])
    [call] = calls
    assert call["prompt_ids"] == prompt.ids.tolist()
    assert set(call["stop_ids"]) == set(prompt.stop_ids) == {1, END_OF_TURN}
    assert call["new"] == [*answer_ids, END_OF_TURN]  # stopped there, 4 tokens short of 8


def test_chat_stops_at_max_new_tokens(bigram, calls, capsys):
    directory, encoder, answer_ids = bigram
    assert main([str(directory), QUESTION, "--chat", "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out == encoder.tokenizer.decode(answer_ids[:2]) + "\n"
    assert calls[0]["new"] == answer_ids[:2]


@pytest.mark.slow
def test_system_message_and_messages_file(bigram, calls, capsys, tmp_path):
    directory, encoder, _ = bigram
    conversation = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": QUESTION},
    ]
    (tmp_path / "chat.json").write_text(json.dumps(conversation))
    assert main([str(directory), QUESTION, "--chat", "--system", SYSTEM]) == 0
    assert main([str(directory), "--messages", str(tmp_path / "chat.json")]) == 0
    assert capsys.readouterr().out == f"{ANSWER}\n{ANSWER}\n"
    asked = [conversation[0], conversation[3]]
    assert [c["prompt_ids"] for c in calls] == [
        encoder.render_generation_prompt(m).ids.tolist() for m in (asked, conversation)
    ]


def test_chat_template_file_replaces_the_tokenizers(bigram, calls, capsys, tmp_path):
    directory, _, _ = bigram
    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    assert (
        main([str(directory), QUESTION, "--chat-template", str(tmp_path / "chat.jinja"), "--chat"])
        == 0
    )
    assert capsys.readouterr().out == ANSWER + "\n"
    tokenizer = str(directory / "tokenizer.json")
    own = build_chat_encoder(tokenizer, str(tmp_path / "chat.jinja"))
    prompt = own.render_generation_prompt([{"role": "user", "content": QUESTION}])
    assert calls[0]["prompt_ids"] == prompt.ids.tolist()
    assert (
        prompt.ids.tolist()
        != build_chat_encoder(tokenizer)
        .render_generation_prompt([{"role": "user", "content": QUESTION}])
        .ids.tolist()
    )


@pytest.mark.slow
def test_a_prompts_file_answers_each_prompt_in_batches(bigram, calls, capsys, tmp_path):
    """--prompts FILE.jsonl with --chat: a string is the user's message, a list the whole
    conversation; one JSON line per prompt, {"prompt" as given, "completion"}; batches of
    --batch-size (3 prompts in 2 batches: 2 calls of 2 and 1 prompts)."""
    directory, encoder, answer_ids = bigram
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    records = [{"prompt": QUESTION}, {"prompt": conversation}, {"prompt": "Say hello."}]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    argv = [str(directory), "--chat", "--prompts", str(tmp_path / "prompts.jsonl")]
    assert main([*argv, "--batch-size", "2", "--max-new-tokens", "8"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines == [{"prompt": r["prompt"], "completion": ANSWER} for r in records]
    asked = [[{"role": "user", "content": QUESTION}], conversation]
    asked.append([{"role": "user", "content": "Say hello."}])
    assert [c["prompt_ids"] for c in calls] == [
        encoder.render_generation_prompt(m).ids.tolist() for m in asked
    ]
    assert [c["new"] for c in calls] == [[*answer_ids, END_OF_TURN]] * 3


def test_a_prompts_file_is_checked_before_the_model_loads(tmp_path, capsys):
    directory = copy_chat_tokenizer(tmp_path / "tok")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    (tmp_path / "m.jsonl").write_text('{"prompt": [{"role": "user", "content": "a"}]}\n')
    (tmp_path / "empty.txt").write_text("\n")
    p, m = tmp_path / "p.jsonl", tmp_path / "m.jsonl"
    errors = {
        ("--prompts", p, QUESTION): "--prompts holds every prompt; drop the prompt argument",
        (
            "--prompts",
            p,
            "--chat",
        ): f'--prompts {p}:2: a .jsonl line must be a record with "prompt" '
        "(a string, or with --chat a list of messages)",
        ("--prompts", m): f"--prompts {m}:1: the prompt is not a string; pass --chat for messages",
        ("--prompts", tmp_path / "empty.txt"): f"--prompts='{tmp_path / 'empty.txt'}' holds no "
        "prompt",
        ("--prompts", p, "--top-k", "5"): "--top-k and --top-p choose among the tokens to sample, "
        "but --temperature=0 picks the most likely one; set --temperature (e.g. 1.0) to sample",
        ("--prompts", p, "--top-p", "0", "--temperature", "1"): "--top-k=0 must be >= 0 (0: all "
        "tokens) and --top-p=0.0 in (0, 1] (1: all tokens)",
    }
    for args, message in errors.items():
        assert _error(capsys, directory, *args) == f"meshtrain: error: {message}\n"


def test_generate_ids_ends_with_the_first_stop_id_picked(bigram):
    directory, encoder, answer_ids = bigram
    model = load_hf(directory)
    prompt = encoder.render_generation_prompt([{"role": "user", "content": QUESTION}])
    picked = [
        generation.generate_ids(
            model, prompt.ids, 8, stop_ids=stops, vocab_size=encoder.tokenizer.vocab_size
        ).tolist()
        for stops in ({answer_ids[1]}, prompt.stop_ids, ())
    ]
    assert picked[0] == answer_ids[:2]
    assert picked[1] == [*answer_ids, END_OF_TURN]
    assert len(picked[2]) == 8 and picked[2][: len(picked[1])] == picked[1]


def _error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit:
        main([str(a) for a in argv])
    assert exit.value.code == 2
    return capsys.readouterr().err


def test_a_tokenizer_without_chat_template_is_one_line_error(tmp_path, capsys):
    """Before any model is loaded: the directory holds only the tokenizer."""
    directory = copy_chat_tokenizer(tmp_path / "plain", template=False)
    assert _error(capsys, directory, QUESTION, "--chat") == (
        f"meshtrain: error: tokenizer '{directory / 'tokenizer.json'}' has no chat template; "
        "set --chat-template=PATH to a .jinja file\n"
    )
    assert _error(capsys, directory, QUESTION, "--chat", "--tokenizer", "byte") == (
        "meshtrain: error: tokenizer byte has no chat template; chat data needs a Hugging Face "
        "tokenizer\n"
    )


def test_chat_options_go_together(tmp_path, capsys):
    directory = copy_chat_tokenizer(tmp_path / "tok")
    (tmp_path / "bad.json").write_text('[{"role": "user"}]')
    errors = {
        ("--system", SYSTEM, QUESTION): "--system goes with --chat",
        ("--messages", tmp_path / "bad.json", QUESTION): "--messages holds the whole "
        "conversation; pass no prompt with it",
        ("--messages", tmp_path / "bad.json", "--system", ""): "--messages holds the whole "
        "conversation; put the system message in it, not in --system",
        ("--chat-template", "x.jinja", "--system", "", QUESTION): "--system and --chat-template "
        "go with --chat",
        ("--chat",): "no prompt; pass the user's message, or --messages FILE.json",
        ("--messages", tmp_path / "bad.json"): f"--messages='{tmp_path / 'bad.json'}': "
        "messages[0] has no 'content'; a message is {role, content}",
    }
    for args, message in errors.items():
        assert _error(capsys, directory, *args) == f"meshtrain: error: {message}\n"


# Tiny transformers models of two families, made by transformers itself (from_config), with
# untied heads so that a head row can be edited without changing what the model reads.
PARITY = {
    "gemma3": (
        "Gemma3TextConfig",
        dict(num_hidden_layers=7, sliding_window=16, query_pre_attn_scalar=24),
    ),
    "llama3": ("LlamaConfig", dict(num_hidden_layers=3)),
}
PARITY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
NEW_TOKENS = 24  # after prompts of 28 (Gemma) and 69 (Llama) tokens: past Gemma's window of 16


@pytest.mark.slow
@pytest.mark.parametrize("family", PARITY)
def test_greedy_chat_answer_is_what_transformers_generates(family, tmp_path, calls, capsys):
    """The same prompt ids as apply_chat_template(add_generation_prompt=True) and the same new
    ids as generate(do_sample=False, eos_token_id=stop ids): once running to max_new_tokens, and
    once with the head's end-of-turn row made 1.05 times the row of the token picked halfway, so
    that the answer stops at the end-of-turn token by then."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    directory = copy_chat_tokenizer(tmp_path / "tokenizer", family)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    stop_ids = list(build_chat_encoder(str(directory / "tokenizer.json")).stop_ids)
    config_class, fields = PARITY[family]
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), **PARITY_SHAPE, **fields
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.eval()
    with torch.no_grad():  # larger than the default 0.02, so that the picks are far from ties
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.08)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)

    def theirs() -> list[int]:
        with torch.no_grad():
            output = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=stop_ids,
                pad_token_id=stop_ids[0],
            )
        return output[0, len(prompt) :].tolist()

    def ours(name: str) -> list[int]:
        model.save_pretrained(copy_chat_tokenizer(tmp_path / name, family))
        argv = [str(tmp_path / name), QUESTION, "--chat", "--system", SYSTEM]
        assert main([*argv, "--max-new-tokens", str(NEW_TOKENS)]) == 0
        call = calls.pop()
        assert call["prompt_ids"] == prompt
        answer = tokenizer.decode(call["new"], skip_special_tokens=True)
        assert capsys.readouterr().out == answer + "\n"
        return call["new"]

    free = theirs()
    assert len(free) == NEW_TOKENS and not set(free) & set(stop_ids), free
    assert ours("free") == free
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[stop_ids[-1]] = 1.05 * head[free[NEW_TOKENS // 2]]
    stopped = theirs()
    assert len(stopped) <= NEW_TOKENS // 2 + 1 and stopped[-1] == stop_ids[-1], stopped
    assert ours("stopped") == stopped
