"""Compiling for devices this host lacks: GPU targets described for XLA's deviceless compiler
(gpu_specs), their topologies as JAX devices, and JAX's cuDNN checks answered for the target
(deviceless)."""
