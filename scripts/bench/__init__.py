"""The parts of scripts/benchmark.py: the stamp and timing helpers every workload shares
(common), meshtrain's timed step and W1/W2's measurement (measure), the hand-written loop W1
is compared with (reference), W3 (w3) and W4 (w4)."""
