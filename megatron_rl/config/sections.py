"""Typed sections of a megatron-rl job config (the YAML file), one dataclass per section.

    cluster:    ClusterConfig        (device, nodes, GPUs per node, GPU memory the file is written for)
    model:      megatron_rl.models.ModelConfig            (architecture; or taken from actor.load_hf)
    parallel:   megatron_rl.parallel.ParallelConfig       (Megatron's names)
    rollout:    RolloutConfig        (engine, sampling)
    data:       DataConfig           (task / prompts, reward)
    multi_turn: MultiTurnConfig      (environment, turn and token limits of multi-turn rollouts)
    algorithm:  AlgorithmConfig      (advantages, rollout_correction and filter_groups in verl's keys)
    actor:      ActorConfig          (optimizer, micro-batching, policy_loss)
    trainer:    TrainerConfig        (steps, seed, run dir, checkpoints, metric sinks)

Every setting lives in exactly one place: the loss type is ``algorithm.rollout_correction.loss_type``
(verl's key), the temperature is ``rollout.temperature`` (the trainer divides its logits by it too).
Field checks are in :func:`megatron_rl.plan.validate_job`. Path-valued fields are marked with
``path_field`` and resolved once, where the file is loaded (:mod:`megatron_rl.config.paths`).
"""
from __future__ import annotations

import os

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from megatron_rl.algo.kl_reward import KLControlConfig
from megatron_rl.config.paths import HUB, IMPORT, path_field
from megatron_rl.correction import RolloutCorrectionConfig
from megatron_rl.losses import PolicyLossConfig
from megatron_rl.lora.config import LoraConfig


#: GPU memory (GiB) ``check`` plans a CUDA job against when ``cluster.gpu_memory_gb`` is not set, and what
#: ``migrate verl`` writes (verl has no such key): an 80 GB A100 / H100. Said so wherever it is used.
DEFAULT_GPU_MEMORY_GB = 80.0


@dataclass
class ClusterConfig:
    """The machines the file is written for: ``megatron-rl check`` plans this job (flags override it) and
    the launch hints use it. The trainer itself runs at the world size torchrun / srun gives it."""

    device: str = "cuda"
    """"cuda" (one rank per GPU, NCCL) or "cpu" (gloo ranks, fp32; what tiny_cpu.yaml runs)."""
    nodes: int = 1
    """Nodes of the job (world size = nodes x gpus_per_node)."""
    gpus_per_node: int = 8
    """Ranks per node: GPUs per node, or processes per node when device is "cpu"."""
    gpu_memory_gb: Optional[float] = None
    """Memory per GPU in GiB that ``megatron-rl check`` compares its plan with (None: a CUDA job is checked against
    ``DEFAULT_GPU_MEMORY_GB``, said so; a CPU job gets no fit verdict)."""

    @property
    def world_size(self) -> int:
        """nodes x gpus_per_node."""
        return self.nodes * self.gpus_per_node


