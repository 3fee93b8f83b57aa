"""Code the tests share (importable as `helpers` through pytest's `pythonpath = ["tests"]`).

paths: the repository and its configs. config: the typed config of a command line. process:
child processes (`python run_training.py`, `python -m meshtrain.launch`) with faked devices.
runs: tiny training runs in-process and the metrics they write. docs: the fenced blocks and
commands of the Markdown docs. tiny_model: the tiny model's parameter counts. tiny_hf,
tiny_tokenizers: small Hugging Face checkpoints (with transformers' committed numbers) and
tokenizers made on the spot; tiny_hf_torch: the same checkpoints in transformers (needs torch).
guards: the session's own checks (nothing written into the checkout, no torch by default).
meshes: a model's parameters copied onto a mesh.
"""
