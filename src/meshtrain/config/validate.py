"""Start-up checks of the whole config, before anything is compiled, allocated or written.

`check_config` needs no devices; `check_against_mesh` runs once the mesh shape is resolved.
Each failure is a ConfigError whose one line names the key, the value and the fix. Checks that
must read files (a Hugging Face `config.json`, existing checkpoints, the corpus) run where those
are opened, still before anything compiles: `meshtrain.train.setup.prepare` calls them all.
"""

from __future__ import annotations

from meshtrain.config.context import check_context_parallel
from meshtrain.config.data import (
    BadRecordPolicy,
    DataSource,
    DataVerify,
    Overlong,
    Packing,
    TrainOn,
)
from meshtrain.config.epochs import check_epochs
from meshtrain.config.evaluation import check_eval
from meshtrain.config.lora import check_lora
from meshtrain.config.model_mesh import check_model_on_mesh
from meshtrain.config.moe import check_moe
from meshtrain.config.objective import check_objective, check_shared_prompt
from meshtrain.config.pipeline import check_pipeline
from meshtrain.config.resume import check_allow_changes
from meshtrain.config.schema import (
    Activation,
    AttentionImpl,
    CheckpointConfig,
    Config,
    DataConfig,
    LayerKind,
    LrSchedule,
    MixedPrecision,
    NonfiniteMode,
    PipelineSchedule,
    ReduceDtype,
    RematPolicy,
    ResumeMode,
    RopeScaling,
    choices,
)
from meshtrain.config.trackers import check_logging
from meshtrain.errors import ConfigError, require
from meshtrain.families import REGISTERED, family
from meshtrain.hardware.accelerators import accelerator_named
from meshtrain.hardware.gpu_specs import gpu_spec
from meshtrain.parallel.mesh import MeshSpec
from meshtrain.parallel.rules import check_rules, mesh_axes_for


def _one_of(key: str, value: str, choices: tuple[str, ...]) -> None:
    require(value in choices, f"{key}={value!r} is not supported; use one of: {', '.join(choices)}")


def _positive(key: str, value: int | float) -> None:
    require(value > 0, f"{key}={value} must be positive")


def _check_data(data: DataConfig) -> None:
    """The data keys that need no file; the files themselves are checked as they are opened
    (meshtrain.data), the tokenizer where it is built."""
    require(
        data.source != "text_files",
        "data.source=text_files is now data.source=text (data=text, or data=stdlib for the "
        "standard library); data.path and data.glob work as before",
    )
    _one_of("data.source", data.source, choices(DataSource))
    _one_of("data.on_bad_record", data.on_bad_record, choices(BadRecordPolicy))
    _one_of("data.verify", data.verify, choices(DataVerify))
    _one_of("data.overlong", data.overlong, choices(Overlong))
    _one_of("data.packing", data.packing, choices(Packing))
    if data.train_on is not None:
        _one_of("data.train_on", data.train_on, choices(TrainOn))
    _positive("data.seq_len", data.seq_len)
    require(
        0.0 <= data.validation_fraction < 1.0,
        f"data.validation_fraction={data.validation_fraction} must be in [0, 1), e.g. 0.05",
    )
    require(data.workers >= 0, f"data.workers={data.workers} must be >= 0 (0: no read-ahead)")
    require(bool(data.text_key), "data.text_key is empty; name the field that holds the text")
    if data.source == "synthetic":
        require(
            not data.mixture and not data.paths,
            "data.source=synthetic reads no files; drop data.mixture and data.paths, or use "
            "data.source=text",
        )
        return
    if data.mixture:
        require(
            not data.paths,
            "data.paths and data.mixture are both set; list the paths in the mixture's sources",
        )
        names = [source.name for source in data.mixture]
        for i, source in enumerate(data.mixture):
            key = f"data.mixture[{i}]"
            require(
                source.weight > 0,
                f"{key}.weight={source.weight} must be > 0; drop source {source.name!r} from "
                "data.mixture to leave it out",
            )
            require(bool(source.paths), f"{key}.paths is empty; list its files or globs")
            require(
                bool(source.name) and source.name not in names[:i],
                f"{key}.name={source.name!r} must be a unique, non-empty name",
            )
    elif data.source == "text":
        require(
            bool(data.paths) or data.glob is not None,
            "data=text needs data.paths: files, directories or globs of documents, e.g. "
            "'data.paths=[corpus/*.jsonl]'",
        )
    elif data.source in ("chat", "preference"):
        records = {
            "chat": "conversations (messages) or prompt/completion records, e.g. "
            "'data.paths=[chats/*.jsonl]'",
            "preference": "prompt/chosen/rejected records, e.g. 'data.paths=[pairs/*.jsonl]'",
        }[data.source]
        require(
            bool(data.paths),
            f"data={data.source} needs data.paths: .jsonl, .jsonl.gz or .parquet files of {records}",
        )
        require(
            data.tokenizer != "byte",
            f"data={data.source} needs the model's Hugging Face tokenizer: set data.tokenizer=DIR "
            "(the directory with tokenizer.json and its chat template)",
        )
    elif data.source == "prepared":
        require(
            data.path is not None,
            "data.source=prepared needs data.path=DIR, a directory made by "
            "python -m meshtrain.data.prepare --out DIR ...",
        )


