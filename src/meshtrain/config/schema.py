"""Typed configuration schemas: every key of a run, its type, default and meaning.

Every field has a type, a default and a one-line docstring (the string literal under it). The
YAML files in configs/ state only what differs (tests/config/test_schema.py checks each YAML key
exists here). Start-up validation: `meshtrain.config.validate`; Hydra glue: `meshtrain.config.hydra`.

A field with a fixed set of values names its `Literal` type below; validation reads the allowed
values from it, and the code that implements each value keys its table by the same type.
OmegaConf 2.3 does not accept `Literal` annotations, so those fields are typed `str` for Hydra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from meshtrain.config.caches import AUTO_CACHE
from meshtrain.config.data import DataConfig
from meshtrain.config.evaluation import EvalConfig
from meshtrain.config.lora import LoraConfig
from meshtrain.config.moe import MoeConfig
from meshtrain.config.objective import ObjectiveConfig
from meshtrain.config.trackers import LoggingConfig
from meshtrain.families import DEFAULT_FAMILY

Activation = Literal["silu", "gelu"]
"""model.mlp_activation: SwiGLU or GeGLU."""
LayerKind = Literal["global", "local"]
"""An entry of model.attention_pattern: full causal attention or a sliding window."""
RopeScaling = Literal["none", "linear", "llama3"]
"""model.rope_scaling."""
RematPolicy = Literal["none", "full", "dots_saveable", "minimal"]
"""model.remat."""
AttentionImpl = Literal["auto", "xla", "cudnn"]
"""model.attention: auto (cuDNN on NVIDIA GPUs in bf16/fp16 where the shapes allow, else the chunked XLA kernel), xla or cudnn."""
LrSchedule = Literal["cosine", "constant"]
"""training.lr_schedule."""
MixedPrecision = Literal["fp32", "bf16"]
"""training.mixed_precision: the compute dtype."""
NonfiniteMode = Literal["stop", "skip"]
"""training.nonfinite."""
ReduceDtype = Literal["fp32", "bf16"]
"""training.reduce_dtype: the precision of the gradient reductions meshtrain runs itself."""
PipelineSchedule = Literal["gpipe", "circular", "1f1b"]
"""training.pipeline.schedule."""
ResumeMode = Literal["auto", "never"]
"""checkpoint.resume, unless it is a checkpoint path."""
ClusterDetection = Literal["slurm", "ompi", "mpi4py", "gcetpu", "gketpu"]
"""distributed.cluster_detection."""


def choices(literal: Any) -> tuple[str, ...]:
    """The allowed values of a Literal type, in their order of declaration."""
    return get_args(literal)


# Logical axis name → mesh axes (None: replicated). Megatron-style: heads and the MLP hidden
# size on tp, the model dimension on fsdp, the batch on every batch-sharding axis; the sequence
# on cp (context parallelism, meshtrain.parallel.context), whose devices also shard the weights
# as fsdp does (they would otherwise each hold them whole).
DEFAULT_LOGICAL_AXIS_RULES: dict[str, Any] = {
    "batch": ["dp", "fsdp", "ep"],
    "length": "cp",
    "embed": ["fsdp", "cp"],
    "vocab": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "norm": None,
    "layers": "pp",  # stacked blocks (model.scan_layers): each pipeline stage holds its own
    "lora_rank": None,  # the rank axis of LoRA adapters (model.lora): small, replicated
    "experts": "ep",  # the experts of a mixture-of-experts layer (model.moe): expert parallelism
    "expert_mlp": "tp",  # one expert's hidden width, split as the dense MLP's
}


@dataclass
class StageLayout:
    """model.pipeline: how the blocks split into the stages of a `pp` mesh axis."""

    layers_per_stage: list[int] | None = None
    """Blocks of each stage, first to last, summing to num_layers (e.g. [7, 7, 6, 6] for 26 layers on pp=4); null: num_layers / pp each."""


@dataclass
class ModelConfig:
    name: str = "tiny"
    """Name of the model flavour, used in logs and run directories."""
    mesh_shape: list[Any] = field(default_factory=lambda: [[1, 1], ["fsdp", "tp"]])
    """[[sizes...], [axis names...]]: device mesh; axes are fsdp, tp, dp, pp (pipeline stages), cp (context parallelism: each sequence split over cp devices) and ep (expert parallelism: the experts of model.moe split over ep devices, the batch too); one size may be -1."""
    logical_axis_rules: dict[str, Any] = field(
        default_factory=lambda: dict(DEFAULT_LOGICAL_AXIS_RULES)
    )
    """Logical axis name → mesh axis, list of mesh axes, or null (replicated)."""
    vocab_size: int = 384
    """Rows of the embedding table; at least the tokenizer's vocabulary, padded for tp."""
    d_model: int = 128
    """Width of the residual stream (the `embed` axis)."""
    num_layers: int = 2
    """Number of transformer blocks."""
    num_heads: int = 16
    """Query heads per attention layer."""
    num_kv_heads: int = 8
    """Key/value heads (grouped-query attention); must divide num_heads."""
    head_dim: int = 16
    """Width of one attention head."""
    mlp_dim: int = 512
    """Hidden width of the gated MLP (the `mlp` axis)."""
    mlp_activation: str = "silu"  # Activation
    """Activation of the gated MLP: silu (SwiGLU) or gelu (GeGLU)."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    norm_eps: float = 1e-6
    """Epsilon inside RMSNorm."""
    tie_embeddings: bool = True
    """Reuse the token embedding as the output projection."""
    init_std: float = 0.02
    """Standard deviation of the normal initialiser for weight matrices."""
    family: str = DEFAULT_FAMILY
    """Architecture family, its block and its Hugging Face import and export: one registered in meshtrain.families (docs/models.md)."""
    max_seq_len: int = 2048
    """Longest sequence the model is made for (HF max_position_embeddings); bounds data.seq_len."""
    attention_pattern: list[str] = field(default_factory=lambda: ["global"])  # LayerKind
    """Layer i attends as attention_pattern[i % len]: global (all earlier tokens) or local (window)."""
    sliding_window: int | None = None
    """Tokens a local layer's query sees, itself included; required when a layer is local."""
    rope_local_theta: float | None = None
    """RoPE base of local layers; null: rope_theta."""
    rope_scaling: str = "none"  # RopeScaling
    """RoPE frequency scaling of the global layers: none, linear or llama3."""
    rope_scaling_factor: float = 1.0
    """Frequency divisor of linear and llama3 RoPE scaling."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above original_max_len / this are divided by the factor."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below original_max_len / this are kept."""
    rope_original_max_len: int = 8192
    """llama3 scaling: the context length the model was pre-trained with."""
    qk_norm: bool = False
    """RMSNorm over head_dim on queries and keys, before RoPE (Gemma 3, Qwen 3)."""
    post_norms: bool = False
    """RMSNorm on the attention and MLP outputs before each residual add (Gemma 3)."""
    norm_scale_offset: float = 0.0
    """RMSNorm multiplies by (offset + scale); Gemma stores scale - 1 and uses offset 1."""
    scale_embeddings: bool = False
    """Multiply the token embeddings by sqrt(d_model) (Gemma)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by 1/sqrt(this); null: head_dim."""
    remat: str = "none"  # RematPolicy
    """Activation recomputation per block: none, full, dots_saveable or minimal (docs/models.md)."""
    scan_layers: bool | None = None
    """Stack the blocks' parameters on a `layers` axis and run them in a lax.scan (flat compile time); null: on for a mesh with a pp axis (its stages hold slices of the stack), off otherwise."""
    attention: str = "auto"  # AttentionImpl
    """Attention implementation: auto (cuDNN on NVIDIA GPUs in bf16/fp16 when it can, else XLA), xla or cudnn."""
    init_from: str | None = None
    """hf:/path/to/dir: start from a local Hugging Face checkpoint; null: random init."""
    pipeline: StageLayout = field(default_factory=StageLayout)
    """Stages of a pp mesh axis (docs/parallelism.md#pipeline-parallelism)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters on a frozen base, QLoRA (docs/finetuning.md#lora-and-qlora)."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """A mixture of experts in place of every block's MLP (docs/models.md#mixture-of-experts)."""

    def __post_init__(self) -> None:  # built from a saved config's dicts (checkpoint meta/)
        if isinstance(self.lora, dict):
            self.lora = LoraConfig(**self.lora)
        if isinstance(self.pipeline, dict):
            self.pipeline = StageLayout(**self.pipeline)
        if isinstance(self.moe, dict):
            self.moe = MoeConfig(**self.moe)


