"""Parameter counts of the tiny model (configs/model/tiny.yaml), by how they are sharded."""

# Every weight matrix has an `embed` dimension (sharded over fsdp); the three RMSNorm scales
# per layer pair (2 × 2 × 128 + 128 final) are replicated.
MATRIX_PARAMS = 2 * (128 * 16 * 16 * 2 + 128 * 8 * 16 * 2 + 3 * 128 * 512) + 384 * 128
NORM_PARAMS = 5 * 128
F32 = 4
