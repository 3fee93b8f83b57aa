"""Parallelism as data: `model.mesh_shape` → a JAX device mesh (mesh), and the one table of
logical axis rules → PartitionSpecs, NamedShardings and activation constraints (rules)."""