@dataclass
class ValKwargsConfig:
    """How validation responses are sampled (verl's ``actor_rollout_ref.rollout.val_kwargs``): greedy by default
    (``do_sample: false``), or sampled with these settings; the response budget is ``rollout.max_new_tokens``."""

    do_sample: bool = False
    """Sample with ``temperature`` / ``top_p`` / ``top_k``; false: greedy (argmax), whatever the temperature."""
    temperature: float = 0.0
    """Sampling temperature when ``do_sample`` (> 0 then)."""
    top_p: float = 1.0
    """Nucleus sampling mass when ``do_sample``."""
    top_k: int = -1
    """Top-k when ``do_sample`` (-1 = off)."""
    n: int = 1
    """Responses per validation prompt (greedy: 1)."""

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "ValKwargsConfig":
        """Build from the (checked) keys of the YAML block; an empty or null block is the default (greedy)."""
        return cls(**(d or {}))

    def errors(self) -> List[str]:
        """Violations, each naming its dotted key."""
        key, errs = "rollout.val_kwargs", []
        if self.do_sample and not self.temperature > 0:
            errs.append(f"{key}.temperature: must be > 0 when do_sample is true, got {self.temperature} (greedy: "
                        f"do_sample: false)")
        if self.temperature < 0:
            errs.append(f"{key}.temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            errs.append(f"{key}.top_p: must be in (0, 1], got {self.top_p}")
        if not (self.top_k == -1 or self.top_k >= 1):
            errs.append(f"{key}.top_k: must be -1 (off) or >= 1, got {self.top_k}")
        if self.n < 1:
            errs.append(f"{key}.n: must be >= 1, got {self.n}")
        elif self.n > 1 and not self.do_sample:
            errs.append(f"{key}.n: {self.n} greedy responses per prompt are all the same; set n: 1 or do_sample: "
                        f"true")
        return errs


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
    weight_sync_dir: Optional[str] = path_field(None)
    """Where HF exports for /update_weights_from_disk go (default: <run_dir>/weight_sync)."""
    weight_sync: str = "auto"
    """How weights reach the engine after each step (megatron_rl/weight_sync/): "disk" (HF export
    + reload; full model on rank 0), "tensor" (buckets in memory: in process for the embedded engine,
    /update_weights_from_tensor for an SGLang server on the senders' host), "distributed" (SGLang: buckets
    broadcast over a gloo / NCCL group per sender, /update_weights_from_distributed). In memory, every
    pipeline stage's and expert-parallel rank's shard owner sends its own tensors, in parallel.
    "auto": tensor for embedded, distributed for SGLang, disk for SGLang in mode async (where tensor and
    distributed are accepted too: the producer loads rank 0's copy of the version between segments)."""
    weight_sync_bucket_mb: float = 512.0
    """Bucket size of the in-memory modes in MiB: peak extra host memory of a sync is about one bucket plus
    the parameter being gathered (a larger parameter travels alone)."""
    weight_sync_verify_interval: int = 1
    """Verify the engine's weights after every N-th version (checksums of sampled engine tensors — fused,
    padded and per TP rank as the engine holds them — compared with the trainer's; a mismatch fails the step
    naming the tensors). 0 = never. Every mode, sync and async (docs/weight_sync.md)."""
    weight_sync_verify_tensors: int = 16
    """Engine tensors compared per verification, spread over the whole model (every pipeline stage) and
    rotated by version; -1 = every tensor the engine can report (weight_sync/verified_param_frac 1)."""
    weight_sync_timeout_s: float = 600.0
    """Bound of each weight-sync request to a server, retries included (a bucket, the group set-up, a disk
    load, the weight checksums), and of rank 0's wait for every sender to finish (a sender that has not by
    then is named and the version aborted)."""
    weight_sync_delta: bool = False
    """weight_sync tensor (the embedded engine; SGLang servers on the trainer's host): per HF tensor, send only
    the elements whose bits changed since the version the engine holds (positions + values; the whole tensor
    when that is smaller), applied exactly (the engine's
    weights equal a full sync's bit for bit). The first version, and the one after a failed or skipped version,
    is a full sync. Costs a copy of each sender's own HF tensors (engine dtype) in its host memory (none on the
    GPU), and with SGLang a copy of the whole model in the host memory of each server TP process (TP copies per
    server); ``megatron-rl check`` prints both (docs/weight_sync.md#delta-sync)."""
    weight_sync_master_address: Optional[str] = None
    """distributed: the address SGLang servers use to reach trainer rank 0 (default: the address of this
    host's interface that routes to the servers; 127.0.0.1 when every server is on loopback). Other
    senders always use the address of their own host's interface that routes to the servers."""
    lora_sync: str = "merged"
    """With ``actor.lora``: "merged" -- the sender merges W + (alpha/rank)·B·A (fp32, cast once to the engine
    dtype) and the weight_sync mode carries it (delta sync and verification as without LoRA); "adapter" -- only
    A and B travel (verl's ``lora.merge: false``); docs/lora.md#weight-sync."""
    mode: str = "sync"
    """"sync": generate, then train, then sync weights, in sequence. "async": rank 0 generates the next
    steps' rollouts in a background thread while the trainer trains (megatron_rl/trainer/async_rollout.py);
    "sync" is "async" with max_staleness 0 and gives the same results."""
    max_staleness: int = 1
    """async: step t's rollouts come from weights of version max(t - max_staleness, start) (the version
    after that many training steps); no trained token is older than this many versions. 1 = one step off."""
    partial_rollout: str = "finish"
    """async: "finish" — a generation in flight at a weight update finishes on the weights it started with
    (bit-reproducible); "interrupt" — generation runs in segments of segment_tokens and unfinished rows
    continue on the newest published weights (every token tagged with its version; timing-dependent)."""
    segment_tokens: int = 0
    """partial_rollout "interrupt": tokens per segment (>= 1 and < max_new_tokens to have an effect)."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """Sampling of the validation responses (``trainer.test_freq``): greedy by default."""


@dataclass
class DataConfig:
    """Prompts and rewards."""

    task: str = path_field("copy", kind=IMPORT)
    """Built-in verifiable task ("copy", "reverse", "sort", "add"), the multi-turn "lookup" tool task, "file" to
    read ``path``, or your own task by import path, ``"module:factory"`` / ``"file.py:factory"``, called as
    ``factory(tokenizer, **task_kwargs)`` and returning a ``megatron_rl.tasks.Task`` (docs/extending.md)."""
    path: Optional[str] = path_field(None)
    """JSONL or Parquet prompt file (task: file): verl's RL format (``data_source``, ``prompt`` as chat
    messages, ``reward_model: {style, ground_truth}``, ``extra_info``) or ``prompt_key`` / ``answer_key`` rows."""
    prompt_key: str = "prompt"
    """Record field holding the prompt: text, a list of chat messages ({role, content}), or token ids."""
    answer_key: str = "answer"
    """Record field holding the reference answer when the row has no ``reward_model.ground_truth``."""
    reward_fn: Optional[str] = path_field(None, kind=IMPORT)
    """"math" (math-verify), "exact", or "module:function" (returning a float, or verl's dict whose "score" is
    the reward and whose other numeric keys are logged and filter signals); default: the task's own (files:
    verl's dispatch on ``data_source`` with verl's scorers, exact match for rows without one; docs/datasets.md)."""
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the reward function (e.g. {extract: [boxed, hash, last_number]} for math)."""
    reward_workers: int = 2
    """Worker processes scoring file-task rewards in parallel (0: in the trainer's process, no timeout)."""
    reward_timeout_s: float = 10.0
    """Wall-clock limit of one sample's reward; past it the worker is killed and the reward is 0 (counted)."""
    max_reward_failure_frac: float = 0.5
    """A step where more than this fraction of the rewards failed or timed out (scored 0) ends the job with
    the cause named, before the step trains (1.0: never)."""
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra arguments of ``tokenizer.apply_chat_template`` for chat prompts (e.g. {enable_thinking: false})."""
    max_prompt_length: Optional[int] = None
    """Longest prompt in tokens after the chat template (None: no limit); see ``overlong_prompts``."""
    overlong_prompts: str = "filter"
    """Prompts longer than ``max_prompt_length``: "filter" (dropped) or "truncate" (keep the last tokens)."""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong penalty: responses longer than max_new_tokens - this lose up to
    ``overlong_penalty_factor`` reward, linearly (0: off), added to the scorer's value on its scale (verl's
    math_dapo: +-1; docs/datasets.md)."""
    overlong_penalty_factor: float = 1.0
    """The reward a response of exactly max_new_tokens tokens loses under the overlong penalty."""
    prompts_per_step: int = 8
    """Prompts per training step (global, over all data-parallel ranks)."""
    task_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Options of the built-in task (e.g. {"min_digits": 1, "max_digits": 4})."""
    val_files: Union[str, List[str], None] = path_field(None)
    """Validation set: JSONL / Parquet files read as ``path`` is (verl's RL format or prompt / answer rows; a
    single path is a one-file list), evaluated every ``trainer.test_freq`` steps, never trained on."""
    val_heldout: bool = False
    """Validation set: the built-in task's held-out prompts (``task_kwargs.heldout_frac`` > 0), which training
    never draws; together with ``val_files`` both are evaluated."""
    val_max_samples: int = -1
    """Validation prompts at most, the first of each set in file / split order (-1: all)."""

    @property
    def val_paths(self) -> List[str]:
        """``val_files`` as a list (a single path is a one-file list; unset: none)."""
        v = self.val_files
        return [] if v is None else [v] if isinstance(v, str) else list(v)

    def errors(self) -> List[str]:
        """Violations of the reward / prompt-length / overlong / validation settings, each naming its dotted key."""
        errs = []
        if not (self.val_max_samples == -1 or self.val_max_samples >= 1):
            errs.append(f"data.val_max_samples: must be -1 (all) or >= 1, got {self.val_max_samples}")
        for path in self.val_paths:
            if not os.path.isfile(path):
                errs.append(f"data.val_files: {path!r} does not exist or is not a file")
        if self.val_heldout and self.task == "file":
            errs.append("data.val_heldout: data.task 'file' has no held-out split; give the validation prompts in "
                        "data.val_files")
        elif self.val_heldout and not self.task_kwargs.get("heldout_frac"):
            errs.append("data.val_heldout: needs data.task_kwargs.heldout_frac > 0 (the fraction of the task's "
                        "prompts held out of training)")
        rf = self.reward_fn
        if rf is not None and rf not in ("math", "exact") and (":" not in rf or not all(rf.rpartition(":")[::2])):
            errs.append(f"data.reward_fn: expected 'math', 'exact' or 'module:function', got {rf!r}")
        if self.reward_workers < 0:
            errs.append(f"data.reward_workers: must be >= 0, got {self.reward_workers}")
        if not self.reward_timeout_s > 0:
            errs.append(f"data.reward_timeout_s: must be > 0, got {self.reward_timeout_s}")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            errs.append(f"data.max_prompt_length: must be >= 1 (or null), got {self.max_prompt_length}")
        if self.overlong_prompts not in ("filter", "truncate"):
            errs.append(f"data.overlong_prompts: {self.overlong_prompts!r} is not one of filter, truncate")
        if self.overlong_buffer_len < 0:
            errs.append(f"data.overlong_buffer_len: must be >= 0, got {self.overlong_buffer_len}")
        if self.overlong_penalty_factor < 0:
            errs.append(f"data.overlong_penalty_factor: must be >= 0, got {self.overlong_penalty_factor}")
        return errs




@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts (megatron_rl/rollout/multi_turn.py): the model and an environment take turns; only
    the model's tokens are trained on. ``env: null`` keeps single-turn prompt -> response."""

    env: Optional[str] = path_field(None, kind=IMPORT)
    """The environment class, "module:Class" or "path/to/file.py:Class" (a megatron_rl.envs.Environment
    subclass); null: single turn."""
    env_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment class (each worker builds ``Class(**env_kwargs)``)."""
    max_turns: int = 4
    """Model turns per trajectory at most (finish "max_turns")."""
    max_total_tokens: int = 0
    """Response tokens per trajectory at most, model and environment tokens counted (finish "max_tokens";
    0: rollout.max_new_tokens * max_turns)."""
    max_tokens_per_turn: int = 0
    """Tokens one model turn may sample (0: rollout.max_new_tokens); a turn cut there without a stop token ends
    the trajectory (finish "length")."""
    env_step_timeout_s: float = 30.0
    """Wall-clock limit of one environment call (reset or step); past it the worker is killed and replaced,
    the trajectory ends (finish "env_error", reward 0, counted as env_timeout)."""
    env_workers: int = 2
    """Environment worker processes (0: in the trainer's process, no timeout: debugging)."""
    observation_template: str = "\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"
    """Chat markup around an observation, tokenized once and appended after the model's turn (which ends with
    its stop token): "{observation}" is replaced by the environment's text; the rest closes the tool / user
    turn and opens the next assistant turn."""


FILTER_GROUPS_METRICS = ("seq_reward", "seq_final_reward", "score")
"""The per-row values of the batch ``algorithm.filter_groups.metric`` compares within a group; any other name is a
key of a dict reward (checked at the first generation round: ``trainer/dynamic_sampling.metric_values``)."""
FILTER_GROUPS_EXHAUSTED = ("train", "skip", "error")
"""What a step does when its rounds found too few groups with signal (``algorithm.filter_groups.on_exhausted``)."""


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling, verl's ``algorithm.filter_groups`` (megatron_rl/trainer/dynamic_sampling.py): a
    prompt group whose samples all scored alike has advantage 0 for every sample (no learning signal); such
    groups are dropped and more prompts are generated, round after round, until ``data.prompts_per_step`` groups
    with signal fill the batch."""

    enable: bool = False
    """Drop the groups whose samples all have the same ``metric`` and generate more prompts to fill the batch."""
    metric: Optional[str] = "seq_reward"
    """What must differ within a group: "seq_reward" (the reward the advantages use, overlong penalty included;
    verl's "seq_final_reward" is the same here: ``use_kl_in_reward`` is refused with dynamic sampling) or "score" (the
    verifier's reward before the overlong penalty) or a numeric key other than "score" of a reward that returns a
    dict, as verl's do ("acc" of verl's math_dapo scorer and DAPO-style reward files; a float reward's "acc" is
    its score, as verl's DAPO reward manager records it): checked at the first generation round
    (``FilterMetricError`` naming the keys the reward returned). null (verl's default block, disabled) only
    without ``enable``."""
    max_num_gen_batches: int = 10
    """Generation rounds per step at most (each draws ``prompts_per_round`` fresh prompts); >= 1 (verl's
    0 = unlimited is refused: a task whose groups all score alike would generate forever; accepted only without
    ``enable``, as verl's disabled default block has it). The rollout phase's bounds scale with it:
    ``trainer.phase_timeout_s`` and ``trainer.collective_timeout_s`` (the other ranks' wait) per round, and an
    async checkpoint's drain, half of ``trainer.checkpoint_timeout_s`` per round."""
    on_exhausted: str = "train"
    """When ``max_num_gen_batches`` rounds found fewer groups with signal than the batch needs (always with a
    ``FilterGroupsExhaustedWarning``): "train" -- train on them, the batch topped up with groups without signal
    (advantage 0) to ``data.prompts_per_step`` groups; "skip" -- the step trains nothing (no optimizer step;
    the unchanged weights are published as the next version); "error" -- the job ends with
    ``FilterGroupsExhaustedError`` (verl's behaviour)."""
    prompts_per_round: Optional[int] = None
    """Prompts each generation round draws (verl's ``data.gen_batch_size``); null: ``data.prompts_per_step``.
    Rounds go on until ``data.prompts_per_step`` groups with signal are found; the batch is the first of them."""

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "FilterGroupsConfig":
        """Build from the (checked) keys of the YAML block; an empty or null block is the default (off)."""
        return cls(**(d or {}))

    def errors(self, dict_rewards: bool = True) -> List[str]:
        """Violations, each naming its dotted key (checked whether or not ``enable`` is set, except verl's disabled
        defaults: ``metric`` null and ``max_num_gen_batches`` <= 0 pass without ``enable``). ``dict_rewards``
        False: the job's rewards are floats (a built-in task or reward, multi-turn), so ``metric`` must be one of
        ``FILTER_GROUPS_METRICS``."""
        errs = []
        key = "algorithm.filter_groups"
        if self.metric is None:
            if self.enable:
                errs.append(f"{key}.metric: null; dynamic sampling needs one of {', '.join(FILTER_GROUPS_METRICS)}")
        elif not isinstance(self.metric, str) or not self.metric.strip() or self.metric != self.metric.strip():
            errs.append(f"{key}.metric: {self.metric!r} is not one of {', '.join(FILTER_GROUPS_METRICS)} nor the name "
                        f"of a key a dict reward returns (e.g. acc)")
        elif self.metric not in FILTER_GROUPS_METRICS + ("acc",) and not dict_rewards:
            errs.append(f"{key}.metric: {self.metric!r} is not one of {', '.join(FILTER_GROUPS_METRICS)}, acc; a "
                        f"reward key other than acc needs a reward that returns a dict (data.task: file with data.reward_fn "
                        f"unset or 'module:function', single-turn), and this job's rewards are floats")
        if self.max_num_gen_batches < 1 and self.enable:
            errs.append(f"{key}.max_num_gen_batches: must be >= 1, got {self.max_num_gen_batches} (verl's 0 = "
                        f"unlimited is not offered: a task whose groups all score alike would generate forever)")
        if self.prompts_per_round is not None and self.prompts_per_round < 1:
            errs.append(f"{key}.prompts_per_round: must be >= 1 (or null: data.prompts_per_step), got "
                        f"{self.prompts_per_round}")
        if self.on_exhausted not in FILTER_GROUPS_EXHAUSTED:
            errs.append(f"{key}.on_exhausted: {self.on_exhausted!r} is not one of "
                        f"{', '.join(FILTER_GROUPS_EXHAUSTED)}")
        return errs


def round_prompts(algorithm: "AlgorithmConfig", data: DataConfig) -> int:
    """Prompts one draw takes: ``algorithm.filter_groups.prompts_per_round`` with dynamic sampling when set, else
    ``data.prompts_per_step`` (a round of a step without dynamic sampling is the step)."""
    fg = algorithm.filter_groups
    return fg.prompts_per_round if fg.enable and fg.prompts_per_round else data.prompts_per_step


@dataclass
class AlgorithmConfig:
    """Advantage estimation and the rollout correction."""

    advantage_estimator: str = "grpo"
    """verl's ``algorithm.adv_estimator`` (either spelling; both given differently is an error): "grpo", "rloo"
    and verl 0.9.1's other estimators (docs/advantages.md lists which the trainer runs)."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's standard deviation (+1e-6); verl's ``norm_adv_by_std_in_grpo`` (either
    spelling)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig.decoupled_token_is)
    """verl's ``algorithm.rollout_correction`` block (or ``{preset: name, ...}``); see README."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): groups whose samples all scored alike are
    dropped and more prompts generated until the batch is full."""
    gamma: float = 1.0
    """Discount of the token-level return (verl's ``algorithm.gamma``): REINFORCE++ and GAE read it."""
    lam: float = 1.0
    """GAE's lambda (verl's ``algorithm.lam``)."""
    gdpo_reward_keys: Optional[List[str]] = None
    """GDPO: the reward components (keys of the reward function's returned dict) normalised one by one (verl's
    ``algorithm.gdpo_reward_keys``; required with ``adv_estimator: gdpo``)."""
    gdpo_reward_weights: Optional[List[float]] = None
    """GDPO: a weight per ``gdpo_reward_keys`` entry (null: 1 each; verl's ``algorithm.gdpo_reward_weights``)."""
    use_kl_in_reward: bool = False
    """verl's KL penalty in the reward: each token's reward is score - beta x kld(old || reference), beta from
    ``kl_ctrl`` (megatron_rl/algo/kl_reward.py, docs/kl_reward.md); builds the frozen reference model."""
    kl_penalty: str = "kl"
    """The per-token estimator of the KL in the reward, verl's names: "kl" (k1), "abs", "mse" (k2), "low_var_kl"
    (k3), also "k1" / "k2" / "k3" and the "+" forms (same values); verl's "full" is refused (verl raises
    NotImplementedError for it)."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """verl's ``algorithm.kl_ctrl``: ``type`` fixed | adaptive, ``kl_coef``, ``target_kl``, ``horizon``."""


@dataclass
class ActorConfig:
    """The Megatron actor: optimizer, micro-batching, loss."""

    lr: float = 1e-4
    """Adam learning rate: the peak of the schedule (after warm-up, before decay; Megatron's ``--lr``)."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from ``lr_warmup_init`` to ``lr`` (Megatron's ``--lr-warmup-iters``). A
    training step makes ``ppo_epochs x ppo_mini_batches`` optimizer steps; the schedule counts optimizer steps."""
    lr_warmup_fraction: Optional[float] = None
    """Warm-up as a fraction of ``lr_decay_steps``, rounded down to whole optimizer steps (Megatron's
    ``--lr-warmup-fraction``, verl's ``lr_warmup_steps_ratio``); give this or ``lr_warmup_steps``, not both."""
    lr_warmup_init: float = 0.0
    """Learning rate of the first optimizer step of the warm-up (Megatron's ``--lr-warmup-init``)."""
    lr_decay_style: str = "constant"
    """After warm-up: "constant" (``lr``), "linear" / "cosine" (from ``lr`` to ``min_lr`` at ``lr_decay_steps``),
    "inverse-square-root" (``lr * sqrt(warmup / step)``, at least ``min_lr``) — megatron-core's
    ``OptimizerParamScheduler``, stepped once per optimizer step and saved with the checkpoint."""
    lr_decay_steps: Optional[int] = None
    """Optimizer step at which the decay reaches ``min_lr`` (Megatron's ``--lr-decay-iters``; null: every
    optimizer step of the run, ``trainer.steps x ppo_epochs x ppo_mini_batches``)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay and after it (Megatron's ``--min-lr``; verl's
    ``min_lr_ratio x lr``)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    clip_grad: float = 1.0
    """Global gradient-norm clipping (0 disables)."""
    micro_batch_size: int = 4
    """Sequences per micro-batch (forward / backward through the pipeline schedule); not used when
    ``max_tokens_per_micro_batch`` is set."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Token budget of one micro-batch on each rank (verl's ``ppo_max_token_len_per_gpu``): rows are grouped
    by token count instead of a fixed row count — padded tokens (rows x longest row) without
    ``sequence_packing``, the packed length with it — and the prompt groups of a step are spread over the DP
    ranks balancing their tokens. The grouping changes neither the loss nor any metric (beyond fp32 summation
    order); with DP > 1 and ``ppo_mini_batches`` > 1 the balanced split decides which rows share an optimizer
    step. Must hold the longest row (prompt + response, rounded up to the sequence multiple of TP/SP and CP). None: fixed
    ``micro_batch_size`` rows."""
    sequence_packing: bool = False
    """Concatenate the rows of a micro-batch into one sequence (THD: per-row positions, attention that never
    crosses rows; Transformer Engine's THD attention through ``PackedSeqParams`` with TE (needs ``bf16``),
    without TE megatron's local attention running SDPA once per causal segment), so no compute goes to padding. Combine with ``max_tokens_per_micro_batch``."""
    bf16: bool = False
    """Megatron's ``--bf16``: bf16 parameters and compute, fp32 main parameters in the optimizer, gradients
    accumulated and all-reduced in fp32 (Megatron's ``accumulate_allreduce_grads_in_fp32``; each micro-batch's
    weight gradient is bf16 before it is added, no fused fp32 wgrad accumulation); log-probs and
    entropy are computed in fp32 from the (bf16) logits, the old log-probs too (a bf16 forward). false: fp32 end to end (the CPU default). Weight sync hands
    the bf16 parameters to the rollout engine as they are."""
    fp32_output_layer: bool = False
    """With ``bf16`` and ``use_distributed_optimizer``: keep the output layer's weight in fp32 and run the output
    layer (hidden x vocabulary) in fp32, so the logits are never rounded to bf16. Costs one fp32 vocabulary matmul
    and twice that weight's memory; with tied embeddings the shared weight is the fp32 one and the embedding's
    output is cast to bf16."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer: fp32 main parameters and Adam state sharded over the data-parallel
    ranks (ZeRO-1), gradients reduce-scattered and parameters all-gathered. Same updates as without it up
    to fp32 reduction order."""
    recompute_granularity: Optional[str] = None
    """Megatron's activation recomputation (TransformerConfig ``recompute_granularity``): null (keep every
    activation), "full" (each layer group's forward runs again in backward; needs ``recompute_method`` and
    ``recompute_num_layers``) or "selective" (``recompute_modules`` only). Same loss and gradients, less memory
    (``megatron-rl check`` plans it); rules in ``megatron_rl/models/recompute.py``."""
    recompute_method: Optional[str] = None
    """With ``recompute_granularity: full``: "uniform" (layers in groups of ``recompute_num_layers``) or "block"
    (the first ``recompute_num_layers`` layers of each pipeline stage / model chunk)."""
    recompute_num_layers: Optional[int] = None
    """With ``recompute_granularity: full``: the group size (uniform) or the layers recomputed per stage (block)."""
    recompute_modules: Optional[List[str]] = None
    """With ``recompute_granularity: selective``: megatron-core's submodules to recompute (core_attn, moe_act,
    layernorm, mla_up_proj, mlp, moe, shared_experts; null: megatron's default, core_attn)."""
    optimizer_cpu_offload: bool = False
    """Megatron's ``optimizer_cpu_offload``: the fp32 main parameters and Adam moments of a fraction of the
    parameters (``optimizer_offload_fraction``) live in host memory and their Adam step runs on the CPU
    (megatron-core's ``HybridDeviceOptimizer``; verl's ``optim.override_optimizer_config.optimizer_cpu_offload``).
    Needs ``use_distributed_optimizer`` and a megatron-core that has it (docs/memory.md)."""
    optimizer_offload_fraction: float = 1.0
    """Megatron's ``optimizer_offload_fraction``: the share of the optimizer state (by parameter count, in the
    optimizer's order) kept on the CPU with ``optimizer_cpu_offload``, in (0, 1]."""
    ref_param_offload: bool = False
    """verl's ``ref.megatron.param_offload``: the KL reference's weights wait in host memory (pinned on CUDA) and are
    on the device only during its log-prob pass, so the train step's peak does not hold them (docs/memory.md)."""
    ppo_mini_batches: int = 1
    """Optimizer steps per rollout batch (the batch is split into this many mini-batches)."""
    ppo_epochs: int = 1
    """Passes over the rollout batch."""
    load_hf: Optional[str] = path_field(None, kind=HUB)
    """Initialise from this HF checkpoint directory (its config.json supplies ``model`` if omitted)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Clip ratios, dual-clip, the objectives' parameters (verl's names), aggregation mode, KL loss (the objective,
    loss_type, comes from algorithm.rollout_correction)."""
    routing_replay: str = "none"
    """MoE routing replay: none | r2 (train forwards replay the routing the log-prob pass chose) | r3
    (log-prob pass and train forwards replay the rollout engine's routing; needs an MoE model and an engine
    that captures routing). Only the choice of experts is replayed; gate weights are the trainer's."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (``rank``, ``alpha``, ``dropout``, ``target_modules``, ``init``; verl / PEFT names): the base
    frozen, only the adapters trained; ``rank: 0`` (the default) trains every weight (docs/lora.md)."""


@dataclass
class TrainerConfig:
    """The loop: length, seeds, output, checkpoints, metric sinks."""

    steps: int = 20
    """Training steps (one rollout batch each). Not together with ``epochs``."""
    epochs: Optional[int] = None
    """Training length in passes over a data file (verl's ``total_epochs``): ``steps`` becomes
    ``epochs x floor(rows of data.path / prompts per draw)`` when the job is built (printed), as verl counts
    its dataloader's batches (drop_last); prompts per draw is ``data.prompts_per_step``, or
    ``algorithm.filter_groups.prompts_per_round`` with dynamic sampling. Needs ``data.task: file``; null: ``steps``."""
    seed: int = 1234
    """Seed of data, sampling and model init (runs are reproducible on CPU)."""
    run_dir: str = path_field("runs/default")
    """Output directory: metrics.jsonl, checkpoints/, rollouts, TensorBoard events."""
    save_interval: int = 0
    """Checkpoint every N steps (0: only at the end and on SIGTERM / SIGINT)."""
    resume: Union[bool, str] = False
    """Resume from the newest COMPLETE checkpoint in run_dir/checkpoints (``--resume``); metrics.jsonl and
    rollouts.jsonl continue from its step, later records and stale checkpoints are removed. ``true``: a run_dir
    with none starts a new run at step 0, said on one line (a Slurm requeue's first start); ``required``
    (``--resume=required``): a run_dir with none is refused before anything starts (a mistyped path)."""
    overwrite: bool = False
    """Start over in a run_dir that holds another run's outputs (metrics.jsonl, checkpoints/, ...): they are
    removed first. Without it (or resume) such a run_dir is refused before anything starts."""
    tensorboard: bool = False
    """Also write TensorBoard events (needs the tensorboard extra)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb extra; offline unless WANDB_MODE says otherwise)."""
    wandb_project: str = "megatron-rl"
    """W&B project name."""
    dump_rollouts: bool = False
    """Write every step's rollouts to run_dir/rollouts.jsonl (the ``megatron-rl score`` format)."""
    progress: bool = True
    """One progress line per step and a periodic summary line on the console (rank 0)."""
    console_table_interval: int = 10
    """Every N steps (and at the last), one summary line of the steps since the previous one: mean / min / max
    reward and its change, mean length, step time, throughput (0: per-step lines only)."""
    collective_timeout_s: float = 1800.0
    """Process-group timeout (gloo / NCCL): a collective that waits longer raises on that rank. Ranks wait
    in a broadcast while rank 0 generates rollouts, so it must exceed the longest generation round: with dynamic
    sampling that wait gets it once per round (x ``algorithm.filter_groups.max_num_gen_batches``,
    ``config/timeouts.py``), and a wait that runs out names rank 0's rollouts and these keys."""
    phase_timeout_s: float = 1800.0
    """Watchdog: one phase of a step (rollout, logprob, train, weight_sync, metrics) running longer ends
    the rank with the phase named and its stacks printed; torchrun then stops the job (0: no limit). The rollout
    phase gets it per generation round: x ``algorithm.filter_groups.max_num_gen_batches`` with dynamic sampling."""
    checkpoint_timeout_s: float = 1800.0
    """Watchdog limit of one checkpoint save (0: no limit). A save that fails or times out is never marked
    COMPLETE; the previous COMPLETE checkpoint stays the one ``--resume`` loads. Async: half of it bounds the drain
    of the rollouts the checkpoint holds, per generation round with dynamic sampling, the other half the save; the
    other ranks wait for the drain that long + ``collective_timeout_s`` (``config/timeouts.py``)."""
    stop_timeout_s: float = 900.0
    """After the first SIGTERM / SIGINT, seconds a rank may take to finish its step and checkpoint before it
    exits without one (0: no limit). A second signal exits at once."""
    test_freq: int = 0
    """Evaluate the validation set (``data.val_files`` / ``data.val_heldout``) every N steps and after the last
    (0: never; verl's -1 is 0 here). Metrics ``val/*`` join that step's record."""
    val_before_train: bool = True
    """Also evaluate it before the first step of a fresh run (logged as step 0; not on ``--resume``), as verl does,
    whenever a validation set is given."""
    val_timeout_s: float = 1800.0
    """Watchdog limit of one validation (generation and rewards); past it the rank ends with this key named
    (0: no limit). With several ranks the others wait for it in a collective, so it is also bounded by
    ``collective_timeout_s``, which it may not exceed."""
    val_log_samples: int = 0
    """Validation responses logged per validation (verl's ``trainer.log_val_generations``): N (prompt, response,
    reward, data source) rows, chosen as verl chooses them (the same prompts every time), appended to
    run_dir/val_generations.jsonl with their step and, with ``wandb``, logged as the W&B table ``val/generations``
    (0: none)."""
