"""The model: building blocks (layers), the decoder-only transformer configured per family
(transformer), and its abstract form with shapes and shardings before anything exists (abstract)."""
