"""Writes a small Hugging Face checkpoint for trying the fine-tuning workflow without downloads.

A randomly initialised model of the `tiny` config (a Llama-architecture model), exported with
`meshtrain.export_hf`, with a byte-level BPE tokenizer of 384 tokens trained on part of the Python
standard library. transformers' AutoModelForCausalLM and AutoTokenizer load it like any
published checkpoint.

    python scripts/docs/make_demo_checkpoint.py /tmp/meshtrain-demo/hf
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from meshtrain.config import ModelConfig
from meshtrain.data.sources import list_documents
from meshtrain.hf.save import export_hf
from meshtrain.models.transformer import Transformer

SPECIALS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}


def train_tokenizer(directory: Path, vocab_size: int, *, bos: bool = False) -> Path:
    """A byte-level BPE tokenizer.json (and its tokenizer_config.json) in `directory`, with
    <pad>, <bos>, <eos> as ids 0, 1, 2. With `bos` it starts every text with <bos> (a
    post-processor, as Llama 3's and Gemma's do)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A $B:1", special_tokens=[("<bos>", 1)]
        )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = list_documents(None, "**/*.py")[:100]
    tokenizer.train_from_iterator((f.read_text(errors="replace") for f in files), trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **SPECIALS}, indent=2) + "\n"
    )
    return directory / "tokenizer.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="new directory for the checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg = ModelConfig()  # the tiny model: vocab 384, d_model 128, 2 layers
    params = nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(args.seed)), nnx.Param))
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = train_tokenizer(Path(scratch), cfg.vocab_size)
        out = export_hf(params, cfg, args.out_dir, tokenizer)
    print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")


if __name__ == "__main__":
    main()
