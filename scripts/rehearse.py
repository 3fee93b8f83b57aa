"""A rehearsal at a published size on faked CPU devices: a random-weight Hugging Face checkpoint
of MODEL (transformers' own `from_config` + `save_pretrained`, nothing downloaded), loaded on
MESH, compared with transformers, trained, exported and read back by transformers.

    python scripts/rehearse.py gemma3_270m '[[4,2],["fsdp","tp"]]' [--tokens 600] [--steps 2]

MODEL is a config of configs/model/ (its published config.json is tests/hf_configs/MODEL.json);
MESH is a model.mesh_shape over --devices faked CPU devices (8). Steps, each timed:

1. build: transformers builds the model from its published config (random weights, fp32) and
   saves it with save_pretrained;
2. logits: `meshtrain.load_hf(checkpoint, MESH)` on --tokens tokens (past Gemma's 512-token
   window by default) against transformers' logits of the same tokens (eager attention);
3. train: --steps training steps from `model.init_from=hf:<checkpoint>` on MESH (synthetic data,
   one sequence of --train-tokens per batch shard, `model.scan_layers=true` unless --train-set
   says otherwise), losses finite;
4. export: the trained parameters (with --steps 0, the loaded ones: for a model whose training
   state does not fit in host memory) exported as a Hugging Face checkpoint, loaded by
   transformers, whose logits must equal meshtrain's of the same parameters.

Prints one line per step and, with --json, one JSON object with the errors, the losses, the
seconds of each step and the peak resident memory. Needs the `parity` extra (torch, transformers).
Exit code 1 if a check fails. The numbers of docs/models.md come from here.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rss_gib() -> float:
    """Peak resident memory of this process so far, GiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a config of configs/model/, e.g. gemma3_270m")
    parser.add_argument("mesh", help='a model.mesh_shape, e.g. \'[[4,2],["fsdp","tp"]]\'')
    parser.add_argument("--devices", type=int, default=8, help="faked CPU devices (8)")
    parser.add_argument("--tokens", type=int, default=600, help="tokens of the logit check")
    parser.add_argument(
        "--steps", type=int, default=2, help="training steps (2; 0 exports the loaded weights)"
    )
    parser.add_argument("--train-tokens", type=int, default=128, help="data.seq_len (128)")
    parser.add_argument(
        "--train-set",
        action="append",
        help="an override of the training run (repeatable; default model.scan_layers=true: one "
        "layer's gathered weights at a time, so that 8 faked devices fit in host memory)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object at the end")
    args = parser.parse_args(argv)
    published = REPO / "tests" / "hf_configs" / f"{args.model}.json"
    if not published.is_file():
        names = sorted(p.stem for p in published.parent.glob("*.json"))
        print(f"rehearse: error: no published config {published}; use one of {', '.join(names)}")
        return 2

    from meshtrain.distributed.devices import use_fake_cpu_devices

    use_fake_cpu_devices(args.devices)  # before JAX starts: with long collective timeouts
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx
    from transformers import AutoConfig, AutoModelForCausalLM

    import meshtrain
    from meshtrain.config.hydra import compose_config
    from meshtrain.hf.parity import LOGIT_TOLERANCE, relative_error  # the tests' logit bound
    from meshtrain.hf.save import export_hf
    from meshtrain.models.abstract import merge_model
    from meshtrain.train.loop import train
    from meshtrain.weights.load import hf_model_config

    mesh = json.loads(args.mesh)
    report: dict = {"model": args.model, "mesh": mesh, "devices": args.devices, "seconds": {}}
    failures = []

    def step(name: str, start: float, line: str) -> None:
        report["seconds"][name] = round(time.perf_counter() - start, 1)
        print(f"{name}: {line} ({report['seconds'][name]} s, peak RSS {_rss_gib():.2f} GiB)")
        sys.stdout.flush()

    with tempfile.TemporaryDirectory(prefix="meshtrain-rehearse-") as workdir:
        work = Path(workdir)
        start = time.perf_counter()
        torch.manual_seed(0)
        config = AutoConfig.for_model(**json.loads(published.read_text()))
        config = getattr(config, "text_config", config)  # Gemma 3 4B-27B: the language model
        config.dtype = torch.float32  # published configs say bf16: fp32 compares exactly
        hf_model = AutoModelForCausalLM.from_config(config)
        hf_model.float().save_pretrained(work / "hf")
        parameters = sum(p.numel() for p in hf_model.parameters())
        del hf_model
        step("build", start, f"{args.model}, {parameters:,} parameters, saved")

        start = time.perf_counter()
        # transformers' reference as a user gets it: the saved checkpoint, read back in fp32.
        hf_model = AutoModelForCausalLM.from_pretrained(
            work / "hf", attn_implementation="eager", dtype=torch.float32
        ).eval()
        tokens = np.random.default_rng(0).integers(0, config.vocab_size, (1, args.tokens))
        with torch.no_grad():
            theirs = hf_model(torch.as_tensor(tokens)).logits.numpy()
        del hf_model
        model = meshtrain.load_hf(work / "hf", mesh)
        ours = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
        error = relative_error(ours, theirs)
        report["logits_relative_error"] = error
        failures += [f"logits differ by {error:.2e}"] if error > LOGIT_TOLERANCE else []
        step("logits", start, f"{args.tokens} tokens on {args.mesh}: relative error {error:.2e}")
        del ours, theirs

        if args.steps > 0:
            del model
            start = time.perf_counter()
            cfg = compose_config(
                f"model={args.model}",
                f"model.init_from=hf:{work / 'hf'}",
                f"model.mesh_shape={args.mesh}",
                "data=synthetic",
                f"data.seq_len={args.train_tokens}",
                f"training.steps={args.steps}",
                "training.warmup_steps=1",
                "training.micro_batch_size=1",
                "training.eval_every=0",
                "training.log_every=1",
                *(args.train_set or ["model.scan_layers=true"]),
            )
            result = train(cfg, work / "run", devices=jax.devices())
            losses = [h["loss"] for h in result.history]
            failures += [] if all(np.isfinite(losses)) else [f"losses {losses}"]
            step(
                "train",
                start,
                f"{args.steps} steps, losses {', '.join(f'{x:.4f}' for x in losses)}",
            )
            model_cfg, params = result.setup.cfg.model, result.state.params
            model = merge_model(result.setup.model, params)  # the model as trained
            del result
        else:  # --steps 0: the loaded weights go to the export
            losses = []
            model_cfg = hf_model_config(work / "hf")
            params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        report["losses"] = losses

        start = time.perf_counter()
        out = export_hf(params, model_cfg, work / "export")
        ours = np.asarray(model(jnp.asarray(tokens[:, :256], jnp.int32)))
        del model, params
        reloaded = AutoModelForCausalLM.from_pretrained(
            out, attn_implementation="eager", dtype=torch.float32
        ).eval()
        with torch.no_grad():
            theirs = reloaded(torch.as_tensor(tokens[:, :256])).logits.numpy()
        error = relative_error(ours, theirs)
        report["export_relative_error"] = error
        failures += [f"export logits differ by {error:.2e}"] if error > LOGIT_TOLERANCE else []
        step("export", start, f"transformers reads the export: relative error {error:.2e}")
        shutil.rmtree(work, ignore_errors=True)

    report["peak_rss_gib"] = round(_rss_gib(), 2)
    report["ok"] = not failures
    if args.json:
        print(json.dumps(report))
    for failure in failures:
        print(f"rehearse: FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
