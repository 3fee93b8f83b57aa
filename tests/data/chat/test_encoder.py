"""Chat records → ids and trained masks (meshtrain.data.chat.encoder, meshtrain.data.chat.template) with
the real templates of Gemma 3, Llama 3.2 and Qwen 3 on tiny tokenizers (tests/fixtures/chat/):
the rendering and ids are transformers' (committed in expected.json; the slow tests compare with
transformers itself), the trained tokens are exactly the assistants' words and the token that
closes each turn, and every error is one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers.paths import REPO
from helpers.tiny_tokenizers import train_sentencepiece
from tokenizers import Tokenizer

from meshtrain.data.chat.encoder import ChatEncoder, build_chat_encoder, load_chat_template
from meshtrain.data.chat.template import ChatTemplate
from meshtrain.data.tokenizer import build_tokenizer
from meshtrain.errors import ConfigError, DataError

FIXTURES = REPO / "tests" / "fixtures" / "chat"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text(encoding="utf-8"))
FAMILIES = sorted(EXPECTED)
CASES = [(f, name) for f in FAMILIES for name in EXPECTED[f]["conversations"]]
# What each family's template writes before and after an assistant's words.
HEADER = {
    "gemma3": "<start_of_turn>model\n",
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "qwen3": "<|im_start|>assistant\n",
}
CLOSE = {"gemma3": "<end_of_turn>", "llama3": "<|eot_id|>", "qwen3": "<|im_end|>"}
EMPTY_THINK = "<think>\n\n</think>\n\n"  # Qwen 3 writes it in the last assistant turn
# The trained tokens of each conversation, one string per run of consecutive trained tokens.
TRAINED = {
    "system_multi_turn": {
        "gemma3": ["The capital of France is Paris.<end_of_turn>", "Rome.<end_of_turn>"],
        "llama3": ["The capital of France is Paris.<|eot_id|>", "Rome.<|eot_id|>"],
        "qwen3": ["The capital of France is Paris.<|im_end|>", f"{EMPTY_THINK}Rome.<|im_end|>"],
    },
    "single_turn": {
        "gemma3": ["Hello!<end_of_turn>"],
        "llama3": ["Hello!<|eot_id|>"],
        "qwen3": [f"{EMPTY_THINK}Hello!<|im_end|>"],
    },
    "unicode": {
        "gemma3": ["¡Hola! ✓ Ünïcödé → fine.<end_of_turn>"],
        "llama3": ["¡Hola! ✓ Ünïcödé → fine.<|eot_id|>"],
        "qwen3": [f"{EMPTY_THINK}¡Hola! ✓ Ünïcödé → fine.<|im_end|>"],
    },
    "padded_and_empty": {  # Gemma and Llama trim the content, Qwen does not
        "gemma3": ["<end_of_turn>", "trimmed?<end_of_turn>"],
        "llama3": ["<|eot_id|>", "trimmed?<|eot_id|>"],
        "qwen3": ["<|im_end|>", f"{EMPTY_THINK}  trimmed?\n\n<|im_end|>"],
    },
    "think": {  # Qwen drops the reasoning of turns before the last question
        "gemma3": [
            "<think>add them</think>four<end_of_turn>",
            "<think>\nthink again\n</think>\n\nfour<end_of_turn>",
        ],
        "llama3": [
            "<think>add them</think>four<|eot_id|>",
            "<think>\nthink again\n</think>\n\nfour<|eot_id|>",
        ],
        "qwen3": ["four<|im_end|>", "<think>\nthink again\n</think>\n\nfour<|im_end|>"],
    },
    "consecutive_assistant": {
        "llama3": ["First.<|eot_id|>", "Second.<|eot_id|>"],
        "qwen3": ["First.<|im_end|>", f"{EMPTY_THINK}Second.<|im_end|>"],
    },
}
USER = {"role": "user", "content": "Say hello."}
ASSISTANT = {"role": "assistant", "content": "Hello!"}


@pytest.fixture(scope="module")
def encoders() -> dict[str, ChatEncoder]:
    return {
        f: build_chat_encoder(str(FIXTURES / f), template_kwargs=EXPECTED[f]["template_kwargs"])
        for f in FAMILIES
    }


def decoded_runs(family: str, ids: np.ndarray, trained: np.ndarray) -> list[str]:
    """The text of each run of consecutive trained tokens, special tokens included."""
    tokenizer = Tokenizer.from_file(str(FIXTURES / family / "tokenizer.json"))
    positions = np.flatnonzero(trained)
    runs = np.split(positions, np.flatnonzero(np.diff(positions) > 1) + 1)
    return [tokenizer.decode(ids[r].tolist(), skip_special_tokens=False) for r in runs]


@pytest.mark.parametrize(("family", "name"), CASES)
def test_rendering_and_ids_are_transformers(encoders, family, name):
    case = EXPECTED[family]["conversations"][name]
    encoder = encoders[family]
    assert encoder.render(case["messages"]) == case["text"]
    encoded = encoder.encode({"messages": case["messages"]})
    assert encoded.ids.dtype == np.int32 and encoded.trained.dtype == bool
    assert encoded.ids.tolist() == case["ids"]
    last_user = max(i for i, m in enumerate(case["messages"]) if m["role"] == "user")
    prompt = encoder.render_generation_prompt(case["messages"][: last_user + 1])
    assert prompt.ids.tolist() == case["generation_prompt_ids"]


@pytest.mark.parametrize(("family", "name"), CASES)
def test_trained_tokens_are_the_assistants_words_and_the_end_of_turn(encoders, family, name):
    messages = EXPECTED[family]["conversations"][name]["messages"]
    encoded = encoders[family].encode({"messages": messages})
    assert decoded_runs(family, encoded.ids, encoded.trained) == TRAINED[name][family]


@pytest.mark.parametrize(
    ("family", "positions", "length"),
    [
        ("gemma3", [16, 17, 18, 19], 21),  # ... <start_of_turn>model\n | Hello!<end_of_turn> | \n
        ("llama3", [56, 57, 58, 59], 60),  # ... <|end_header_id|>\n\n | Hello!<|eot_id|>
        ("qwen3", list(range(17, 27)), 28),  # ... assistant\n | <think>...Hello!<|im_end|> | \n
    ],
)
def test_trained_positions_of_one_turn(encoders, family, positions, length):
    encoded = encoders[family].encode({"messages": [USER, ASSISTANT]})
    assert len(encoded.ids) == length
    assert np.flatnonzero(encoded.trained).tolist() == positions
    tokenizer = Tokenizer.from_file(str(FIXTURES / family / "tokenizer.json"))
    before = tokenizer.decode(encoded.ids[: positions[0]].tolist(), skip_special_tokens=False)
    after = tokenizer.decode(encoded.ids[positions[-1] + 1 :].tolist(), skip_special_tokens=False)
    assert before.endswith(HEADER[family]) and after in ("", "\n")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_probe_finds_the_generation_prompt_and_the_end_of_turn(encoders, family):
    encoder = encoders[family]
    assert encoder.generation_prompt == HEADER[family]
    assert encoder.end_of_turn == CLOSE[family]
    tokenizer = Tokenizer.from_file(str(FIXTURES / family / "tokenizer.json"))
    eos = tokenizer.token_to_id(EXPECTED_EOS[family])
    assert encoder.stop_ids == tuple(dict.fromkeys([eos, tokenizer.token_to_id(CLOSE[family])]))


EXPECTED_EOS = {"gemma3": "<eos>", "llama3": "<|eot_id|>", "qwen3": "<|im_end|>"}


@pytest.mark.parametrize("family", FAMILIES)
def test_train_on_completion_and_all(encoders, family):
    messages = EXPECTED[family]["conversations"]["system_multi_turn"]["messages"]
    encoder = encoders[family]
    every = encoder.encode_messages(messages)
    last = encoder.encode_messages(messages, train_on="completion")
    everything = encoder.encode_messages(messages, train_on="all")
    assert decoded_runs(family, last.ids, last.trained) == TRAINED["system_multi_turn"][family][1:]
    assert everything.trained.all() and every.trained.sum() > last.trained.sum()
    assert every.ids.tolist() == last.ids.tolist() == everything.ids.tolist()
    # The same set as the encoder's default: ChatEncoder(train_on=...) applies to every record.
    configured = ChatEncoder(
        encoder.tokenizer,
        encoder.template,
        train_on="completion",
        template_kwargs=EXPECTED[family]["template_kwargs"],
    )
    assert configured.encode({"messages": messages}).trained.tolist() == last.trained.tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_conversational_prompt_and_completion(encoders, family):
    messages = EXPECTED[family]["conversations"]["system_multi_turn"]["messages"]
    encoder = encoders[family]
    record = {"prompt": messages[:-1], "completion": messages[-1:]}
    as_messages = encoder.encode_messages(messages, train_on="completion")
    encoded = encoder.encode(record)  # train_on defaults to completion
    assert encoded.ids.tolist() == as_messages.ids.tolist()
    assert encoded.trained.tolist() == as_messages.trained.tolist()
    every = encoder.encode_prompt_completion(
        record["prompt"], record["completion"], train_on="assistant"
    )
    assert every.trained.tolist() == encoder.encode_messages(messages).trained.tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_prompt_and_completion_are_trl(encoders, family):
    """Not templated: prompt + completion + eos with the tokenizer's bos, trained from the
    completion on, as trl's SFTTrainer tokenizes them."""
    plain = EXPECTED[family]["prompt_completion"]
    encoder = encoders[family]
    encoded = encoder.encode({"prompt": plain["prompt"], "completion": plain["completion"]})
    assert encoded.ids.tolist() == plain["ids"]
    n = len(plain["prompt_ids"])
    assert encoded.trained.tolist() == [False] * n + [True] * (len(plain["ids"]) - n)
    eos = EXPECTED_EOS[family]
    again = encoder.encode_prompt_completion(plain["prompt"], plain["completion"] + eos)
    assert again.ids.tolist() == plain["ids"]  # an eos already there is not doubled
    everything = encoder.encode_prompt_completion(
        plain["prompt"], plain["completion"], train_on="all"
    )
    assert everything.trained.all()


