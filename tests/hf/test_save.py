"""generation_config.json of a Hugging Face export: eos as a chat checkpoint lists it."""

import pytest
from helpers.paths import REPO

from meshtrain.hf.save import generation_config

CHAT = REPO / "tests" / "fixtures" / "chat"


@pytest.mark.parametrize(
    ("family", "special", "eos"),
    [
        # Gemma 3 ends a turn with <end_of_turn> (5), not its eos (1): both stop a generation.
        ("gemma3", {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}, [1, 5]),
        # Llama 3's and Qwen 3's eos in these tokenizers is the end-of-turn token itself.
        ("llama3", {"bos_token_id": 400, "eos_token_id": 404}, 404),
        ("qwen3", {"eos_token_id": 402, "pad_token_id": 400}, 402),
    ],
)
def test_eos_lists_the_end_of_turn_token_of_a_chat_template(family, special, eos):
    assert generation_config(special, CHAT / family) == {**special, "eos_token_id": eos}


def test_without_a_chat_template_the_ids_are_the_tokenizers(tmp_path):
    special = {"bos_token_id": 256, "eos_token_id": 257}
    assert generation_config(special, tmp_path) == special
