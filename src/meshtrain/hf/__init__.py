"""Hugging Face interop for the llama, qwen3 and gemma3 families: config.json ↔ ModelConfig
(config_json), tensor names and layouts (tensor_map), safetensors files (safetensors_io), local
checkpoints in (load: `model.init_from=hf:/dir`) and out (save: `export_hf`), and the bound of
logit parity with transformers (parity)."""
