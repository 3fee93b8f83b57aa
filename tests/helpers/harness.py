"""What the harness tests share: the local task YAMLs (examples/eval_tasks) and a tiny random
Hugging Face Llama (helpers.tiny_hf) with a BPE tokenizer transformers reads too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from helpers import tiny_hf
from helpers.paths import REPO
from helpers.tiny_tokenizers import train_bpe

EXAMPLE_TASKS = REPO / "examples" / "eval_tasks"
TASKS = ("meshtrain_choice", "meshtrain_perplexity", "meshtrain_generate")
MAX_LENGTH = 256  # the tiny checkpoints' max_position_embeddings
# The metrics each local task reports (examples/eval_tasks/*.yaml).
METRICS = {
    "meshtrain_choice": {"acc", "acc_norm"},
    "meshtrain_perplexity": {"word_perplexity", "byte_perplexity", "bits_per_byte"},
    "meshtrain_generate": {"exact_match"},
}
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
}


def write_tiny_llama(directory: Path, *, bos: bool = True) -> Path:
    """helpers.tiny_hf's Llama checkpoint with train_bpe's 512-token tokenizer in `directory`.
    With `bos`, its tokenizer.json starts every text with <bos> (a post-processor, as Llama 3's
    and Gemma's do): transformers' tokenizer then adds it, as meshtrain's model does by default."""
    tiny_hf.write_checkpoint("llama", directory)
    path = train_bpe(directory, vocab_size=tiny_hf.VOCAB, config=TOKENIZER_CONFIG)
    if bos:
        spec = json.loads(path.read_text())
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<bos>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": "<bos>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {"<bos>": {"id": "<bos>", "ids": [1], "tokens": ["<bos>"]}},
        }
        path.write_text(json.dumps(spec))
    return directory


def write_broken_task(directory: Path, *, yaml_error: bool = False) -> Path:
    """examples/eval_tasks/meshtrain_choice.yaml as task meshtrain_broken in `directory` (new),
    its template naming a missing field ({{questoin}}), or with `yaml_error` a line that does
    not parse, with the example's data beside it."""
    directory.mkdir()
    task = (EXAMPLE_TASKS / "meshtrain_choice.yaml").read_text()
    assert "{{question}}" in task
    task = task.replace("{{question}}", "{{questoin}}").replace(
        "task: meshtrain_choice", "task: meshtrain_broken"
    )
    if yaml_error:
        task += "metadata: [unclosed\n"
    (directory / "meshtrain_broken.yaml").write_text(task)
    shutil.copy(EXAMPLE_TASKS / "local_data.py", directory / "local_data.py")
    shutil.copytree(EXAMPLE_TASKS / "data", directory / "data")
    return directory
