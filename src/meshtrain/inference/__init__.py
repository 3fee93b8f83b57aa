"""A trained model outside the train loop: load it (`load_hf`, `load_checkpoint`), continue a
prompt with it (`generate`), export its parameters for other tools (`export`)."""