def check_config(cfg: Config) -> None:
    model, data, training = cfg.model, cfg.data, cfg.training
    check_lora(model)
    check_moe(model.moe)
    check_eval(cfg.eval)
    check_objective(
        cfg.objective, data_source=cfg.data.source, document_masking=cfg.data.document_masking
    )
    check_shared_prompt(model, data)
    for key in (
        "vocab_size",
        "d_model",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "mlp_dim",
    ):
        _positive(f"model.{key}", getattr(model, key))
    require(
        model.num_heads % model.num_kv_heads == 0,
        f"model.num_kv_heads={model.num_kv_heads} does not divide model.num_heads={model.num_heads}; "
        "grouped-query attention shares each key/value head among a whole number of query heads",
    )
    require(
        model.head_dim % 2 == 0,
        f"model.head_dim={model.head_dim} must be even for rotary embeddings",
    )
    _one_of("model.mlp_activation", model.mlp_activation, choices(Activation))
    _positive("model.rope_theta", model.rope_theta)
    check_rules(model.logical_axis_rules)
    _check_model_flavour(cfg)

    _check_data(data)

    for key in (
        "steps",
        "micro_batch_size",
        "gradient_accumulation_steps",
        "log_every",
        "eval_batches",
    ):
        _positive(f"training.{key}", getattr(training, key))
    _positive("training.learning_rate", training.learning_rate)
    _one_of("training.lr_schedule", training.lr_schedule, choices(LrSchedule))
    _one_of("training.mixed_precision", training.mixed_precision, choices(MixedPrecision))
    _one_of("training.nonfinite", training.nonfinite, choices(NonfiniteMode))
    _one_of("training.reduce_dtype", training.reduce_dtype, choices(ReduceDtype))
    _positive("training.sync_gradients_every", training.sync_gradients_every)
    _one_of("training.pipeline.schedule", training.pipeline.schedule, choices(PipelineSchedule))
    if training.pipeline.microbatches is not None:
        _positive("training.pipeline.microbatches", training.pipeline.microbatches)
    if training.pipeline.repeats is not None:
        _positive("training.pipeline.repeats", training.pipeline.repeats)
        require(
            training.pipeline.schedule == "circular",
            f"training.pipeline.repeats={training.pipeline.repeats} applies to the circular "
            f"schedule, not {training.pipeline.schedule}; add training.pipeline.schedule=circular "
            "or drop training.pipeline.repeats",
        )
    accum = training.gradient_accumulation_steps
    if accum % training.sync_gradients_every:
        valid = ", ".join(str(k) for k in range(1, accum + 1) if accum % k == 0)
        raise ConfigError(
            f"training.sync_gradients_every={training.sync_gradients_every} does not divide "
            f"training.gradient_accumulation_steps={accum}; use one of {valid}"
        )
    require(
        training.warmup_steps >= 0, f"training.warmup_steps={training.warmup_steps} must be >= 0"
    )
    require(
        0.0 <= training.min_lr_ratio <= 1.0,
        f"training.min_lr_ratio={training.min_lr_ratio} must be in [0, 1]",
    )
    require(
        training.weight_decay >= 0, f"training.weight_decay={training.weight_decay} must be >= 0"
    )
    require(
        training.grad_clip >= 0,
        f"training.grad_clip={training.grad_clip} must be >= 0 (0 disables clipping)",
    )
    require(
        training.eval_every >= 0,
        f"training.eval_every={training.eval_every} must be >= 0 (0 disables eval)",
    )
    if training.global_batch_size is not None:
        _positive("training.global_batch_size", training.global_batch_size)
    check_epochs(cfg)
    for key, value in (
        ("data.cache_dir", data.cache_dir),
        ("training.compilation_cache_dir", training.compilation_cache_dir),
    ):
        require(
            value is None or value.strip() != "",
            f"{key}={value!r} names no directory; use auto, a directory, or null (no cache)",
        )

    profile, plan = cfg.profile, cfg.plan
    _positive("profile.start_step", profile.start_step)
    _positive("profile.num_steps", profile.num_steps)
    require(
        not training.profile or training.dry_run or profile.start_step <= training.steps,
        f"profile.start_step={profile.start_step} comes after the last step "
        f"(training.steps={training.steps}); use profile.start_step={min(5, training.steps)}",
    )
    if plan.device is not None:
        accelerator_named(plan.device)
    require(
        0.0 < plan.memory_fraction <= 1.0,
        f"plan.memory_fraction={plan.memory_fraction} must be in (0, 1], e.g. 0.9",
    )
    if plan.fake_devices is not None:
        _positive("plan.fake_devices", plan.fake_devices)
    if plan.target is not None:
        gpu_spec(plan.target)
        require(
            training.dry_run,
            f"plan.target={plan.target} compiles for GPUs this host lacks, so nothing can run: "
            "add training.dry_run=true",
        )
        require(
            plan.fake_devices is None,
            f"plan.target={plan.target} compiles for {plan.target} devices, not faked CPU ones: "
            "drop plan.fake_devices",
        )
    _check_checkpoint(cfg.checkpoint)
    check_logging(cfg.logging)


