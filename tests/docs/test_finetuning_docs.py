"""docs/finetuning.md: its commands run in order as written, and every bad-input line it lists
is the line meshtrain prints, word for word."""

import json
import shutil

import pytest
from helpers.config import compose_config
from helpers.docs import fenced_blocks, run_walkthrough_line, walkthrough_checkout
from helpers.paths import REPO

from meshtrain.checkpoint import committed_steps
from meshtrain.config.validate import check_config
from meshtrain.data import build_dataset
from meshtrain.errors import ConfigError

DOC = REPO / "docs" / "finetuning.md"
GEMMA = REPO / "tests" / "fixtures" / "chat" / "gemma3"


def runnable_lines() -> list[str]:
    blocks = [b for b in fenced_blocks(DOC.read_text()) if b.lang == "bash"]
    return [line.strip() for b in blocks for line in b.lines if line.startswith("python ")]


@pytest.mark.slow  # about 90 s: 600 + 100 + 60 + 20 steps, 3 generations, 4 exports, a prepare
def test_finetuning_doc_commands_run_in_order(tmp_path):
    walkthrough_checkout(tmp_path)
    outputs = []
    for line in runnable_lines():
        result = run_walkthrough_line(line, tmp_path, timeout=600)
        outputs.append(result.stdout + result.stderr)
    assert len(outputs) == 11
    out = tmp_path / "outputs"
    log = (out / "chat" / "train.log").read_text()
    assert "data: 230 training sequences (chat; document masking on)" in log
    assert committed_steps(out / "chat" / "checkpoints") == [400, 500, 600]  # keep=3
    answers = [outputs[1].strip().splitlines()[-1], outputs[3].strip().splitlines()[-1]]
    assert answers[0] == answers[1] and answers[0].isdigit()  # the export answers the same
    assert "chat_template" in json.loads((out / "chat_hf" / "tokenizer_config.json").read_text())
    losses = [json.loads(x)["loss"] for x in (out / "chat_more" / "metrics.jsonl").open()]
    assert losses[0] < 2.0  # from the fine-tuned weights, not from scratch (about 6.2)
    # QLoRA on the export: the adapters train, the answer is a number, the exports load.
    log = (out / "chat_qlora" / "train.log").read_text()
    lora_line = next(line for line in log.splitlines() if "LoRA: rank 8" in line)
    assert lora_line.split("setup: ", 1)[1] in DOC.read_text().replace("\n", " ")
    assert outputs[6].strip().splitlines()[-1].isdigit()
    adapter = json.loads((out / "chat_qlora_peft" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (8, 16)
    assert (out / "chat_qlora_merged" / "model.safetensors").is_file()
    assert json.loads((out / "chat_prepared" / "manifest.json").read_text())["chat"] is not None
    assert committed_steps(out / "chat_from_prepared" / "checkpoints") == [20]


def _documented_errors() -> set[str]:
    blocks = [b for b in fenced_blocks(DOC.read_text()) if b.lang == "text"]
    return {line for b in blocks for line in b.lines if line.startswith("meshtrain: error: ")}


def _error(tmp_path, *overrides) -> str:
    cfg = compose_config(
        "data=chat",
        "model.vocab_size=512",
        "data.cache_dir=null",
        "data.validation_fraction=0",
        *overrides,
    )
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
        build_dataset(cfg.data, split="train", vocab_size=512)
    return f"meshtrain: error: {err.value}".replace(str(tmp_path), "/data")


def test_every_bad_input_line_is_documented_word_for_word(tmp_path):
    chats, tokenizer = tmp_path / "chats.jsonl", f"data.tokenizer={GEMMA}"
    good = {
        "messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    }

    def record(second):
        chats.write_text(json.dumps(good) + "\n" + json.dumps(second) + "\n")
        return _error(tmp_path, f"data.paths=[{chats}]", tokenizer)

    chats.write_text(json.dumps(good) + "\n")
    shutil.copy(GEMMA / "tokenizer.json", tmp_path / "tokenizer.json")  # without its template
    (tmp_path / "broken.jinja").write_text("{{ messages }")
    (tmp_path / "doc.txt").write_text("plain")
    lines = [
        _error(tmp_path, tokenizer),
        _error(tmp_path, f"data.paths=[{chats}]", "data.tokenizer=byte"),
        _error(tmp_path, f"data.paths=[{chats}]", f"data.tokenizer={tmp_path / 'tokenizer.json'}"),
        _error(
            tmp_path,
            f"data.paths=[{chats}]",
            tokenizer,
            f"data.chat_template={tmp_path / 'missing.jinja'}",
        ),
        _error(
            tmp_path,
            f"data.paths=[{chats}]",
            tokenizer,
            f"data.chat_template={tmp_path / 'broken.jinja'}",
        ),
        _error(tmp_path, f"data.paths=[{chats}]", tokenizer, "data.train_on=prompt"),
        record({"text": "x"}),
        record({"messages": [{"role": "bot", "content": "hi"}]}),
        record(
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": ["b"]},
                ]
            }
        ),
        record({"messages": [{"role": "user", "content": "a"}]}),
        record(
            {
                "messages": [
                    {"role": "assistant", "content": "a"},
                    {"role": "assistant", "content": "b"},
                ]
            }
        ),
        _error(tmp_path, f"data.paths=[{tmp_path / 'doc.txt'}]", tokenizer),
    ]
    documented = _documented_errors()
    for line in lines:
        line = line.replace(str(GEMMA), "/data")
        assert line in documented, line
