"""config.json's mixture-of-experts keys (meshtrain.families.experts): read as each family's
checkpoints write them, and a router or layout meshtrain's block cannot compute refused in one
line before anything is built."""

import pytest

from meshtrain.errors import ConfigError
from meshtrain.families.experts import moe_from_hf

QWEN3_MOE = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}


def _read(**text):
    return moe_from_hf(
        {**QWEN3_MOE, "norm_topk_prob": True, **text},
        "c/config.json",
        expert_dim_key="moe_intermediate_size",
        normalize_top_k="norm_topk_prob",
    )["moe"]


def test_the_published_keys_and_transformers_5s_name_for_the_experts():
    assert _read() == dict(num_experts=128, top_k=8, expert_dim=768, normalize_top_k=True)
    # transformers 5 writes num_local_experts; a config class default under num_experts stays
    assert _read(num_local_experts=8)["num_experts"] == 8


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("mlp_only_layers", [0, 3]),
        ("decoder_sparse_step", 2),
        ("router_jitter_noise", 0.01),
        ("shared_expert_intermediate_size", 2048),
        ("scoring_func", "sigmoid"),
        ("topk_method", "noaux_tc"),
    ],
)
def test_what_the_block_cannot_compute_is_refused_in_one_line(key, value):
    with pytest.raises(ConfigError) as error:
        _read(**{key: value})
    message = str(error.value)
    assert message.startswith(f"c/config.json: {key}={value!r} is not supported")
    assert "\n" not in message
