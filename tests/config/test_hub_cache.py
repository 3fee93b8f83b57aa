"""A Hugging Face id where a directory is expected: its snapshot in the local cache, as
huggingface_hub lays it out, or one line that says where it looked (nothing is downloaded in
the tests: HF_HUB_OFFLINE=1, tests/conftest.py)."""

import jax
import pytest
from helpers import tiny_hf
from helpers.config import compose_config
from helpers.tiny_tokenizers import train_bpe

from meshtrain.config.hub_cache import cached_snapshot, hub_cache, is_hub_id
from meshtrain.config.locations import with_absolute_paths
from meshtrain.errors import ConfigError
from meshtrain.train.loop import train

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache(root, repo_id, *, ref=True):
    """huggingface_hub's layout of one model: refs/main, snapshots/<commit>/."""
    model = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = model / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    if ref:
        (model / "refs").mkdir()
        (model / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_the_cache_is_where_huggingface_hub_keeps_it(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub_cache() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hub_cache() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_cache() == tmp_path / "hub"


def test_a_snapshot_is_found_by_its_ref_or_alone(tmp_path):
    snapshot = _cache(tmp_path, "Qwen/Qwen3-0.6B")
    assert cached_snapshot("Qwen/Qwen3-0.6B", tmp_path) == snapshot
    alone = _cache(tmp_path, "org/no-ref", ref=False)
    assert cached_snapshot("org/no-ref", tmp_path) == alone
    assert cached_snapshot("org/missing", tmp_path) is None
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("google/gemma-3-1b-it")
    assert not is_hub_id("byte") and not is_hub_id("/abs/path") and not is_hub_id("a/b/c")
    assert not is_hub_id("tests/fixtures")  # a relative path that exists


@pytest.mark.slow
def test_a_run_starts_from_a_cached_id_and_records_its_snapshot(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _cache(tmp_path / "hub", "meshtrain/tiny-llama")
    tiny_hf.write_checkpoint("llama", snapshot)
    train_bpe(snapshot, vocab_size=tiny_hf.VOCAB)
    cfg = tiny_hf.run_config(
        "llama",
        "meshtrain/tiny-llama",  # model.init_from=hf:meshtrain/tiny-llama
        *tiny_hf.STEP_ONE,
        f"training.micro_batch_size={tiny_hf.STEP_ONE_BATCH}",
    )
    resolved = with_absolute_paths(cfg)
    assert resolved.model.init_from == f"hf:{snapshot}"
    tokenizer = with_absolute_paths(compose_config("data.tokenizer=meshtrain/tiny-llama"))
    assert tokenizer.data.tokenizer == str(snapshot)
    # The run reads the snapshot's weights (its step-1 loss is the directory's) and records it.
    by_id = train(cfg, tmp_path / "by_id", devices=jax.devices()[:1])
    direct = tiny_hf.run_config(
        "llama", snapshot, *tiny_hf.STEP_ONE, f"training.micro_batch_size={tiny_hf.STEP_ONE_BATCH}"
    )
    by_path = train(direct, tmp_path / "by_path", devices=jax.devices()[:1])
    assert by_id.history[0]["loss"] == by_path.history[0]["loss"]
    assert by_id.setup.cfg.model.init_from == f"hf:{snapshot}"


def test_an_id_not_in_the_cache_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = compose_config("model.init_from=hf:Qwen/Qwen3-0.6B")
    with pytest.raises(ConfigError) as err:
        with_absolute_paths(cfg)
    assert str(err.value) == (
        f"model.init_from='Qwen/Qwen3-0.6B' is neither a local path nor in the Hugging Face "
        f"cache ({tmp_path / 'hub'}), and HF_HUB_OFFLINE is set; download it where the network "
        "reaches the Hub (huggingface-cli download Qwen/Qwen3-0.6B) or give its local directory"
    )
