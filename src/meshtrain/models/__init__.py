"""The model: building blocks (layers), attention with its implementations (attention), the
decoder-only transformer configured per family (transformer), and its abstract form with shapes
and shardings before anything exists (abstract)."""
