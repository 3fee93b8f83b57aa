"""A LoRA run out of the loop: generation with the adapters unmerged, the PEFT export read back
as model.lora.init_from (bit for bit), the merged export holding W + alpha/r·A·B, and the one
line for each export or adapter that cannot be."""

import json

import jax
import numpy as np
import pytest
from helpers import tiny_hf
from helpers.config import compose_config
from helpers.paths import REPO
from helpers.runs import train_tiny
from helpers.tiny_hf import TOKENS
from helpers.tiny_tokenizers import train_bpe
from safetensors.numpy import load_file

import meshtrain
from meshtrain.checkpoint import named_leaves, read_params
from meshtrain.errors import ConfigError
from meshtrain.hf.peft import check_peft, load_peft, quantised_base_note
from meshtrain.inference.export import ExportError, export
from meshtrain.train.setup import prepare
from meshtrain.weights.load import load_safetensors_export

LORA = ("model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q,v,o,down]")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """Two steps of LoRA on a tiny Hugging Face Llama (with its tokenizer) and the exports."""
    root = tmp_path_factory.mktemp("lora")
    base = tiny_hf.write_checkpoint("llama", root / "base")
    train_bpe(base, vocab_size=tiny_hf.VOCAB)
    train_tiny(
        root / "run",
        *tiny_hf.overrides("llama", base),
        "data=synthetic",
        f"data.seq_len={tiny_hf.SEQ_LEN}",
        "model.mesh_shape=[[1,1],[fsdp,tp]]",
        "training.steps=2",
        "training.learning_rate=0.02",
        "training.warmup_steps=1",
        "training.eval_every=0",
        f"data.tokenizer={base}/tokenizer.json",
        *LORA,
        devices=1,
    )
    export(root / "run", root / "adapter", "peft")
    export(root / "run", root / "merged", "safetensors", merge=True)
    export(root / "run", root / "merged_orbax", "orbax", merge=True)
    return root


def _config(root, *extra):
    return compose_config(
        *tiny_hf.overrides("llama", root / "base"),
        "data=synthetic",
        "model.mesh_shape=[[1,1],[fsdp,tp]]",
        *LORA,
        f"model.lora.init_from=peft:{root / 'adapter'}",
        *extra,
    )


@pytest.mark.slow
def test_the_peft_export_reads_back_bit_for_bit(lora_run):
    saved = named_leaves(read_params(lora_run / "run" / "checkpoints" / "2")[0])
    config = json.loads((lora_run / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == ["q_proj", "v_proj", "o_proj", "down_proj"]
    tensors = load_file(lora_run / "adapter" / "adapter_model.safetensors")
    q_a = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    np.testing.assert_array_equal(q_a, saved["blocks.1.attn.q_lora_a"].T)  # [r, in]
    assert tensors["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"].shape == (
        4,
        64,
    )
    cfg = _config(lora_run)
    check_peft(cfg.model)
    setup = prepare(cfg, jax.devices()[:1], with_data=False)
    adapters = load_peft(cfg.model, setup.model.trainable_params, setup.model.trainable_shardings)
    loaded = named_leaves(jax.device_get(adapters))
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)


@pytest.mark.slow
def test_a_peft_export_of_qlora_adapters_says_they_fit_the_quantised_base(lora_run):
    assert not (lora_run / "adapter" / "README.md").exists()  # a full-precision base: nothing
    assert quantised_base_note(_config(lora_run).model) is None
    cfg = _config(lora_run, "model.lora.base_dtype=nf4", "model.lora.quant_block=16")
    assert quantised_base_note(cfg.model) == (
        "these adapters were trained on the base quantised to nf4 (blocks of 16): on the "
        "full-precision base, as peft loads them by default, the model computes other logits; "
        "for meshtrain's numbers export with --merge (the base dequantised as the run computed "
        "it, plus the adapters), or load the base quantised the same way"
    )


def test_generate_and_eval_name_what_runs_instead_of_a_peft_export(lora_run, capsys):
    from meshtrain.cli.generate import main as generate_main
    from meshtrain.weights.load import load_model, load_tokenizer

    message = (
        f"{lora_run / 'adapter'} holds LoRA adapters alone (a PEFT export), not a model; run the "
        "LoRA run directory they were exported from, or a merged export (python -m "
        "meshtrain.export RUN_DIR OUT --format hf --merge)"
    )
    for load in (load_model, load_tokenizer):  # meshtrain-eval's model reads both
        with pytest.raises(ConfigError) as err:
            load(lora_run / "adapter")
        assert str(err.value) == message
    with pytest.raises(SystemExit) as exited:
        generate_main([str(lora_run / "adapter"), "hello"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == f"meshtrain: error: {message}"


def _copied_adapter(lora_run, tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for file in (lora_run / "adapter").iterdir():
        (adapter / file.name).write_bytes(file.read_bytes())
    return adapter


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("layers_to_transform", [0]),
        ("layers_pattern", "layers"),
        ("rank_pattern", {"q_proj": 8}),
        ("alpha_pattern", {"v_proj": 4}),
        ("modules_to_save", ["lm_head"]),
    ],
)
def test_adapter_settings_meshtrain_cannot_follow_are_refused(lora_run, tmp_path, setting, value):
    adapter = _copied_adapter(lora_run, tmp_path)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, setting: value}))
    cfg = _config(lora_run, f"model.lora.init_from=peft:{adapter}")
    with pytest.raises(ConfigError) as err:
        check_peft(cfg.model)
    assert str(err.value) == (
        f"model.lora.init_from='peft:{adapter}': its adapter_config.json sets "
        f"{setting}={json.dumps(value)}, which meshtrain's adapters cannot follow (the same rank, "
        "alpha and targets on every layer, no fully trained modules); merge the adapter into its "
        "base with peft (merge_and_unload) and start from that with model.init_from=hf:DIR"
    )


