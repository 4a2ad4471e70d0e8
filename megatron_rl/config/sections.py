"""Typed sections of a megatron-rl job config (the YAML file), one dataclass per section.

    model:      megatron_rl.models.ModelConfig            (architecture; or taken from actor.load_hf)
    parallel:   megatron_rl.parallel.ParallelConfig       (Megatron's names)
    rollout:    RolloutConfig        (engine, sampling)
    data:       DataConfig           (task / prompts, reward)
    algorithm:  AlgorithmConfig      (advantages, rollout_correction in verl's keys)
    actor:      ActorConfig          (optimizer, micro-batching, policy_loss)
    trainer:    TrainerConfig        (steps, seed, run dir, checkpoints, metric sinks)

Every setting lives in exactly one place: the loss type is ``algorithm.rollout_correction.loss_type``
(verl's key), the temperature is ``rollout.temperature`` (the trainer divides its logits by it too).
Field checks are in :func:`megatron_rl.config.validate.validate_job`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from megatron_rl.correction import RolloutCorrectionConfig
from megatron_rl.losses import PolicyLossConfig


@dataclass
class RolloutConfig:
    """How responses are generated (and with which sampling settings the log-probs are scored)."""

    engine: str = "embedded"
    """"embedded": in-process bf16 generation from the actor's weights (no server; the CPU default).
    "sglang": HTTP to SGLang servers (``sglang_urls``, or one started locally with ``sglang_launch``)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer scores log_softmax(logits / temperature), as SGLang does."""
    top_p: float = 1.0
    """Nucleus sampling mass (SGLang log-probs are not renormalised by it; neither are ours)."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    max_new_tokens: int = 16
    """Maximum response length in tokens."""
    n_samples_per_prompt: int = 4
    """Responses per prompt (the GRPO group size; >= 2 for group-normalised advantages)."""
    dtype: str = "bfloat16"
    """Compute dtype of the embedded engine ("bfloat16" reproduces a real rollout mismatch)."""
    sglang_urls: List[str] = field(default_factory=list)
    """Base URLs of running SGLang servers or a router, e.g. ["http://10.0.0.5:30000"]."""
    sglang_launch: bool = False
    """Start one local SGLang server for the run (development; on CPU with the CPU stand-ins)."""
    sglang_port: int = 30000
    """Port of the locally launched server (127.0.0.1)."""
    request_timeout_s: float = 120.0
    """Per-request HTTP timeout."""
    max_retries: int = 3
    """Retries (exponential backoff) on connection errors, timeouts and 5xx before failing the step."""
    weight_sync_dir: Optional[str] = None
    """Where HF exports for /update_weights_from_disk go (default: <run_dir>/weight_sync)."""


@dataclass
class DataConfig:
    """Prompts and rewards."""

    task: str = "copy"
    """Built-in verifiable task ("copy", "reverse", "sort", "add") or "file" to read ``path``."""
    path: Optional[str] = None
    """JSONL or Parquet prompt file (task: file); one record per prompt."""
    prompt_key: str = "prompt"
    """Record field holding the prompt text (or a list of token ids)."""
    answer_key: str = "answer"
    """Record field passed to the reward function as the reference answer."""
    reward_fn: Optional[str] = None
    """"module:function" computing a reward from (prompt, response, answer); default: the task's own."""
    prompts_per_step: int = 8
    """Prompts per training step (global, over all data-parallel ranks)."""
    task_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Options of the built-in task (e.g. {"min_digits": 1, "max_digits": 4})."""


@dataclass
class AlgorithmConfig:
    """Advantage estimation and the rollout correction."""

    advantage_estimator: str = "grpo"
    """"grpo": (r - group mean) [/ group std]; "rloo": r - mean of the other samples of the group."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's standard deviation (+1e-6)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig.decoupled_token_is)
    """verl's ``algorithm.rollout_correction`` block (or ``{preset: name, ...}``); see README."""


@dataclass
class ActorConfig:
    """The Megatron actor: optimizer, micro-batching, loss."""

    lr: float = 1e-4
    """Adam learning rate (constant)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    clip_grad: float = 1.0
    """Global gradient-norm clipping (0 disables)."""
    micro_batch_size: int = 4
    """Sequences per micro-batch (forward / backward through the pipeline schedule)."""
    ppo_mini_batches: int = 1
    """Optimizer steps per rollout batch (the batch is split into this many mini-batches)."""
    ppo_epochs: int = 1
    """Passes over the rollout batch."""
    load_hf: Optional[str] = None
    """Initialise from this HF checkpoint directory (its config.json supplies ``model`` if omitted)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Clip ratios, dual-clip, aggregation mode, KL loss (loss_type comes from rollout_correction)."""


@dataclass
class TrainerConfig:
    """The loop: length, seeds, output, checkpoints, metric sinks."""

    steps: int = 20
    """Training steps (one rollout batch each)."""
    seed: int = 1234
    """Seed of data, sampling and model init (runs are reproducible on CPU)."""
    run_dir: str = "runs/default"
    """Output directory: metrics.jsonl, checkpoints/, rollouts, TensorBoard events."""
    save_interval: int = 0
    """Checkpoint every N steps (0: only at the end and on SIGTERM / SIGINT)."""
    resume: bool = False
    """Resume from the newest checkpoint in run_dir/checkpoints."""
    tensorboard: bool = False
    """Also write TensorBoard events (needs the tensorboard extra)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb extra; offline unless WANDB_MODE says otherwise)."""
    wandb_project: str = "megatron-rl"
    """W&B project name."""
    dump_rollouts: bool = False
    """Write every step's rollouts to run_dir/rollouts.jsonl (the ``megatron-rl score`` format)."""
    progress: bool = True
    """Progress bar and compact metric table on the console (rank 0)."""
    collective_timeout_s: float = 1800.0
    """Process-group timeout (gloo / NCCL): a collective that waits longer raises on that rank. Ranks wait
    in a broadcast while rank 0 generates rollouts, so it must exceed the longest rollout phase."""
    phase_timeout_s: float = 1800.0
    """Watchdog: one phase of a step (rollout, logprob, train, weight_sync, metrics) running longer ends
    the rank with the phase named and its stacks printed; torchrun then stops the job (0: no limit)."""
    checkpoint_timeout_s: float = 1800.0
    """Watchdog limit of one checkpoint save (0: no limit). A save that fails or times out is never marked
    COMPLETE; the previous COMPLETE checkpoint stays the one ``--resume`` loads."""
    stop_timeout_s: float = 900.0
    """After the first SIGTERM / SIGINT, seconds a rank may take to finish its step and checkpoint before it
    exits without one (0: no limit). A second signal exits at once."""