def test_keys_are_parameters(encoders):
    encoder = encoders["gemma3"]
    renamed = ChatEncoder(
        encoder.tokenizer,
        encoder.template,
        messages_key="conversation",
        prompt_key="question",
        completion_key="answer",
    )
    messages = [USER, ASSISTANT]
    assert (
        renamed.encode({"conversation": messages}).ids.tolist()
        == encoder.encode_messages(messages).ids.tolist()
    )
    assert renamed.encode({"question": "a", "answer": "b"}).ids.tolist() == (
        encoder.encode({"prompt": "a", "completion": "b"}).ids.tolist()
    )


def test_a_template_that_changes_earlier_turns_is_followed():
    """Qwen 3 writes the empty <think> block in the last assistant turn only: rendered alone, the
    turns before the second assistant turn end differently than in the whole conversation, and
    with enable_thinking=False its generation prompt has a <think> block earlier turns lack."""
    messages = EXPECTED["qwen3"]["conversations"]["consecutive_assistant"]["messages"]
    encoder = build_chat_encoder(str(FIXTURES / "qwen3"))
    assert not encoder.render(messages).startswith(
        encoder.render(messages[:2], add_generation_prompt=True)
    )
    no_thinking = build_chat_encoder(
        str(FIXTURES / "qwen3"), template_kwargs={"enable_thinking": False}
    )
    assert no_thinking.generation_prompt == "<|im_start|>assistant\n" + EMPTY_THINK
    conversation = EXPECTED["qwen3"]["conversations"]["system_multi_turn"]["messages"]
    encoded = no_thinking.encode_messages(conversation)
    assert decoded_runs("qwen3", encoded.ids, encoded.trained) == [
        "The capital of France is Paris.<|im_end|>",
        "Rome.<|im_end|>",  # its <think> block is the generation prompt's now
    ]


