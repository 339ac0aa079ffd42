"""Structured config schema: one dataclass per config group.

These dataclasses are registered with Hydra's ConfigStore (see ``store.py``) so that
an unknown key or a value of the wrong type is rejected at composition time.
Cross-field rules (degrees vs world size, divisibility, batch arithmetic...) live in
``validate.py``; this module only declares the shape and the defaults.

Nothing here imports torch: the planner and ``action=plan`` must stay instant.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


@dataclass
class RopeScalingConfig:
    """RoPE frequency scaling of long-context checkpoints (model.rope_scaling).

    type: none (plain RoPE) | llama3 (Llama 3.1-3.3: wavelengths longer than
    original_max_position_embeddings / low_freq_factor are stretched by `factor`, shorter than
    original_max_position_embeddings / high_freq_factor kept, the band between interpolated)
    | yarn (DeepSeek-V3, model.family=deepseek_v3 only: frequencies with fewer than beta_slow
    rotations over original_max_position_embeddings are divided by `factor`, those with more than
    beta_fast kept, a linear ramp between; cos/sin scaled by mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) and the softmax scale by mscale(factor, mscale_all_dim)^2,
    mscale(f, m) = 0.1 m ln f + 1 -- transformers' yarn and DeepseekV3Attention).
    The other defaults are Llama 3.1's values (yarn's: DeepSeek-V3's). Read from config.json by
    model=hf / model.init_from."""

    type: str = "none"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn only (transformers' names; 0 for mscale / mscale_all_dim: not given).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    # Round the correction range to whole dimensions (transformers' default, DeepSeek's code).
    truncate: bool = True


@dataclass
class ModelConfig:
    """Model shape. Defined once per model in conf/model/*.yaml; read by planner and builder."""

    name: str = MISSING
    # The model family (launcher/models/<family>/: definition, tensor-parallel plan, Hugging Face
    # maps, parameter formulas): llama | mixtral | qwen3 | deepseek_v3. A config without it is llama.
    family: str = "llama"
    n_layers: int = MISSING
    dim: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: int = MISSING
    ffn_dim: int = MISSING
    vocab_size: int = MISSING
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Mixture of experts (n_experts == 0 means dense).
    n_experts: int = 0
    top_k: int = 0
    n_shared_experts: int = 0
    moe_ffn_dim: int = 0
    # The first n_dense_layers blocks use a dense FFN of ffn_dim even in an MoE model
    # (DeepSeek-V3 keeps its first 3 layers dense).
    n_dense_layers: int = 0
    # Tokens each expert may take = capacity_factor * tokens * top_k / n_experts;
    # overflow tokens are dropped (their expert output is zero, the residual passes).
    # <= 0 means dropless.
    capacity_factor: float = 0.0
    # Weight of the Switch-style load-balancing loss added to the LM loss.
    aux_loss_coef: float = 0.01
    init_std: float = 0.02
    # A local Hugging Face folder (config.json + *.safetensors; launcher/models/family.py) whose weights
    # replace the random initialisation; "" = random init (launcher/hf/format.py).
    init_from: str = ""
    # RoPE scaling (launcher/models/layers.py scale_rope_frequencies); default: none.
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    # Size of one attention head; 0 = dim // n_heads (Llama). Qwen3 sets it (128) independently.
    head_dim: int = 0
    # Per-head RMSNorm of queries and keys before RoPE (Qwen3).
    qk_norm: bool = False
    # MoE routing: renormalise the top-k router scores to sum to 1 (Mixtral, Qwen3-MoE as released).
    norm_topk_prob: bool = True
    # Which blocks are MoE (n_experts > 0): block i >= n_dense_layers, not in mlp_only_layers, with
    # (i + 1) % moe_layer_step == 0 (Qwen3-MoE's decoder_sparse_step and mlp_only_layers).
    moe_layer_step: int = 1
    mlp_only_layers: List[int] = field(default_factory=list)
    # Multi-head latent attention (DeepSeek-V2/V3, model.family=deepseek_v3; transformers' names).
    # Queries: dim -> q_lora_rank (RMSNorm) -> n_heads x (qk_nope_head_dim + qk_rope_head_dim),
    # or one dim -> heads projection when q_lora_rank is 0 (V2-Lite). Keys and values: dim ->
    # kv_lora_rank (RMSNorm) -> n_heads x (qk_nope_head_dim + v_head_dim), plus one shared RoPE
    # key of qk_rope_head_dim from dim. kv_lora_rank 0: not MLA (every other family).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE router scores: softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3: experts chosen on
    # score + e_score_correction_bias, weighted by the score, renormalised with norm_topk_prob,
    # times routed_scaling_factor).
    score_func: str = "softmax"
    routed_scaling_factor: float = 1.0
    # Group-limited routing: experts in n_group groups, each token picks topk_group groups first
    # (by the sum of each group's two best scores) and its top_k experts inside them. 1, 1: off.
    n_group: int = 1
    topk_group: int = 1
    # Aux-loss-free balancing (sigmoid routers): after each optimizer step every MoE layer's
    # e_score_correction_bias moves by bias_update_speed * sign(mean load - expert load); 0: off.
    bias_update_speed: float = 0.0
    # Weight of DeepSeek-V3's sequence-wise balance loss (sigmoid routers; replaces the Switch loss
    # of aux_loss_coef there).
    aux_loss_alpha: float = 0.0
    # DeepSeek-V3's multi-token prediction (launcher/models/mtp.py): mtp_layers sequential depths,
    # depth k predicting token i+k+1 from eh_proj([enorm(Emb(t_{i+k})); hnorm(h_i^{k-1})]), one
    # decoder block and the shared head (its own norm, then the main model's output layer). 0: none. The HF import reads it from num_nextn_predict_layers (1 in DeepSeek-V3's release).
    mtp_layers: int = 0
    # The MTP loss weight lambda by training tokens: [[from_tokens, weight], ...], the weight of
    # the last step whose from_tokens <= the tokens already trained; the loss added is
    # lambda / mtp_layers * sum over depths (DeepSeek-V3: 0.3 for the first 10T tokens, 0.1 after).
    mtp_loss_weights: List[Any] = field(default_factory=lambda: [[0.0, 0.3]])  # checked by validate.mtp_problems


@dataclass
class Fp8Config:
    recipe: str = "tensorwise"  # tensorwise | rowwise
    # Allow FP8 on hardware without FP8 tensor cores (CPU, A100): numerics only, slow.
    emulate: bool = False
    # FSDP2 all-gathers weights in float8 (tensorwise recipe only).
    all_gather: bool = True
    # Linear layers whose in/out features are not multiples of 16 or smaller than this stay bf16.
    min_features: int = 16
    # Module name fragments kept in bf16 (output layer, MoE router).
    exclude: List[str] = field(default_factory=lambda: ["output", "router"])


@dataclass
class PrecisionConfig:
    name: str = "bf16"  # fp32 | bf16 | fp8
    # Dtype of gradient reduction across data-parallel ranks.
    reduce_dtype: str = "fp32"
    fp8: Fp8Config = field(default_factory=Fp8Config)
    # fp32 runs on CUDA: matmuls on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32 and
    # cudnn.allow_tf32), as the planner costs them (hardware.tf32_tflops). false: full fp32 multiplies.
    tf32: bool = True


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: infer from world size
    tp: int = 1
    sp: bool = False  # sequence parallel (with tp > 1)
    pp: int = 1
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble | zbv
    pp_virtual_stages: int = 1  # model chunks per pipeline rank
    # Explicit layers per stage (length pp * pp_virtual_stages); empty = even split.
    pp_layers: List[int] = field(default_factory=list)
    # Pipeline micro-batches per step: always the gradient-accumulation steps (-1); any other
    # value must restate them (the rule lives in launcher/plan/decide/resolve.py).
    microbatches: int = -1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 3  # 0-3
    # FSDP2 gradient accumulation: auto | true | false. true keeps parameters and gradients
    # unsharded across the micro-batches of a step (one all-gather and one reduce-scatter per
    # step instead of per micro-batch); auto = true when it fits hardware.memory_gb (resolver).
    accumulate_unsharded: str = "auto"


@dataclass
class OffloadConfig:
    optimizer: str = "none"  # none | cpu | nvme
    params: str = "none"  # none | cpu | nvme
    nvme_path: str = ""
    pin_memory: bool = False


@dataclass
class ActivationCheckpointingConfig:
    mode: str = "none"  # none | selective | full
    # selective: "op" saves matmul outputs and recomputes the cheap ops; "op_alternate_mm" saves
    # every second matmul output of a block and recomputes the others (torchtitan's op policy);
    # an integer string N checkpoints every N-th block fully.
    selective: str = "op"


@dataclass
class CheckpointConfig:
    enabled: bool = True
    interval: int = 100  # steps; 0 disables periodic saving
    keep: int = 3
    resume: str = "auto"  # auto | none | <path to a checkpoint folder>
    dir: str = ""  # default: <run_dir>/checkpoints
    # Verify file checksums (crc32) before resuming; sizes are always checked.
    verify_checksums: bool = True
    save_final: bool = True
    # The node-local tier (launcher/checkpoint/local_tier.py): "" = off; else a folder on each
    # node's own disk (e.g. /tmp or NVMe) where every rank saves its state every local_interval
    # steps, with a replica on the next node; restart uses it when newer than the shared one.
    local_dir: str = ""
    local_interval: int = 10  # steps between node-local saves (checkpoint.interval stays the shared one's)
    export: str = "none"  # none | fp32 | safetensors | hf: consolidated export at the end
    # dtype of the checkpoint.export=hf weights (bf16 | fp16 | fp32 | fp8_block: 128x128-block e4m3
    # linears + float32 scales, the rest bf16, as DeepSeek-V3 is released); applies to the export only.
    export_dtype: str = "bf16"
    # checkpoint.async: training blocks only while a save is staged into host memory; DCP writes
    # it in the background and it is renamed into place when every rank's write is done (native
    # engine only). `async` is a Python keyword: the field is declared through the class namespace,
    # kept out of the generated __init__, __repr__ and __eq__ (whose code could not name it) and read with getattr(cfg, "async").
    __annotations__["async"] = "bool"
    vars()["async"] = field(default=False, init=False, repr=False, compare=False)

    @property
    def saves_async(self) -> bool:
        """checkpoint.async in effect: checkpoints on and `async` set (the one place that reads the keyword)."""
        return self.enabled and bool(getattr(self, "async"))

    def with_changes(self, **changes: Any) -> "CheckpointConfig":
        """dataclasses.replace that keeps `async`: replace() rebuilds through __init__, which an
        init=False field is not part of, so it would come back False. Use this, never replace()."""
        new = dataclasses.replace(self, **changes)
        setattr(new, "async", getattr(self, "async"))
        return new


# optim.implementation's values (launcher/engines/optim.py adamw_kernel_flags says what each does).
ADAMW_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")


# optim.muon.adjust_lr's values: torch.optim.Muon's adjust_lr_fn (docs/optimizers.md says which to pick).
MUON_ADJUST_LR = ("original", "match_rms_adamw")
# optim.groups[].optimizer's values.
OPTIMIZER_KINDS = ("adamw", "muon")


@dataclass
class MuonConfig:
    """Muon's own keys (optim=muon): the hidden matrices' optimizer. Defaults are torch.optim.Muon's
    except lr (docs/optimizers.md, "Defaults"): 0.02, Keller Jordan's for the "original" scaling."""

    lr: float = 0.02
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: List[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])
    adjust_lr: str = "original"  # original (sqrt(max(1, rows/cols))) | match_rms_adamw (0.2 sqrt(max(rows, cols)))


@dataclass
class OptimGroupConfig:
    """One entry of optim.groups: the parameters whose canonical name (the checkpoint's and the HF
    maps' name, without wrapper components) matches `match` (a regex, re.search) take `optimizer`
    with these lr / weight_decay (None: that optimizer's own, optim.lr or optim.muon.lr)."""

    match: str = MISSING
    optimizer: str = "adamw"  # adamw | muon
    lr: Optional[float] = None
    weight_decay: Optional[float] = None


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | muon (Muon for hidden matrices, AdamW for the rest: docs/optimizers.md)
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | linear | constant
    # AdamW's kernels: auto (fused on CUDA, as torchtitan; torch's default foreach/per-tensor
    # elsewhere) | fused | foreach | for_loop. Same update; fused reads each state once.
    implementation: str = "auto"
    muon: MuonConfig = field(default_factory=MuonConfig)
    # Parameter groups by canonical name, first match wins; a parameter no entry matches gets the
    # default of optim.name (launcher/plan/decide/optim_groups.py).
    groups: List[OptimGroupConfig] = field(default_factory=list)


@dataclass
class MixSourceConfig:
    """One source of a data mixture (data.mix / data.val_mix)."""

    path: str = MISSING  # an indexed dataset: a folder written by action=prepare, or a Megatron PREFIX/folder
    weight: float = 1.0  # relative share of samples (normalised over the mix; must be > 0)
    name: str = ""  # metric name (data/<name>/tokens, loss/<name>); "" = the path's last folder name


@dataclass
class DataConfig:
    # embedded: a text corpus generated in-package (no download);
    # tokens: memory-mapped token shards at `path`; text: raw text at `path` + `tokenizer`;
    # indexed: Megatron indexed datasets (.bin/.idx, e.g. written by action=prepare) at `path` or in `mix`.
    source: str = "embedded"
    path: str = ""
    dtype: str = "uint16"  # uint16 | uint32 (token shards)
    tokenizer: str = ""  # path to a local HF tokenizer.json (source=text); "" = bytes
    embedded_tokens: int = 2_000_000
    # Held-out data for trainer.val_every, read like `path` under `source`; "" with source=embedded:
    # the embedded corpus's validation split (launcher/data/heldout.py).
    val_path: str = ""
    # data.source=indexed: a weighted blend of indexed datasets (instead of data.path); every step's
    # share of each source is within one sample of weight x samples so far (launcher/data/mixture.py).
    mix: List[MixSourceConfig] = field(default_factory=list)
    # Held-out sources for per-source validation loss (val_loss/<name>); weights blend the batches.
    val_mix: List[MixSourceConfig] = field(default_factory=list)
    # Attention stays inside each document of a packed row (needs document boundaries: data.source=indexed).
    document_masking: bool = False
    # RoPE positions restart at 0 at each document start (and at each row start, as Megatron does).
    reset_positions: bool = False
    # action=plan warns when the planned steps would read a source more than this many times over.
    max_epochs: float = 1.0


@dataclass
class TrainerConfig:
    steps: int = 100
    # A token budget instead of a step count: when > 0, trainer.steps becomes
    # ceil(tokens / (global_batch_size * seq_len)) (launcher/config/loader.py) and the plan prints
    # the wall time, GPU-hours and cost to it.
    tokens: int = 0
    global_batch_size: int = 8
    micro_batch_size: int = 1
    seq_len: int = 2048
    grad_clip: float = 1.0
    seed: int = 1234
    log_every: int = 1
    compile: bool = False
    # Record measured peak memory per category (slow on CPU: a few tracked steps).
    track_memory: bool = False
    device: str = "auto"  # auto | cpu | cuda
    deterministic: bool = False
    # Hang watchdog (launcher/resilience/watchdog.py): seconds without a finished step before every
    # rank dumps its stacks into <run dir>/failure/ and the job fails. -1: auto (20 x the plan's
    # step time, at least 300 s); 0: off. Saves, validation, resume and the first steps have their own bound.
    hang_timeout_s: float = -1.0
    # Validation loss (val_loss, val_ppl) every val_every steps (0: off) over val_steps held-out global batches.
    val_every: int = 0
    val_steps: int = 2
    # Straggler warning: a rank busier than this x the other ranks' median for straggler_checks log
    # steps in a row (launcher/resilience/stragglers.py; one all-gather of one float per log step). 0: off.
    straggler_factor: float = 1.5
    straggler_checks: int = 3
    # What a straggler does: warn (log and run summary), exclude (every rank ends the attempt with a
    # failure naming its node, kind "straggler": the restart decision puts a spare in its place, or
    # excludes it from the requeued job), auto (exclude when cluster.spare_nodes > 0, else warn).
    straggler_action: str = "auto"
    # Pre-flight health check before the first step (and after each in-job restart):
    # launcher/resilience/preflight.py. auto: on for multi-node jobs (cluster.nodes > 1) | on | off.
    health_check: str = "auto"
    # A rank whose probe matmul takes over this x the other ranks' median, or whose all-reduce
    # bandwidth is under their median / this, names its node (as does a wrong matmul result).
    health_factor: float = 3.0
    # Numerical health (launcher/runtime/numerics.py): a step whose global gradient norm is NaN or
    # inf (a NaN loss makes it so) is skipped on every rank (weights, optimizer, LR schedule and
    # router biases untouched, its data consumed) and counted as health/skipped_steps; this many
    # skips in a row end the run with a failure summary (kind "nonfinite"). 0: never end it.
    max_skipped_steps: int = 5
    # Loss spikes (launcher/runtime/numerics.py): a logged loss over spike_zscore standard deviations
    # above the mean of the previous spike_window logged losses is logged as health/loss_spike=1.
    # 0: off.
    spike_zscore: float = 0.0
    spike_window: int = 50
    # What a spike does: log (health/loss_spike only) | rewind (every rank ends the attempt, kind
    # "spike"; the ranks start again from the newest checkpoint from before the spike's onset, newer
    # ones moved aside to abandoned_<time>/, and skip spike_skip_batches global batches from there;
    # null: the batches from that checkpoint through the spike). At most max_rewinds times per run,
    # each recorded in resilience.jsonl; they do not use cluster.max_restarts.
    on_spike: str = "log"
    spike_skip_batches: Optional[int] = None
    max_rewinds: int = 3
    # CUDA memory history for the first N steps of every run, dumped to failure/ on OOM (0: off).
    memory_snapshot_steps: int = 3
    # Rehearse (action=rehearse, the `rehearse` group's settings) before launching; abort when a
    # rank cannot be built or does not fit. The comparison is logged to W&B as a table.
    rehearse: bool = False


@dataclass
class WandbConfig:
    mode: str = "auto"  # auto (online if an API key is configured, else offline) | online | offline | disabled
    project: str = "launcher"
    entity: str = ""
    name: str = ""
    group: str = ""
    tags: List[str] = field(default_factory=list)
    # Seconds wandb.init may wait for the W&B server (wandb.Settings.init_timeout, wandb's own
    # default 90 s); past it, or on any start error, the run logs to W&B offline instead.
    init_timeout_s: float = 30.0
    # W&B's own console output at the end of a run (its history and summary tables) stays off; the
    # launcher prints one line saying where an offline run is and how to upload it. false shows it.
    quiet: bool = True


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True  # rich progress bar on rank 0
    level: str = "INFO"


@dataclass
class ClusterKeys:
    """The cluster.* keys every executor reads (launcher/launch/executor.py)."""

    name: str = "local"  # the executor: local | slurm
    nodes: int = 1
    gpus_per_node: int = 1  # local: number of ranks on this machine
    env: Dict[str, str] = field(default_factory=dict)
    # Names of environment variables forwarded to the job without writing their values.
    secret_env: List[str] = field(default_factory=lambda: ["WANDB_API_KEY", "HF_TOKEN"])
    # Shell lines a job script runs before the ranks start (executors without a script refuse them).
    setup: List[str] = field(default_factory=list)
    # Seconds a collective may wait for its peers before the process group fails it (torch's
    # default is 30 min, which holds a whole allocation when one node dies). Long single-rank
    # phases (checkpoint publish/prune, the folder lock, tokenizing, export) wait on a separate
    # group with a longer timeout (launcher/parallel/phase.py), so they never trip it.
    collective_timeout_s: int = 600
    # In-job restarts after a failure (a rank's exception or death, a hang the watchdog ends):
    # the executor starts the ranks again in the same allocation and they resume from the newest
    # checkpoint (docs/slurm.md, "Failures"). conf/cluster/slurm.yaml sets 3; locally 0.
    max_restarts: int = 0


@dataclass
class SlurmKeys:
    """The cluster.* keys only the SLURM executor reads (checked in launcher/config/slurm_keys.py)."""

    cpus_per_task: int = 0
    partition: str = ""
    account: str = ""
    qos: str = ""
    time: str = ""
    constraint: str = ""
    exclusive: bool = False
    mem: str = ""
    job_name: str = ""
    container: str = ""
    sbatch_args: List[str] = field(default_factory=list)
    signal_seconds: int = 120
    max_requeues: int = 3
    after: List[str] = field(default_factory=list)
    template: str = ""  # path to a user Jinja2 template; "" = slurm/sbatch.sh.j2
    dry_run: bool = False
    python: str = ""  # interpreter on the compute nodes; "" = the one running `train`
    # 0: derived from the job id (20000 + job_id % 20000) so that jobs sharing a node differ.
    rdzv_port: int = 0
    # When the ranks fail (a node died, a collective timed out) and requeues are left
    # (cluster.max_requeues), the job requeues itself; the rerun resumes from the newest
    # checkpoint. False: a failed job ends FAILED (resubmit by hand to resume).
    requeue_on_failure: bool = False
    # How the job finds its rendezvous host, the first node of the allocation:
    # "hostname" uses its SLURM node name (must resolve on the nodes); "nodeaddr" its NodeAddr
    # from `scontrol show node` (for sites whose node names do not resolve).
    rdzv_host_from: str = "hostname"
    # Extra nodes allocated beyond `nodes` (sbatch --nodes=nodes+spare_nodes): each srun step runs
    # on `nodes` of them, and a node a failure names is replaced by a spare in the next in-job
    # restart instead of requeueing (docs/slurm.md, "Failures").
    spare_nodes: int = 0


@dataclass
class ClusterConfig(SlurmKeys, ClusterKeys):
    """`cluster.*` as users type it: the common keys plus each executor's own, flat (an executor's
    keys are declared in its own dataclass above; a new executor adds its dataclass as a base)."""


def world_size(cluster: ClusterKeys) -> int:
    """Ranks in the job: the one place the world size is computed from the cluster keys (here, under
    both the planner and the config rules that need it, e.g. launcher/config/export_spec.py)."""
    return cluster.nodes * cluster.gpus_per_node


@dataclass
class HardwareConfig:
    name: str = "h100_sxm"
    memory_gb: float = 80.0
    # Dense peak FLOP/s (no sparsity).
    bf16_tflops: float = 989.0
    fp8_tflops: float = 1979.0
    fp8_supported: bool = True
    hbm_gbps: float = 3350.0
    nvlink_gbps: float = 450.0  # per GPU, one direction
    network_gbps: float = 50.0  # per GPU inter-node, one direction (400 Gb/s IB)
    gpus_per_node: int = 8
    # Fraction of peak a well-tuned dense matmul workload reaches (planner's compute time).
    achievable_fraction: float = 0.55
    # Fraction of link bandwidth a collective reaches.
    comm_efficiency: float = 0.75
    # GPU memory outside PyTorch's allocator: CUDA context, NCCL buffers, cuBLAS workspaces.
    reserved_gb: float = 2.0
    # Host <-> GPU bandwidth per GPU (PCIe), one direction; used for offload time.
    pcie_gbps: float = 25.0
    # Write bandwidth from one node to the checkpoint storage (GB/s, shared by the node's
    # ranks); predicts the save time of a stop (launcher/plan/estimate/checkpoint_time.py). The
    # default, 5 GB/s, is a conservative per-node share of a parallel file system (Lustre,
    # GPFS, WEKA); NFS often gives 1, local NVMe 5-10. Measure yours (`fio`/`dd`) and set it.
    storage_gbps: float = 5.0
    # Dense TF32 tensor-core peak: what precision=fp32 matmuls run at (torch's default
    # allow_tf32 for cuDNN, `torch.backends.cuda.matmul.allow_tf32` for matmuls). H100 SXM: 494.
    tf32_tflops: float = 494.0
    # Price of one GPU-hour on this cluster (your contract, cloud list price...): the plan turns
    # its GPU-hours into money with it. None: no cost line.
    usd_per_gpu_hour: Optional[float] = None


@dataclass
class BackendConfig:
    """`backend=auto|native|deepspeed` picks the default; per-feature keys override it."""

    default: str = "auto"
    sharding: str = ""  # data-parallel sharding / ZeRO
    offload: str = ""
    tp: str = ""
    pp: str = ""
    ep: str = ""
    cp: str = ""
    precision: str = ""
    activation_checkpointing: str = ""
    checkpoint: str = ""
    # DeepSpeed-only options.
    zeropp_quantized_weights: bool = False
    zeropp_quantized_gradients: bool = False
    zeropp_hierarchical_partition: int = 0  # hpZ secondary partition size (0 = off)
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    fp8_impl: str = "auto"  # auto | torchao | transformer_engine
    # Context parallelism (parallel.cp > 1): allgather (K/V gathered per layer; every device,
    # document masks) | ring (torch ring attention; CUDA, causal only) | auto (ring where it can
    # run, else allgather: launcher/plan/decide/cp_choice.py).
    cp_impl: str = "auto"


@dataclass
class PlanConfig:
    format: str = "text"  # text | json
    plots: bool = True
    top_k: int = 10  # action=search: how many layouts to print
    # action=search keeps only layouts whose estimate leaves this fraction of GPU memory free
    # (allocator fragmentation, what the model does not see).
    search_headroom: float = 0.05
    # action=search ranks layouts by: throughput (tokens/s per GPU), time (wall time of the training
    # steps to the budget, trainer.tokens or trainer.steps) or cost (USD to that budget: needs
    # hardware.usd_per_gpu_hour). Throughput, time and cost only order layouts differently when the
    # GPU count varies: see search_nodes.
    objective: str = "throughput"
    # action=search also tries these cluster.nodes values (empty: cluster.nodes only); each
    # layout's overrides then carry its cluster.nodes.
    search_nodes: List[int] = field(default_factory=list)
    # Mixture of experts under expert parallelism: the busiest EP rank's routed assignments over the
    # mean (1 = balanced, the default: what the rehearsal routes and what force-balanced benchmark
    # runs measure). The busiest rank's expert GEMMs and its share of the all-to-all set the pace
    # of every EP rank. From a run: its `moe/tokens_per_expert_max_over_mean` (per expert, so an
    # upper bound of the per-rank figure; docs/planner.md "Mixture of experts").
    moe_imbalance: float = 1.0


@dataclass
class ProfileConfig:
    """torch.profiler traces (launcher/observe/profiler.py) into <run dir>/profile/rank_<r>/."""

    enabled: bool = False
    steps: List[int] = field(default_factory=lambda: [10, 12])  # [first, last], inclusive
    ranks: List[int] = field(default_factory=list)  # empty: rank 0 and the last pipeline rank
    record_memory: bool = False  # heavy: allocation events in the trace
    with_stack: bool = False  # heavy: Python stacks per op


@dataclass
class RehearseConfig:
    """action=rehearse: build each chosen rank's real model part(s) on a fake process group."""

    ranks: Any = "auto"  # auto (one per distinct shard shape) | all | a list of global ranks
    workers: int = 2  # rehearsal subprocesses at a time (one per rank, each its own process)
    # A tracked fake-tensor training step per distinct rank for the activation peak (false: states only;
    # with tensors=real: no MemTracker step, the timings and the GPU's peaks are still measured).
    activations: bool = True
    # Where the ranks' tensors live: cpu | cuda (the local GPU; needs tensors=real).
    device: str = "cpu"
    # fake: FakeTensors (shapes, no storage: any model size on a CPU) | real: real tensors on
    # `device`, one rank at a time, with timed warm-up and measured steps (launcher/rehearse/real.py).
    tensors: str = "fake"
    # tensors=real on a GPU other than the plan's `hardware` entry: run anyway, figures labelled
    # with the GPU they ran on (false: exit 2).
    allow_other_gpu: bool = False
    warmup_steps: int = 1  # tensors=real: untimed steps first (optimizer states, allocator, kernels' first call)
    timed_steps: int = 3  # tensors=real: steps timed (their mean is reported)


@dataclass
class PrepareConfig:
    """action=prepare: raw local files -> Megatron indexed shards + manifest.json (launcher/data/prepare.py)."""

    input: str = ""  # a file, a folder (searched recursively) or a glob of .jsonl .jsonl.gz .jsonl.zst .parquet .txt
    output: str = ""  # the dataset folder (what data.path or a data.mix entry's path then takes)
    # A local tokenizer.json, or a Hugging Face folder with tokenizer.json (+ tokenizer_config.json
    # for eos_token / bos_token / add_bos_token); never downloaded.
    tokenizer: str = ""
    # The token that ends every document ("": tokenizer_config.json's eos_token). An instruct
    # tokenizer's config names its end-of-turn token (Qwen3's <|im_end|>); pretraining wants <|endoftext|>.
    eos_token: str = ""
    text_key: str = "text"  # the JSON key / parquet column holding each document's text
    workers: int = 0  # tokenizer processes; 0 = every core this process may use
    # About this many tokens per shard (documents are never split, so a shard may run over by
    # one document); also the resume granularity after a kill.
    shard_tokens: int = 250_000_000
    on_bad_record: str = "fail"  # fail (exit 2 naming the file and line) | skip (counted per file)


@dataclass
class EvalConfig:
    """Downstream evaluation in the training loop with lm-eval's tasks (launcher/eval/, docs/evaluation.md).

    Needs the optional extra `launcher[eval]` (lm-evaluation-harness) when `tasks` is set."""

    # lm-eval task names (its registry, or the `task:` names of YAMLs under include_path); empty: off.
    tasks: List[str] = field(default_factory=list)
    every: int = 0  # evaluate every N training steps (0: off)
    limit: int = 0  # documents per task (0: all of them)
    # Folders of your own task YAMLs (`dataset_path: json` + local data_files run offline); with it,
    # only those folders are indexed (lm-eval's built-in registry is not).
    include_path: List[str] = field(default_factory=list)
    num_fewshot: int = 0  # few-shot examples per document, drawn with a fixed seed (FEWSHOT_SEED)
    # Tokens per forward call on each data-parallel rank (0: one training micro-batch per
    # accumulation step, as the training step: micro_batch_size x seq_len x microbatches).
    batch_tokens: int = 0
    # A Hugging Face tokenizer folder ('' = the tokenizer recorded in data.path's manifest.json,
    # else model.init_from's folder).
    tokenizer: str = ""
    # Per-checkpoint evaluation jobs (launcher/launch/eval_job.py): heavy suites run by lm-eval's own
    # HF backend on an HF export of a saved checkpoint, off the training allocation; results go
    # to <run dir>/eval.jsonl and W&B (eval_job/<task>/<metric> at eval_job/step).
    on_checkpoint: List[str] = field(default_factory=list)  # lm-eval task names for those jobs
    job: bool = False  # submit them (SLURM: a one-node job per checkpoint; local: after training)
    job_every: int = 1  # every k-th checkpoint: steps that are multiples of checkpoint.interval x k, and the last


@dataclass
class RunConfig:
    # The run's identity: its checkpoints live in outputs/runs/<name>/checkpoints, so rerunning a
    # command finds them. "" = derived on the host from the recipe (else model.name) and a hash of
    # what is trained (launcher/config/run_identity.py says which keys count).
    name: str = ""


@dataclass
class JobConfig:
    """The whole job, as composed by Hydra from conf/train.yaml."""

    # run | plan | search | rehearse | export (checkpoint.resume -> checkpoint.export, no training)
    # | prepare (prepare.input -> a tokenized dataset at prepare.output; no model, no GPU)
    action: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    run: RunConfig = field(default_factory=RunConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    rehearse: RehearseConfig = field(default_factory=RehearseConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def set_dotted(spec: "JobConfig", key: str, value: Any) -> None:
    """Set `spec.a.b.c = value` for key "a.b.c" (KeyError for a key the schema does not have).

    For code that builds a JobConfig without Hydra (docs generator, search tests, harnesses).
    """
    *path, last = key.split(".")
    obj: Any = spec
    for part in path:
        obj = getattr(obj, part)
    if not hasattr(obj, last):
        raise KeyError(key)
    setattr(obj, last, value)


def get_dotted(spec: Any, key: str) -> Any:
    """`spec.a.b.c` for key "a.b.c" (AttributeError for a key the object does not have)."""
    obj = spec
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def replaced_dotted(spec: Any, values: Dict[str, Any]) -> Any:
    """A copy of `spec` with each dotted key set to its value, built with dataclasses.replace so
    the groups it does not touch are shared and `spec` is left as it was (the search builds one
    such spec per candidate layout). KeyError for a key the schema does not have."""
    groups: Dict[str, Dict[str, Any]] = {}
    top: Dict[str, Any] = {}
    for key, value in values.items():
        head, _, rest = key.partition(".")
        if not hasattr(spec, head):
            raise KeyError(key)
        if rest:
            groups.setdefault(head, {})[rest] = value
        else:
            top[head] = value
    for head, inner in groups.items():
        top[head] = replaced_dotted(getattr(spec, head), inner)
    return dataclasses.replace(spec, **top)
