"""A trained model at work outside the train loop: continue prompts with it (`generate`), export
its parameters for other tools (`export`). Loading it is meshtrain.weights.load's."""
