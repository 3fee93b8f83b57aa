"""The weights a model starts from, wherever they are: a run's initial weights (a meshtrain
checkpoint or a Hugging Face one, `initial_weights`), a LoRA run's frozen base and a preference
run's reference copy with their identities (`lora_base`), and a trained model outside the loop,
loaded from a checkpoint, an export or a Hugging Face directory with its tokenizer (`load`, which
finds a moved project's tokenizer again by its contents: `moved_tokenizer`)."""