def _check_model_flavour(cfg: Config) -> None:
    """The fields that select a model family's features (configs/model/*.yaml)."""
    model = cfg.model
    spec = family(model.family)
    if spec.mixture_of_experts != (model.moe.num_experts > 0):
        which = [
            f.name for f in REGISTERED.values() if f.mixture_of_experts != spec.mixture_of_experts
        ]
        fix = (
            "a mixture of experts; set model.moe.num_experts (e.g. 8)"
            if spec.mixture_of_experts
            else "a dense MLP; set model.moe.num_experts=0"
        )
        raise ConfigError(
            f"model.moe.num_experts={model.moe.num_experts} but model.family={model.family} has "
            f"{fix} or use a family with{'out' if spec.mixture_of_experts else ''} experts: "
            + ", ".join(which)
        )
    pattern = "[" + ",".join(model.attention_pattern) + "]"
    require(
        bool(model.attention_pattern)
        and all(k in choices(LayerKind) for k in model.attention_pattern),
        f"model.attention_pattern={pattern} must be a non-empty list of "
        f"{' and '.join(choices(LayerKind))}, e.g. [local,local,local,local,local,global]",
    )
    if "local" in model.attention_pattern:
        window = "null" if model.sliding_window is None else model.sliding_window
        require(
            model.sliding_window is not None and model.sliding_window > 0,
            f"model.sliding_window={window} must be a positive number of tokens because "
            f"model.attention_pattern={pattern} has local layers",
        )
    if model.rope_local_theta is not None:
        _positive("model.rope_local_theta", model.rope_local_theta)
    _one_of("model.rope_scaling", model.rope_scaling, choices(RopeScaling))
    _positive("model.rope_scaling_factor", model.rope_scaling_factor)
    if model.rope_scaling == "llama3":
        require(
            model.rope_high_freq_factor > model.rope_low_freq_factor > 0,
            f"model.rope_high_freq_factor={model.rope_high_freq_factor} must be greater than "
            f"model.rope_low_freq_factor={model.rope_low_freq_factor} > 0 for llama3 scaling",
        )
        _positive("model.rope_original_max_len", model.rope_original_max_len)
    if model.query_pre_attn_scalar is not None:
        _positive("model.query_pre_attn_scalar", model.query_pre_attn_scalar)
    _one_of("model.remat", model.remat, choices(RematPolicy))
    # cudnn on a machine without an NVIDIA GPU is refused where the devices are known
    # (meshtrain.models.abstract.abstract_model), still before anything compiles.
    _one_of("model.attention", model.attention, choices(AttentionImpl))
    _positive("model.max_seq_len", model.max_seq_len)
    require(
        cfg.data.seq_len <= model.max_seq_len,
        f"data.seq_len={cfg.data.seq_len} is longer than model.max_seq_len={model.max_seq_len} "
        f"of model {model.name}; use data.seq_len <= {model.max_seq_len}",
    )