@dataclass
class PipelineConfig:
    """training.pipeline: how micro-batches flow through the stages of a `pp` mesh axis
    (docs/parallelism.md#pipeline-parallelism)."""

    schedule: str = "gpipe"  # PipelineSchedule
    """gpipe (all forwards, then all backwards), circular (gpipe with each stage's layers in `repeats` chunks that micro-batches loop through: a smaller bubble) or 1f1b (a backward as soon as it can run: the inputs of at most 2 × pp - 1 micro-batches are kept, and each stage recomputes its forward)."""
    microbatches: int | None = None
    """Pipeline micro-batches each micro-batch is split into; null: pp. The bubble is (pp - 1) / (microbatches + pp - 1) with gpipe."""
    repeats: int | None = None
    """circular: chunks of layers per stage, each micro-batch passing every stage `repeats` times; the bubble is (pp - 1) / (repeats × microbatches + pp - 1). null: 2, or the smallest number above 1 that divides the layers per stage; only with schedule=circular."""


@dataclass
class TrainingConfig:
    steps: int = 200
    """Number of optimizer updates (replaced by training.epochs where that is set)."""
    epochs: float | None = None
    """Passes over the training sequences instead of training.steps: steps = ceil(epochs × sequences / global batch), once the data is read (logged); not with data.mixture, which draws by weight. null: training.steps."""
    micro_batch_size: int = 8
    """Sequences per batch shard (per device along dp×fsdp×ep) per micro-batch."""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated (a lax.scan) into one update; dp replicas reduce their sum once, after the last."""
    sync_gradients_every: int = 1
    """Reduce gradients over fsdp every this many micro-batches, summing them unsharded in between (a buffer of the parameters over tp); must divide gradient_accumulation_steps."""
    reduce_dtype: str = "fp32"  # ReduceDtype
    """Precision of the gradient reductions over dp and fsdp: fp32, or bf16 (half the bytes; summed in fp32 after each)."""
    global_batch_size: int | None = None
    """If set, sequences per update; micro_batch_size is then derived from it and the mesh."""
    learning_rate: float = 3e-3
    """Peak learning rate reached after warmup."""
    warmup_steps: int = 20
    """Linear warmup from 0 to learning_rate over this many updates."""
    lr_schedule: str = "cosine"  # LrSchedule
    """After warmup: cosine (decay to min_lr_ratio × peak at the last step) or constant."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of the peak."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms)."""
    adam_b1: float = 0.9
    """AdamW first-moment decay."""
    adam_b2: float = 0.95
    """AdamW second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip gradients to this global norm; 0 disables clipping."""
    mixed_precision: str = "fp32"  # MixedPrecision
    """Compute dtype: fp32, or bf16 (bf16 matmuls, fp32 master weights and optimizer state)."""
    seed: int = 0
    """Seed for parameter init and data order; same seed, same losses on any mesh."""
    log_every: int = 10
    """Log metrics every this many updates (and at the last one)."""
    eval_every: int = 100
    """Evaluate on the held-out split every this many updates (and at the end); 0 disables."""
    eval_batches: int = 4
    """Global batches averaged for one validation loss."""
    nonfinite: str = "stop"  # NonfiniteMode
    """A NaN/Inf loss or gradient norm: stop (error naming the step; never checkpointed) or skip (drop that update, count it)."""
    profile: bool = False
    """Trace the steps of the `profile:` window with the JAX profiler into <run_dir>/profile/."""
    profile_communication: bool = False
    """Log every collective of the compiled step and write <run_dir>/communication.json."""
    dry_run: bool = False
    """Compile the step on abstract inputs, log the memory plan, write plan.json and stop."""
    compilation_cache_dir: str | None = AUTO_CACHE
    """JAX's persistent compilation cache: auto ($JAX_COMPILATION_CACHE_DIR, else <cache root>/jax), a directory, or null (off); CLI only."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Pipeline schedule and micro-batches; used when model.mesh_shape has a pp axis of size > 1."""
    xla_gpu_flags: bool = True
    """On GPU, add meshtrain's default XLA flags (docs/performance.md) that XLA_FLAGS does not set already; CLI only."""