def test_a_tensor_no_adapter_reads_is_refused(lora_run, tmp_path):
    from safetensors.numpy import save_file

    adapter = _copied_adapter(lora_run, tmp_path)
    tensors = load_file(adapter / "adapter_model.safetensors")
    extra = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    save_file(
        {**tensors, extra: np.zeros((4, 64), np.float32)}, adapter / "adapter_model.safetensors"
    )
    cfg = _config(lora_run, f"model.lora.init_from=peft:{adapter}")
    with pytest.raises(ConfigError) as err:
        check_peft(cfg.model)
    assert str(err.value) == (
        f"model.lora.init_from='peft:{adapter}': adapter_model.safetensors holds 1 tensor(s) no "
        f"adapter of this config reads (e.g. {extra}); it was saved with other targets or settings"
    )


@pytest.mark.parametrize("damage", ["truncated", "header byte", "other bytes"])
def test_a_damaged_adapter_file_is_one_line(lora_run, tmp_path, damage):
    adapter = _copied_adapter(lora_run, tmp_path)
    weights = adapter / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "header byte":
        data[10] ^= 0xFF
    else:
        data = bytearray(np.random.default_rng(0).integers(0, 256, 4096, np.uint8).tobytes())
    weights.write_bytes(bytes(data))
    cfg = _config(lora_run)
    cfg.model.lora.init_from = f"peft:{adapter}"
    with pytest.raises(ConfigError) as err:
        check_peft(cfg.model)
    message = str(err.value)
    assert message.startswith(f"{weights} is not a readable safetensors file (")
    assert message.endswith("); copy or export it again") and "\n" not in message


def test_the_merged_export_holds_each_weight_plus_its_adapter(lora_run):
    saved = named_leaves(read_params(lora_run / "run" / "checkpoints" / "2")[0])
    merged = load_file(lora_run / "merged" / "model.safetensors")
    base = load_file(lora_run / "base" / "model.safetensors")
    w = base["model.layers.1.mlp.down_proj.weight"].T  # ours: [F, D]
    a, b = saved["blocks.1.mlp.down_lora_a"], saved["blocks.1.mlp.down_lora_b"]
    np.testing.assert_allclose(merged["blocks.1.mlp.down"], w + 2.0 * a @ b, rtol=1e-6, atol=1e-7)
    assert not [name for name in merged if "_lora_" in name]
    config = json.loads((lora_run / "merged" / "config.json").read_text())
    assert config["model"]["lora"]["rank"] == 0  # a plain model
    ours = np.asarray(meshtrain.load_checkpoint(lora_run / "run")(TOKENS))
    plain = np.asarray(load_safetensors_export(lora_run / "merged")(TOKENS))
    assert tiny_hf.relative_error(plain, ours) <= 1e-5


@pytest.mark.slow
def test_generation_runs_with_the_adapters_unmerged(lora_run):
    model = meshtrain.load_checkpoint(lora_run / "run")
    merged = load_safetensors_export(lora_run / "merged")
    tokenizer = meshtrain.build_tokenizer(str(lora_run / "base"))
    # tiny_hf.NEW_TOKENS, as tests/inference/test_generate.py generates from the same
    # architecture and tokenizer: a test run compiles the merged model's programs once.
    new_tokens = tiny_hf.NEW_TOKENS
    ours = meshtrain.generate(model, tokenizer, tiny_hf.PROMPT, max_new_tokens=new_tokens)
    assert ours == meshtrain.generate(merged, tokenizer, tiny_hf.PROMPT, max_new_tokens=new_tokens)
    assert model.blocks[0].attn.q_lora_a is not None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ("model.lora.rank=8",),
            "the adapter has rank 4 but model.lora.rank is 8; set model.lora.rank=4",
        ),
        (
            ("model.lora.targets=[q,v]",),
            "the adapter has targets ['q', 'v', 'o', 'down'] but model.lora.targets is ['q', "
            "'v']; set model.lora.targets=[q,v,o,down]",
        ),
        (
            ("model.d_model=32", "model.num_heads=2", "model.mlp_dim=64"),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight is (4, 64), "
            "the model (llama3_8b) needs [4, 32]; the adapter was trained on another "
            "architecture or size",
        ),
    ],
)
def test_an_adapter_that_does_not_fit_is_one_line(lora_run, extra, message):
    with pytest.raises(ConfigError) as err:
        check_peft(_config(lora_run, *extra).model)
    assert str(err.value) == f"model.lora.init_from='peft:{lora_run / 'adapter'}': {message}"
    if "targets" not in message:  # the others are listed in docs/finetuning.md
        line = f"meshtrain: error: model.lora.init_from='peft:/adapters/a': {message}\n"
        assert line in (REPO / "docs" / "finetuning.md").read_text()


def test_exports_that_cannot_be_are_one_line(lora_run, tmp_path):
    with pytest.raises(ExportError, match="holds LoRA adapters only; add --merge"):
        export(lora_run / "run", tmp_path / "a", "hf")
    with pytest.raises(ExportError, match="--format peft writes the adapters alone; drop --merge"):
        export(lora_run / "run", tmp_path / "b", "peft", merge=True)
    with pytest.raises(ExportError, match="holds no LoRA adapters"):
        export(lora_run / "merged_orbax", tmp_path / "c", "peft")