def test_the_template_file_and_its_precedence(tmp_path):
    """data.chat_template > chat_template.jinja > tokenizer_config.json's chat_template (a string,
    or named templates of which default); a tokenizer.json names its directory."""
    shutil.copy(FIXTURES / "gemma3" / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((FIXTURES / "gemma3" / "tokenizer_config.json").read_text())
    write = lambda c: (tmp_path / "tokenizer_config.json").write_text(json.dumps(c))  # noqa: E731
    write(
        {
            **config,
            "chat_template": [
                {"name": "tool_use", "template": "T"},
                {"name": "default", "template": "D{{ bos_token }}"},
            ],
        }
    )
    assert load_chat_template(str(tmp_path)).text == "D{{ bos_token }}"
    assert load_chat_template(str(tmp_path / "tokenizer.json")).origin == str(
        tmp_path / "tokenizer_config.json"
    )
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(str(tmp_path)).text == "J"
    assert load_chat_template(str(tmp_path)).origin == str(tmp_path / "chat_template.jinja")
    (tmp_path / "override.jinja").write_text("O")
    template = load_chat_template(str(tmp_path), str(tmp_path / "override.jinja"))
    assert (template.text, template.special_tokens["bos_token"]) == ("O", "<bos>")


def test_special_tokens_for_the_template(tmp_path):
    """Every *_token of tokenizer_config.json (strings or {content}), as transformers passes its
    special_tokens_map; none for a token that is null."""
    config = {
        "bos_token": None,
        "eos_token": {"content": "<e>"},
        "image_token": "<img>",
        "pad_token": "<p>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokens = load_chat_template(str(tmp_path), str(FIXTURES / "README.md")).special_tokens
    assert tokens == {"eos_token": "<e>", "image_token": "<img>", "pad_token": "<p>"}


def test_transformers_helpers_and_sandbox():
    """tojson without HTML escaping and with json.dumps' options, raise_exception, strftime_now,
    dict, namespace, loop controls, the {% generation %} block, trim_blocks and lstrip_blocks."""
    source = (
        "{{ messages[0] | tojson }}|{{ {'a': [1, 2]} | tojson(indent=2) }}|"
        "{{ dict(x=1) | tojson }}|{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|"
        "{% generation %}G{{ bos_token }}{% endgeneration %}|{{ strftime_now('%Y') | length }}\n"
        "  {% if true %}\nkept\n  {% endif %}\n"
    )
    template = ChatTemplate(source, "inline", {"bos_token": "<s>"})
    messages = [{"role": "user", "content": "<a> & é"}, {"role": "user", "content": "x"}]
    assert template.render(messages) == (
        '{"role": "user", "content": "<a> & é"}|{\n  "a": [\n    1,\n    2\n  ]\n}|{"x": 1}|1|G<s>|4\nkept\n'
    )
    with pytest.raises(DataError, match="underscore-prefixed"):
        ChatTemplate("{% set ns = namespace(_x=1) %}", "inline", {}).render(messages)
    with pytest.raises(DataError, match=r"unsafe|access"):
        ChatTemplate(
            "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", "inline", {}
        ).render(messages)
    with pytest.raises(DataError):  # the sandbox is immutable
        ChatTemplate("{{ messages.append(1) }}", "inline", {}).render(messages)


def _error(callable_, *args, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        callable_(*args, **kwargs)
    return str(info.value)


def test_record_errors_word_for_word(encoders):
    encode = encoders["gemma3"].encode
    assert _error(encode, {"text": "x", "id": 1}) == (
        "a chat record needs 'messages', or 'prompt' and 'completion'; this one has keys 'text', 'id'"
    )
    assert _error(encode, {"prompt": "x"}) == (
        "a chat record needs 'messages', or 'prompt' and 'completion'; this one has keys 'prompt'"
    )
    assert _error(encode, ["x"]) == (
        "a chat record needs 'messages', or 'prompt' and 'completion'; this one is a list"
    )
    assert _error(encode, {"messages": [USER, ASSISTANT], "prompt": "x", "completion": "y"}) == (
        "a chat record has 'messages' and 'prompt' and 'completion', so which one to train on is "
        "ambiguous; keep 'messages' or 'prompt' and 'completion', not both"
    )
    assert _error(encode, {"messages": []}) == (
        "'messages' must be a non-empty list of messages {role, content}, not an empty list"
    )
    assert _error(encode, {"messages": "hi"}) == (
        "'messages' must be a non-empty list of messages {role, content}, not a str"
    )
    assert _error(encode, {"messages": [USER, "hi"]}) == (
        "messages[1] must be a message {role, content}, not a str"
    )
    assert _error(encode, {"messages": [{"content": "x"}]}) == (
        "messages[0] has no 'role'; a message is {role, content}"
    )
    tool = {"role": "tool", "content": "42"}
    assert _error(encode, {"messages": [USER, tool]}) == (
        "messages[1] has role 'tool'; the roles are system, user, assistant"
    )
    parts = {"role": "user", "content": [{"type": "text", "text": "x"}]}
    assert _error(encode, {"messages": [parts]}) == (
        "messages[0] has content of type list; content must be a string"
    )
    assert _error(encode, {"prompt": [USER], "completion": [{"role": "bot", "content": "x"}]}) == (
        "completion[0] has role 'bot'; the roles are system, user, assistant"
    )
    assert _error(encode, {"prompt": "x", "completion": [ASSISTANT]}) == (
        "'prompt' and 'completion' must both be strings or both lists of messages, not str and list"
    )
    assert _error(encode, {"messages": [USER]}) == (
        "nothing to train in this record: the conversation has no assistant turn (train_on=assistant)"
    )
    assert _error(encode, {"prompt": [USER, ASSISTANT], "completion": [USER]}) == (
        "nothing to train in this record: the completion has no assistant turn (train_on=completion)"
    )
    template = FIXTURES / "gemma3" / "tokenizer_config.json"
    assert _error(encode, {"messages": [USER, USER]}) == (
        f"the chat template {template} cannot render this conversation: "
        "Conversation roles must alternate user/assistant/user/assistant/..."
    )


def test_template_errors_word_for_word(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(FIXTURES / "gemma3" / "tokenizer.json", bare / "tokenizer.json")
    assert _error(load_chat_template, str(bare / "tokenizer.json")) == (
        f"data.tokenizer={str(bare / 'tokenizer.json')!r} has no chat template; set "
        "data.chat_template=PATH to a .jinja file"
    )
    (bare / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "rag", "template": "R"},
                    {"name": "tool_use", "template": "T"},
                ]
            }
        )
    )
    assert _error(load_chat_template, str(bare)) == (
        f"data.tokenizer={str(bare)!r} has chat templates named rag, tool_use but none named "
        "default; set data.chat_template=PATH to a .jinja file"
    )
    assert _error(load_chat_template, str(bare), str(tmp_path / "missing.jinja")) == (
        f"data.chat_template={str(tmp_path / 'missing.jinja')!r} is not a file"
    )
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }\n")
    assert _error(load_chat_template, str(bare), str(broken)) == (
        f"the chat template {broken} is not valid Jinja: unexpected '}}' (line 2)"
    )
    undefined = tmp_path / "undefined.jinja"
    undefined.write_text("{{ messages[3].content.strip() }}")
    encoder_error = _error(build_chat_encoder, str(FIXTURES / "gemma3"), str(undefined))
    assert encoder_error == (
        f"the chat template {undefined} cannot render a user and an assistant turn: "
        "list object has no element 3"
    )
    assert _error(load_chat_template, "byte") == (
        "data.tokenizer=byte has no chat template; chat data needs a Hugging Face tokenizer"
    )
    model = train_sentencepiece(tmp_path / "sp")
    (tmp_path / "sp" / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert _error(build_chat_encoder, str(model)) == (
        f"data.tokenizer={str(model)!r}: chat data needs a Hugging Face tokenizer.json"
    )
    with pytest.raises(ConfigError) as info:
        build_chat_encoder(str(FIXTURES / "gemma3"), train_on="prompt")
    assert str(info.value) == "train_on='prompt' is not one of assistant, completion, all"


def test_the_tokenizer_gives_offsets():
    tokenizer = build_tokenizer(str(FIXTURES / "llama3"))
    ids, offsets = tokenizer.encode_with_offsets("Hi 🙂<|eot_id|>")
    assert ids.dtype == np.int32 and offsets.shape == (len(ids), 2)
    assert offsets[-1].tolist() == [4, 14] and ids[-1] == 404
    with_bos, bos_offsets = tokenizer.encode_with_offsets("Hi", add_special_tokens=True)
    assert with_bos[0] == 400 and bos_offsets[0].tolist() == [0, 0]


# --- the live comparison with transformers (the parity extra) --------------------------------


@pytest.fixture(scope="module")
def auto_tokenizer():
    """transformers' AutoTokenizer, imported when a slow test here runs (the default tests
    import no transformers)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained


MORE = [
    [
        {"role": "system", "content": "Be brief."},
        USER,
        ASSISTANT,
        {"role": "user", "content": "Twice?"},
        {"role": "assistant", "content": "Hello! Hello!"},
    ],
    [USER, {"role": "assistant", "content": "  \n"}],
    [USER, {"role": "assistant", "content": "Ça va — très bien 😀", "reasoning_content": "polite"}],
]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_fixtures_are_what_transformers_computes(family, auto_tokenizer):
    tokenizer = auto_tokenizer(FIXTURES / family)
    kwargs = EXPECTED[family]["template_kwargs"]
    for case in EXPECTED[family]["conversations"].values():
        messages = case["messages"]
        assert tokenizer.apply_chat_template(messages, tokenize=False, **kwargs) == case["text"]
        assert tokenizer.apply_chat_template(messages, return_dict=False, **kwargs) == case["ids"]
    assert load_chat_template(str(FIXTURES / family)).special_tokens == tokenizer.special_tokens_map


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_our_ids_are_transformers_ids(family, auto_tokenizer):
    """More conversations, with and without the generation prompt; Llama's template writing
    today's date (no date_string) and Qwen's without thinking."""
    tokenizer = auto_tokenizer(FIXTURES / family)
    settings = [{}, {"enable_thinking": False}] if family == "qwen3" else [{}]
    conversations = [c["messages"] for c in EXPECTED[family]["conversations"].values()] + MORE
    for kwargs in settings:
        encoder = build_chat_encoder(str(FIXTURES / family), template_kwargs=kwargs)
        for messages in conversations:
            ours = encoder.encode({"messages": messages}).ids.tolist()
            assert ours == tokenizer.apply_chat_template(messages, return_dict=False, **kwargs)
            prompt = messages[:-1]
            expected = tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, return_dict=False, **kwargs
            )
            assert encoder.render_generation_prompt(prompt).ids.tolist() == expected


@pytest.mark.slow
def test_helpers_render_as_in_transformers(auto_tokenizer, tmp_path):
    """The sandbox helpers and the special tokens a config names, rendered by both."""
    shutil.copy(FIXTURES / "gemma3" / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((FIXTURES / "gemma3" / "tokenizer_config.json").read_text())
    config["image_token"] = "<img>"
    config["chat_template"] = (
        "{{ bos_token }}{{ image_token }}{% for m in messages %}{{ m | tojson }}"
        "{{ m.content | tojson(indent=1) }}{% if loop.last %}{% break %}{% endif %}{% endfor %}"
        "{% set ns = namespace(a=1) %}{{ ns.a }}{{ dict(b=2) | tojson }}"
        "{% generation %}{{ eos_token }}{% endgeneration %}{{ raise_exception is defined }}\n"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": '<b>"é"</b>'}, ASSISTANT]
    theirs = auto_tokenizer(tmp_path).apply_chat_template(messages, tokenize=False)
    assert build_chat_encoder(str(tmp_path)).render(messages) == theirs


@pytest.mark.parametrize("family", FAMILIES)
def test_a_continued_final_message_ends_where_its_content_does(family):
    # transformers' continue_final_message: the chat rendered whole, cut right after the last
    # message's content (no end of turn); a template that trims it (Gemma's | trim) included.
    template = load_chat_template(str(FIXTURES / family))
    kwargs = EXPECTED[family]["template_kwargs"]
    whole = template.render([USER, ASSISTANT], **kwargs)
    continued = template.render([USER, ASSISTANT], continue_final_message=True, **kwargs)
    assert continued == whole[: whole.rindex("Hello!") + len("Hello!")]
    assert (
        continued.endswith("Hello!") and CLOSE[family] not in continued[-len(CLOSE[family]) - 8 :]
    )
    spaced = template.render(
        [USER, {"role": "assistant", "content": "Hello!  "}], continue_final_message=True, **kwargs
    )  # trailing spaces: kept where the template keeps them (Gemma's and Llama's trim them)
    assert spaced == continued + ("  " if family == "qwen3" else "")
