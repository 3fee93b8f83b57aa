"""The short text run that tests of several files (tests/train/test_loop.py, test_resume.py)
share, so that the test run's compilation cache compiles its train step once: the tiny model with
one layer on sequences of 32 byte tokens, global batch 8 (one device, micro-batch 8), a constant
learning rate after 2 warmup steps. With a constant schedule training.steps is no part of the
compiled step: runs of any length share it. Its loss on text falls fast (unlike that of random
tokens): about 5.8 → 4.2 in 5 steps."""

SHORT_TEXT = (
    "data.seq_len=32",
    "model.num_layers=1",
    "training.lr_schedule=constant",
    "training.warmup_steps=2",
)
