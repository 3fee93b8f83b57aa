"""How close meshtrain's numbers are to transformers' on the same checkpoint: the bound its tests
and `scripts/rehearse.py` (published sizes) check every fp32 logit comparison against, and the
measure they use."""

from __future__ import annotations

import numpy as np

# The bound of every fp32 logit comparison with transformers, relative to the largest logit
# (relative_error). The measured difference is ~1e-6: fp32 rounding of the same arithmetic done
# in a different order (einsum vs matmul, fused softmax).
LOGIT_TOLERANCE = 1e-4


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    """max |ours - theirs| / max |theirs|."""
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())
