"""The language model's declared surface (meshtrain.models.interface.LanguageModel): the
Transformer provides it, and the code outside meshtrain.models that runs a model (the step's
objectives, the pipeline schedules, the harness) reads nothing else of it."""

import ast
from pathlib import Path

from flax import nnx

from meshtrain.config import ModelConfig
from meshtrain.models.interface import LanguageModel
from meshtrain.models.transformer import Transformer

SRC = Path(__file__).resolve().parents[2] / "src" / "meshtrain"
# The modules outside models/ that run a model's parts, and what they call it.
USERS = {
    "train/objectives/next_token.py": "net",
    "train/objectives/token_scores.py": "net",
    "train/pipeline.py": "net",
    "harness/programs.py": "model",
}
DECLARED = {
    name
    for klass in LanguageModel.__mro__
    if klass is not object
    for name in (*klass.__dict__, *getattr(klass, "__annotations__", {}))
    if not name.startswith("_")
}


def test_the_transformer_is_a_language_model():
    model = nnx.eval_shape(lambda: Transformer(ModelConfig(), rngs=nnx.Rngs(0)))
    assert isinstance(model, LanguageModel)


def test_code_outside_the_models_reads_only_the_declared_surface():
    undeclared = {}
    for module, name in USERS.items():
        tree = ast.parse((SRC / module).read_text())
        read = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == name
        }
        if name == "model":  # harness/programs.py's model is the Transformer itself
            read -= {"config"}
        undeclared[module] = sorted(read - DECLARED)
    assert undeclared == {module: [] for module in USERS}