@dataclass
class CheckpointConfig:
    dir: str | None = None
    """Directory of this run's checkpoints; null means <run_dir>/checkpoints."""
    every_steps: int = 100
    """Save every this many steps; also saved at the last step and on SIGTERM/SIGINT. 0: only then."""
    keep: int = 3
    """Newest checkpoints kept; an older one is deleted only after a newer one has committed."""
    resume: str = "auto"  # ResumeMode, or a checkpoint path
    """auto (continue from the newest complete checkpoint in checkpoint.dir), never (start fresh), or a checkpoint path."""
    overwrite: bool = False
    """Allow deleting checkpoints in checkpoint.dir that lie after the start step (e.g. resume=never on a used dir)."""
    load_params: str | None = None
    """Checkpoint or export whose parameters start a fresh run (fine-tuning); optimizer, step and data start anew."""
    async_save: bool = True
    """Write checkpoints in the background while training continues."""
    allow_changes: list[str] = field(default_factory=list)
    """Config keys (or parts, e.g. data.mixture) a resume may change although the checkpoint cannot be continued exactly with them; docs/checkpointing.md#what-resume-compares."""


@dataclass
class DistributedConfig:
    coordinator_address: str | None = None
    """host:port of process 0's coordinator; null: MASTER_ADDR:MASTER_PORT or the detected cluster."""
    coordinator_port: int | None = None
    """Port of process 0's coordinator next to MASTER_ADDR; null: MASTER_PORT, or MASTER_PORT+1 under torchrun (its agent holds MASTER_PORT)."""
    num_processes: int | None = None
    """Processes in the run; null: WORLD_SIZE or the detected cluster; none of them: one process."""
    process_id: int | None = None
    """This process's index in [0, num_processes); null: RANK or the detected cluster."""
    local_device_ids: list[int] | None = None
    """Accelerator ids this process uses; null: all it sees (one per process under SLURM, Open MPI or torchrun)."""
    cluster_detection: str | None = None  # ClusterDetection
    """Force a JAX cluster detection method (slurm, ompi, mpi4py, gcetpu, gketpu); null: SLURM and Open MPI by their variables."""
    timeout_s: int = 300
    """Seconds to wait for every process at start-up, and without a heartbeat before a process counts as dead."""


@dataclass
class ProfileConfig:
    start_step: int = 5
    """First step (counting from 1) inside the profiler window of training.profile=true."""
    num_steps: int = 3
    """Steps traced from start_step on (the window ends early at the last training step)."""
    all_ranks: bool = False
    """Trace on every process (process i > 0 into profile/process_<i>/); false: process 0 only."""


@dataclass
class PlanConfig:
    device: str | None = None
    """Accelerator the memory plan is checked against (h100, h200, a100_80gb, v5e...); null: the devices in use."""
    memory_fraction: float = 0.9
    """Share of a device's memory a run may fill (XLA keeps some; on GPU see XLA_PYTHON_CLIENT_MEM_FRACTION)."""
    fake_devices: int | None = None
    """Fake this many CPU devices (plan a large mesh on a laptop); set before JAX starts, CLI only."""
    target: str | None = None
    """Compile the dry run for these GPUs on this CPU: h100, h200, b200 (docs/planning.md); CLI only."""


@dataclass
class ExperimentConfig:
    name: str = "default"
    """Experiment name: the first folder under outputs/."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
