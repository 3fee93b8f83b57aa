"""meshtrain: a config-driven training launcher for JAX language models."""