def _check_checkpoint(ckpt: CheckpointConfig) -> None:
    """checkpoint.* values that cannot work whatever is on disk."""
    if ckpt.every_steps < 0:
        raise ConfigError(
            f"checkpoint.every_steps={ckpt.every_steps} must be >= 0 (0: save only at the end "
            "and on SIGTERM/SIGINT)"
        )
    if ckpt.keep < 1:
        raise ConfigError(
            f"checkpoint.keep={ckpt.keep} must be >= 1; keep 2 or more to have a fallback "
            "if the newest checkpoint is damaged"
        )
    if not ckpt.resume:
        raise ConfigError("checkpoint.resume is empty; use auto, never or a checkpoint path")
    if ckpt.resume not in choices(ResumeMode) and ckpt.load_params:
        raise ConfigError(
            f"checkpoint.resume={ckpt.resume} and checkpoint.load_params={ckpt.load_params} are "
            "both set; resume continues a run with its own parameters, so drop one of them"
        )
    check_allow_changes(ckpt.allow_changes)


def check_against_mesh(cfg: Config, mesh: MeshSpec) -> None:
    """Model dimensions and batch sizes divide over the mesh axes that shard them."""
    check_model_on_mesh(cfg.model, mesh)
    rules = cfg.model.logical_axis_rules
    training = cfg.training
    batch_axes = mesh_axes_for("batch", rules)
    shards = mesh.size(*batch_axes)
    if training.global_batch_size is not None:
        per_update = shards * training.gradient_accumulation_steps
        if training.global_batch_size % per_update:
            raise ConfigError(
                f"training.global_batch_size={training.global_batch_size} is not divisible by the "
                f"batch shards ({'×'.join(batch_axes)}={shards}) × "
                f"training.gradient_accumulation_steps={training.gradient_accumulation_steps} = {per_update}; "
                f"use a multiple of {per_update}, e.g. {per_update * max(1, training.global_batch_size // per_update)}"
            )
    check_context_parallel(cfg, mesh)
    require(
        cfg.model.moe.capacity_factor is None or mesh.sizes["cp"] == 1,
        f"model.moe.capacity_factor={cfg.model.moe.capacity_factor} counts each expert's "
        f"capacity along whole sequences, which cp={mesh.sizes['cp']} in model.mesh_shape "
        "splits; set model.moe.capacity_factor=null (dropless) or put those devices on another "
        "axis",
    )
    if mesh.sizes["pp"] > 1:
        require(
            cfg.model.moe.num_experts == 0,
            f"model.mesh_shape has pp={mesh.sizes['pp']}, but the pipeline schedules do not "
            "carry a mixture of experts' auxiliary losses yet; put those devices on ep, fsdp or "
            "dp",
        )
        check_pipeline(cfg, mesh, micro_batch_size(cfg, mesh))
    else:
        require(
            cfg.model.pipeline.layers_per_stage is None,
            f"model.pipeline.layers_per_stage={cfg.model.pipeline.layers_per_stage} splits the "
            "layers into pipeline stages, but model.mesh_shape has no pp axis; add one (e.g. "
            "[[2,-1],[pp,fsdp]]) or drop model.pipeline.layers_per_stage",
        )


def micro_batch_size(cfg: Config, mesh: MeshSpec) -> int:
    """Sequences per batch shard per micro-batch (derived when training.global_batch_size is set)."""
    training = cfg.training
    if training.global_batch_size is None:
        return training.micro_batch_size
    shards = mesh.size(*mesh_axes_for("batch", cfg.model.logical_axis_rules))
    return training.global_batch_size // (shards * training.gradient_accumulation_steps)
