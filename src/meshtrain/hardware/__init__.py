"""The devices meshtrain runs on or compiles for: the published peaks and memory of the
accelerators it knows by name (`accelerators`: MFU and the planner's verdict), the kind of
device a program is compiled for, which need not be this host's (`target`), and GPUs compiled
for without one (`plan.target`): their descriptions for XLA (`gpu_specs`), their topologies as
JAX devices and JAX's cuDNN checks answered for them (`deviceless`)."""
