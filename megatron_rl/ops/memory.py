"""Per-rank GPU memory plan of a megatron-rl job (what ``megatron-rl check`` prints).

    plan = memory_plan(job, MemoryOptions(prompt_length=1024))   # job: a MemoryJob (plan.memory_job builds it)
    print(format_plan(plan, gpu_memory_gb=80))

Everything is an estimate from the shapes: bytes per rank, one row per pipeline stage (TP / CP / DP / EP ranks
are symmetric). The rule to keep: the activation formula equals, byte for byte, what a megatron-core layer saves
for backward (tests/integration/test_check_activation_measure.py), so change the formula and that test together.
Every formula (parameters, optimizer, activations, token budgets, logits, checkpoint host memory) and what is not
counted: docs/memory_plan.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from megatron_rl.actor.batcher import MicroBatcher
from megatron_rl.actor.micro_batching import interleaved_group_size
from megatron_rl.convert.partition import chunk_layer_range

from megatron_rl.logprobs.backend import CUDA_CHUNK_ELEMENTS
from megatron_rl.lora.counts import adapter_counts
from megatron_rl.models.attention import BACKENDS
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.rollout.budget import ResponseBudget

GiB = float(1 << 30)
RECOMPUTE = ("none", "selective", "full")


@dataclass
class MemoryOptions:
    """Settings the memory plan needs that are not part of the job config (CLI flags of ``check``)."""

    prompt_length: int = 1024
    """Prompt tokens per sequence; sequence length = prompt_length + rollout.max_new_tokens."""
    params_bytes: int = 2
    """Bytes per model parameter (2 = bf16 on GPU, 4 = fp32 as on CPU)."""
    fp32_output_layer: bool = False
    """``actor.fp32_output_layer`` with bf16 parameters: the output layer's weight (the shared embedding when tied)
    is fp32 (4 bytes, its own main copy: Adam 8 bytes) and the logits are fp32."""
    grad_bytes: int = 4
    """Bytes per gradient element (4 = fp32 main grads, megatron's default; 2 = bf16 grads)."""
    distributed_optimizer: bool = True
    """Shard the Adam state over the data-parallel (expert-data-parallel) group."""
    recompute: str = "none"
    """Megatron's activation recomputation (``recompute_granularity``): "none", "selective" (core attention),
    "full"."""
    recompute_method: str = "uniform"
    """With full recomputation: megatron's ``recompute_method``, "uniform" or "block"."""
    recompute_num_layers: int = 1
    """With full recomputation: megatron's ``recompute_num_layers`` (group size, or layers per model chunk)."""
    attention: str = "te-fused"
    """The core attention the job gets (``models.attention.BACKENDS``): "te-fused" keeps no scores; "te-unfused"
    and "local" materialise the ``[b, heads, s, s]`` scores of padded rows."""
    reference_offload: bool = False
    """``actor.ref_param_offload``: the KL reference's weights are on the device only during its log-prob pass."""
    optimizer_offload_fraction: float = 0.0
    """Share of the optimizer state held in host memory (``actor.optimizer_offload_fraction`` with
    ``actor.optimizer_cpu_offload``; 0: none)."""
    fused_logprobs: bool = False
    """Plan for the fused linear log-prob path (only a chunk of logits exists at a time) instead of the
    vocab-parallel path the actor runs (the logits and their gradient in the params dtype + one chunk)."""


@dataclass(frozen=True)
class LongestRow:
    """The longest row (prompt + response) a micro-batch of the job must hold, as the actor pads it."""

    prompt: int
    """Prompt tokens (the longest prompt the plan assumes)."""
    response: int
    """Response-side tokens (``rollout.max_new_tokens``, or ``multi_turn.max_total_tokens``)."""
    response_source: str
    """The config key ``response`` comes from."""
    multiple: int
    """Sequence lengths are padded to a multiple of this (``ParallelDims.seq_multiple``)."""
    multiple_source: str
    """How ``multiple`` follows from the layout, e.g. ``TP 4 with sequence parallel x 2*CP 4``."""

    @property
    def tokens(self) -> int:
        """Prompt + response."""
        return self.prompt + self.response

    @property
    def padded(self) -> int:
        """``tokens`` rounded up to ``multiple``: the fewest tokens one micro-batch needs."""
        return -(-self.tokens // self.multiple) * self.multiple

    def describe(self, prompt_source: Optional[str] = None) -> str:
        """How ``padded`` was computed, e.g. ``4272 tokens: prompt 174 + rollout.max_new_tokens 4096 = 4270,
        rounded up to a multiple of 8 (TP 8 with sequence parallel)``."""
        src = f" ({prompt_source})" if prompt_source else ""
        out = f"{self.padded} tokens: prompt {self.prompt}{src} + {self.response_source} {self.response}"
        if self.multiple > 1:
            out += f" = {self.tokens}, rounded up to a multiple of {self.multiple} ({self.multiple_source})"
        return out


def longest_row(dims: ParallelDims, budget: ResponseBudget, prompt_length: int) -> LongestRow:
    """The longest row of a job with layout ``dims`` and response budget ``budget`` (the job plan's) with prompts of
    at most ``prompt_length`` tokens."""
    parts = []
    if dims.sequence_parallel and dims.tp > 1:
        parts.append(f"TP {dims.tp} with sequence parallel")
    if dims.cp > 1:
        parts.append(f"2*CP {dims.cp_row_multiple} with context parallel")
    return LongestRow(prompt=prompt_length, response=budget.tokens, response_source=budget.key,
                      multiple=dims.seq_multiple, multiple_source=" x ".join(parts) or "no SP / CP padding")


def token_budget_error(batcher: MicroBatcher, row: LongestRow, prompt_source: Optional[str] = None) -> Optional[str]:
    """The problem (naming ``actor.max_tokens_per_micro_batch``) when ``batcher``'s token budget cannot hold
    ``row``; None without a budget or when it fits."""
    budget = batcher.max_tokens
    if budget is None or budget >= row.padded:
        return None
    return (f"actor.max_tokens_per_micro_batch: {budget} tokens cannot hold the longest possible row, "
            f"{row.describe(prompt_source)}; set it to at least {row.padded}")


@dataclass(frozen=True)
class MemoryJob:
    """What the memory plan reads of a job: the job plan's objects and the sections they leave out
    (``plan.memory_job`` builds it)."""

    model: object
    """The ``model:`` section (``ModelConfig``): the shapes."""
    parallel: object
    """The ``parallel:`` section: uneven first / last pipeline stages."""
    dims: ParallelDims
    """The plan's layout (its world size is the plan's)."""
    batcher: MicroBatcher
    """The plan's micro-batcher: fixed rows or a token budget, packed or padded."""
    budget: ResponseBudget
    """The plan's response budget (the longest response side of a row)."""
    rows_per_step: int
    """Rows a step trains: ``data.prompts_per_step`` x ``rollout.n_samples_per_prompt``."""
    ppo_mini_batches: int
    """``actor.ppo_mini_batches``."""
    lora: object
    """``actor.lora`` (its ``enabled`` says whether adapters train on a frozen base)."""
    reference_model: bool = False
    """A KL reference model is held (a KL loss or KL in the reward, without LoRA)."""
    critic_model: bool = False
    """PPO's critic is trained."""


@dataclass
class StagePlan:
    """Memory of one rank of pipeline stage ``stage`` (bytes)."""

    stage: int
    layers: List[int]
    dense_params: int
    expert_params: int
    params: float
    grads: float
    optimizer: float
    activations: Dict[str, float]
    microbatches_in_flight: float
    logits_unfused: float
    logits_fused: float
    reference: float = 0.0
    """The KL reference model on this rank (0 without a KL loss)."""
    adapter_params: int = 0
    """LoRA adapter parameters of this rank (``actor.lora``; included in ``params``): the only ones with gradients
    and optimizer state then."""
    host: float = 0.0
    """Host memory (CPU RAM) of this rank: the offloaded optimizer state, the parked reference (not in ``total``)."""
    reference_parked: bool = False
    """The reference is on the device only during its log-prob pass (``actor.ref_param_offload``)."""
    critic: float = 0.0
    """PPO's critic on this rank: its weights, gradients and Adam state, held through the whole step (its
    activations come while the actor's do not, and are at most the actor's: not added)."""

    def total(self, recompute: str, fused: bool) -> float:
        """Sum of all components for one recompute mode / log-prob path (a parked reference: the larger of it and
        the train step's activations, which never exist at once)."""
        logits = self.logits_fused if fused else self.logits_unfused
        acts = self.activations[recompute]
        held = max(self.reference, acts) if self.reference_parked else self.reference + acts
        return self.params + self.grads + self.optimizer + held + logits + self.critic


@dataclass
class MemoryPlan:
    """The per-stage plan and the sizes it was computed with."""

    world_size: int
    tp: int
    pp: int
    vpp: int
    cp: int
    dp: int
    ep: int
    etp: int
    expert_dp: int
    seq_length: int
    response_source: str
    """The config key that bounds a row's response side (``multi_turn.max_total_tokens`` for multi-turn jobs)."""
    micro_batch_size: int
    """Rows per micro-batch (``actor.micro_batch_size``; 1 row of ``max_tokens_per_micro_batch`` tokens
    when the token budget is set)."""
    microbatches: int
    """Micro-batches per mini-batch per DP rank (with a token budget: the most, every row at the longest)."""
    total_params: int
    options: MemoryOptions
    is_moe: bool = False
    active_params: int = 0
    """Parameters one token passes through (MoE: top-k experts; = total_params for dense models)."""
    max_tokens_per_micro_batch: Optional[int] = None
    """``actor.max_tokens_per_micro_batch`` (None: fixed ``micro_batch_size`` rows)."""
    sequence_packing: bool = False
    """``actor.sequence_packing``: the rows of a micro-batch are packed into one sequence."""
    longest_row: Optional[LongestRow] = None
    """The longest row a micro-batch holds (prompt + response, padded to the sequence multiple)."""
    keeps_scores: bool = False
    """The attention backend materialises the ``[b, heads, s, s]`` scores of this job's micro-batches."""
    reference_model: bool = False
    """A KL reference model is held (``actor.policy_loss.kl_loss_coef > 0`` or ``algorithm.use_kl_in_reward``)."""
    critic_model: bool = False
    """PPO's critic is trained (``critic:``): the actor's body with a value head, its own gradients and Adam state."""
    stages: List[StagePlan] = field(default_factory=list)

    def peak(self) -> StagePlan:
        """The stage with the largest total for the configured options."""
        o = self.options
        return max(self.stages, key=lambda s: s.total(o.recompute, o.fused_logprobs))


# ----------------------------------------------------------------------------- parameter counts
def layer_counts(m, tp: int, ep: int, etp: int, is_moe: bool):
    """(dense params, expert params) of one layer on one rank."""
    h, a, g, d = m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim
    dense = 2 * h  # input + pre-MLP RMSNorm weights
    if m.multi_latent_attention:
        dense += _mla_counts(m, tp)
    else:
        if m.qk_layernorm:
            dense += 2 * d
        qkv_out = (a + 2 * g) * d
        dense += h * qkv_out // tp + (qkv_out // tp if m.add_qkv_bias else 0)
        dense += a * d * h // tp
    expert = 0
    if is_moe:
        E = m.num_moe_experts
        fm = m.moe_ffn_hidden_size or m.dense_ffn_hidden_size
        dense += E * h  # router (replicated over TP, reduced over DP)
        if m.moe_router_enable_expert_bias:
            dense += E  # expert bias (a buffer: no grad / optimizer state, counted as a parameter here)
        expert = (E // ep) * 3 * h * fm // etp
        if m.moe_shared_expert_intermediate_size:
            dense += 3 * h * m.moe_shared_expert_intermediate_size // tp
            if m.moe_shared_expert_gate:
                dense += h
    else:
        dense += 3 * h * m.dense_ffn_hidden_size // tp
    return dense, expert


def _mla_counts(m, tp: int) -> int:
    """Multi-latent attention parameters on one TP rank: replicated q / kv down-projections and latent
    norms, column-parallel q / kv up-projections, row-parallel output projection."""
    h, a, qk, v = m.hidden_size, m.num_attention_heads, m.q_head_dim, m.v_head_dim
    n = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank  # kv down-projection + kv norm
    if m.q_lora_rank:
        n += h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * a * qk // tp
    else:
        n += h * a * qk // tp
    n += m.kv_lora_rank * a * (m.qk_head_dim + v) // tp + a * v * h // tp
    return n


def stage_layers(num_layers: int, pp: int, vpp: int, first: Optional[int] = None,
                 last: Optional[int] = None) -> List[List[int]]:
    """Global layer indices held by each pipeline stage (megatron-core's placement, uneven first / last
    stages included)."""
    out = []
    for s in range(pp):
        ids = []
        for c in range(vpp):
            ids.extend(range(*chunk_layer_range(num_layers, s, pp, c, vpp, first, last)))
        out.append(ids)
    return out


def active_parameters(m) -> int:
    """Parameters one token passes through (MoE: top-k routed experts + shared experts + router), embeddings
    and the output layer included — how "37B active" is counted for DeepSeek-V3."""
    pattern = m.moe_layer_pattern()
    n = 0
    for i in range(m.num_layers):
        d, e = layer_counts(m, 1, 1, 1, bool(pattern[i]))
        n += d + (e * m.moe_router_topk // m.num_moe_experts if pattern[i] else 0)
    n += m.vocab_size * m.hidden_size * (2 if m.untie_embeddings_and_output_weights else 1) + m.hidden_size
    return n


def total_parameters(m) -> int:
    """Parameters of the whole model (no sharding, embeddings counted once if tied)."""
    pattern = m.moe_layer_pattern()
    n = 0
    for i in range(m.num_layers):
        d, e = layer_counts(m, 1, 1, 1, bool(pattern[i]))
        n += d + e
    n += m.vocab_size * m.hidden_size * (2 if m.untie_embeddings_and_output_weights else 1) + m.hidden_size
    return n


# ----------------------------------------------------------------------------- activations
def attention_score_bytes(m, s: int, b: int, tp: int, e: int = 2) -> float:
    """Bytes of one layer's materialised attention scores for one micro-batch: the probabilities in the
    activation dtype plus, below fp32, the fp32 softmax output (megatron's ``attention_softmax_in_fp32``)."""
    a = m.num_attention_heads
    out = e * a * s * s * b / tp
    if e < 4:
        out += 4.0 * a * s * s * b / tp
    return out


def layer_activation_bytes(m, s: int, b: int, tp: int, sp: bool, etp: int, is_moe: bool,
                           scores: bool, e: int = 2) -> float:
    """Bytes of activations one layer keeps for backward for one micro-batch (see module docstring):
    ``scores`` True when the core attention keeps its ``[b, heads, s, s]`` scores (else the fp32 log-sum-exp);
    ``e`` = bytes per activation element (2 = bf16, 4 = fp32)."""
    h, a, g, d = m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim
    spd = tp if sp else 1
    if m.multi_latent_attention:  # estimate (not measured): latents, up-projected q / k / v, core output
        qk, v = m.q_head_dim, m.v_head_dim
        attn = (2 * e * s * b * h / spd
                + e * s * b * ((m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_pos_emb_head_dim)
                + e * s * b * a * (2 * qk + v) / tp + e * s * b * a * 2 * qk / tp + e * s * b * a * v / tp)
        d = qk
    else:
        attn = (2 * e * s * b * h / spd             # input norm: its input, its output (= QKV linear input)
                + e * s * b * (a + 2 * g) * d / tp   # QKV linear output (V is a view of it: kept alive)
                + e * s * b * (a + g) * d / tp       # Q and K after RoPE (new tensors)
                + e * s * b * a * d / tp)            # core-attention output = output-projection input
    if scores:
        attn += attention_score_bytes(m, s, b, tp, e)  # probabilities (input of probs @ V), fp32 softmax
    else:
        attn += 4.0 * a * s * b / tp                 # flash attention: fp32 log-sum-exp only
    if is_moe:
        E, k = m.num_moe_experts, m.moe_router_topk
        fm = m.moe_ffn_hidden_size or m.dense_ffn_hidden_size
        mlp = 2 * e * s * b * h / spd + 4.0 * s * b * E / spd  # pre-MLP norm in / out, fp32 router logits
        n = s * b * k * etp / spd  # token-expert pairs on this rank after dispatch (+ ETP all-gather)
        mlp += n * e * h + n * 3 * e * fm / etp       # permuted tokens (fc1 input); fc1 out (2 f_moe), fc2 in
        fs = m.moe_shared_expert_intermediate_size
        if fs:
            mlp += 3.0 * e * s * b * fs / tp          # shared expert fc1 out + fc2 in (its input is the norm out)
    else:
        f = m.dense_ffn_hidden_size
        mlp = 2 * e * s * b * h / spd + 3.0 * e * s * b * f / tp  # norm in / out; fc1 out (gate, up), fc2 in
    return attn + mlp


def _in_flight(stage: int, pp: int, vpp: int, microbatches: int) -> float:
    """Micro-batches' worth of this stage's layers held at the 1F1B / interleaved peak."""
    if vpp <= 1:
        return float(min(pp - stage, microbatches))
    # the interleaved warm-up runs (vpp - 1) micro-batch groups ahead (the actor's group size)
    group = interleaved_group_size(microbatches, pp)
    chunks = min(2 * (pp - stage - 1) + (vpp - 1) * group + 1, microbatches * vpp)
    return chunks / vpp


# ----------------------------------------------------------------------------- the plan
def memory_plan(job: MemoryJob, options: Optional[MemoryOptions] = None) -> MemoryPlan:
    """Per-stage memory plan of ``job`` at its plan's world size."""
    o = options or MemoryOptions()
    if o.recompute not in RECOMPUTE:
        raise ValueError(f"recompute={o.recompute!r} is not one of {RECOMPUTE}")
    if o.recompute_method not in ("uniform", "block") or o.recompute_num_layers < 1:
        raise ValueError(f"recompute_method={o.recompute_method!r} / recompute_num_layers={o.recompute_num_layers} "
                         f"is not uniform / block with >= 1 layers")
    if o.attention not in BACKENDS:
        raise ValueError(f"attention={o.attention!r} is not one of {tuple(BACKENDS)}")
    if o.prompt_length < 0:
        raise ValueError(f"prompt_length={o.prompt_length} must be >= 0")
    if not 0.0 <= o.optimizer_offload_fraction <= 1.0:
        raise ValueError(f"optimizer_offload_fraction={o.optimizer_offload_fraction} must be in [0, 1]")
    m, p, d = job.model, job.parallel, job.dims
    if m is None:
        raise ValueError("model: missing; the memory plan needs the model shape")
    world_size, tp, pp, cp, vpp, ep, etp, dp, edp = d.world_size, d.tp, d.pp, d.cp, d.vpp, d.ep, d.etp, d.dp, d.edp
    sp = bool(d.sequence_parallel and tp > 1)
    row = longest_row(d, job.budget, o.prompt_length)
    problem = token_budget_error(job.batcher, row)
    if problem is not None:
        raise ValueError(problem)
    response_source, seq = row.response_source, row.tokens
    seqs_per_dp = job.rows_per_step // max(dp, 1)
    per_minibatch = max(1, seqs_per_dp // max(1, job.ppo_mini_batches))
    budget = job.batcher.max_tokens
    if budget is None:  # fixed rows of the longest sequence
        s = -(-seq // cp)
        b = job.batcher.micro_batch_size
        micro = max(1, -(-per_minibatch // b))
    else:  # one row of the whole budget (module docstring); at most floor(B / R) longest rows per micro-batch
        s = -(-budget // cp)
        b = 1
        micro = max(1, -(-per_minibatch // max(1, budget // max(1, row.padded))))
        if d.interleaved:  # the interleaved schedule needs >= PP micro-batches: the actor splits them further
            micro = max(micro, min(pp, per_minibatch))
    pattern = m.moe_layer_pattern()
    lora = job.lora  # adapters: the base has no gradient, no main parameter, no Adam state; no 2nd reference
    V, h = m.vocab_size, m.hidden_size
    opt_bytes = 12 if o.params_bytes < 4 else 8
    main_bytes = 4 if o.params_bytes < 4 else 0  # fp32 main copy of bf16 parameters (part of opt_bytes)
    act = o.params_bytes  # activations are in the compute dtype = the parameter dtype
    keep = BACKENDS[o.attention].keeps_scores(packed=job.batcher.packed)
    plan = MemoryPlan(world_size=world_size, tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp, ep=ep, etp=etp,
                      expert_dp=edp, seq_length=seq, response_source=response_source, micro_batch_size=b, microbatches=micro,
                      total_params=total_parameters(m), options=o, is_moe=m.is_moe,
                      active_params=active_parameters(m) if m.is_moe else total_parameters(m),
                      max_tokens_per_micro_batch=budget, sequence_packing=job.batcher.packed,
                      longest_row=row, keeps_scores=keep, reference_model=job.reference_model,
                      critic_model=job.critic_model)
    for st, layers in enumerate(stage_layers(m.num_layers, pp, vpp, p.num_layers_in_first_pipeline_stage,
                                             p.num_layers_in_last_pipeline_stage)):
        dense = expert = ad = ae = 0
        for i in layers:
            d_, e_ = layer_counts(m, tp, ep, etp, bool(pattern[i]))
            dense += d_
            expert += e_
            if lora.enabled:
                a_, b_ = adapter_counts(m, lora, tp, ep, bool(pattern[i]))
                ad += a_
                ae += b_
        if st == 0:
            dense += V * h // tp
        if st == pp - 1:
            dense += h
            if m.untie_embeddings_and_output_weights or pp > 1:
                dense += V * h // tp
        n = dense + expert
        trained = ad + ae if lora.enabled else n  # parameters with gradients and optimizer state
        dense_shard = dp * cp if o.distributed_optimizer else 1
        expert_shard = edp if o.distributed_optimizer else 1
        shard = (ad / dense_shard + ae / expert_shard if lora.enabled
                 else dense / dense_shard + expert / expert_shard)  # optimizer elements of this rank
        optimizer = opt_bytes * shard
        # fp32 output layer (bf16 actor): that weight is fp32 on its stage(s), its own main parameter
        fp32_w = 0
        if o.fp32_output_layer and o.params_bytes < 4:
            tied = not m.untie_embeddings_and_output_weights
            fp32_w = (V * h // tp) * ((st == pp - 1) + (st == 0 and tied and pp > 1))
        if not lora.enabled:  # (a LoRA actor's output layer is frozen: no main parameter)
            optimizer -= main_bytes * fp32_w / dense_shard
        host = 0.0
        if o.optimizer_offload_fraction:  # HybridDeviceOptimizer: the offloaded share lives on the host
            host = 16.0 * o.optimizer_offload_fraction * shard
            optimizer *= 1.0 - o.optimizer_offload_fraction
        reference = 0.0
        if plan.reference_model:  # its weights only (module docstring)
            reference = float(o.params_bytes * n + (4 - o.params_bytes) * fp32_w)
            if o.reference_offload:
                host += reference
        critic = 0.0
        if plan.critic_model:  # the actor's parameters, the output layer replaced by the [h -> 1] value head
            out = V * h // tp if st == pp - 1 and (m.untie_embeddings_and_output_weights or pp > 1) else 0
            n_c = n - out + (h + 1 if st == pp - 1 else 0)
            c_opt = opt_bytes * n_c / dense_shard
            host += 16.0 * o.optimizer_offload_fraction * n_c / dense_shard
            critic = float((o.params_bytes + o.grad_bytes) * n_c + c_opt * (1.0 - o.optimizer_offload_fraction))
        flight = _in_flight(st, pp, vpp, micro)

        def per_layer(with_scores: bool) -> List[float]:
            return [layer_activation_bytes(m, s, b, tp, sp, etp, bool(pattern[i]), with_scores, act)
                    for i in layers]

        one_layer_scores = attention_score_bytes(m, s, b, tp, act) if keep and layers else 0.0
        acts = {"none": flight * sum(per_layer(keep)),
                # selective recompute: no scores kept per layer; one layer's exist while it runs
                "selective": flight * sum(per_layer(False)) + one_layer_scores}
        acts["full"] = _full_recompute_bytes(per_layer(keep), act * s * b * h / (tp if sp else 1), vpp, flight, o)
        logits_unfused = logits_fused = 0.0
        if st == pp - 1:
            T = s * b
            vloc = V // tp
            rows = min(T, max(1, CUDA_CHUNK_ELEMENTS // vloc))
            logits_fused = 4.0 * rows * vloc
            logit_bytes = 4 if o.fp32_output_layer else o.params_bytes
            logits_unfused = 2.0 * logit_bytes * T * vloc + logits_fused
        plan.stages.append(StagePlan(stage=st, layers=layers, dense_params=dense, expert_params=expert,
                                     params=float(o.params_bytes * (n + ad + ae) + (4 - o.params_bytes) * fp32_w),
                                     grads=float(o.grad_bytes * trained), adapter_params=ad + ae,
                                     optimizer=optimizer, activations=acts, microbatches_in_flight=flight,
                                     logits_unfused=logits_unfused, logits_fused=logits_fused,
                                     reference=reference, host=host,
                                     reference_parked=plan.reference_model and o.reference_offload, critic=critic))
    return plan


def _full_recompute_bytes(layer_bytes: List[float], input_bytes: float, vpp: int, flight: float,
                          o: MemoryOptions) -> float:
    """Full recomputation on one stage (module docstring): what the micro-batches in flight keep, plus the working
    set of the one recompute running; the stage's layers split into ``vpp`` contiguous model chunks."""
    n, kept, work = o.recompute_num_layers, 0.0, 0.0
    size = -(-len(layer_bytes) // vpp) if layer_bytes else 0
    for c in range(0, len(layer_bytes), max(size, 1)):
        chunk = layer_bytes[c:c + size]
        if o.recompute_method == "block":
            kept += min(n, len(chunk)) * input_bytes + sum(chunk[n:])
            work = max(work, max(chunk[:n], default=0.0))
        else:
            groups = [chunk[g:g + n] for g in range(0, len(chunk), n)]
            kept += len(groups) * input_bytes
            work = max(work, max(sum(g) for g in groups))
    return flight * kept + work


def checkpoint_host_bytes(plan: MemoryPlan) -> Dict[str, float]:
    """Host memory (bytes) one rank allocates for the distributed optimizer's state when a checkpoint is saved
    or loaded (module docstring), for the stage that needs the most: ``{"load": every rank, "save": each
    data-parallel rank 0}``; zeros without the distributed optimizer."""
    if not plan.options.distributed_optimizer:
        return {"load": 0.0, "save": 0.0}
    st = max(plan.stages, key=lambda x: x.dense_params + x.expert_params)
    world = 12.0 * (st.dense_params + st.expert_params)
    gather = max(8.0 * n + 12.0 * n / max(1, d) for n, d in ((st.dense_params, plan.dp * plan.cp),
                                                            (st.expert_params, plan.expert_dp)))
    return {"load": world, "save": world + gather}


def format_checkpoint_host(plan: MemoryPlan, ranks_per_node: int) -> Optional[str]:
    """The ``check`` line for ``checkpoint_host_bytes`` (None without the distributed optimizer)."""
    b = checkpoint_host_bytes(plan)
    if not b["load"]:
        return None
    return (f"checkpoint host memory (distributed optimizer, fully_reshardable; CPU RAM, not GPU): loading "
            f"{b['load'] / GiB:.2f} GiB on every rank ({ranks_per_node} ranks per node: "
            f"{ranks_per_node * b['load'] / GiB:.1f} GiB per node), saving up to {b['save'] / GiB:.2f} GiB on each "
            f"data-parallel rank 0")


def format_count(n: float) -> str:
    """A parameter count with the unit that keeps it readable: ``7.62 B``, ``1.2 M``, ``35.1 K``, ``512``."""
    for scale, unit, digits in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{int(n)}"


def _gb(x: float) -> str:
    return f"{x / GiB:8.2f}"


def micro_batching(plan: MemoryPlan) -> str:
    """How the plan's micro-batches are formed, e.g. ``micro-batch 2 rows, 8 micro-batches per mini-batch per
    DP rank`` or ``micro-batch <= 16384 tokens, packed (planned as 1 row of 16384 tokens), at most 4
    micro-batches per mini-batch per DP rank``."""
    packed = ", packed" if plan.sequence_packing else ""
    budget = plan.max_tokens_per_micro_batch
    if budget is None:
        how = f"micro-batch {plan.micro_batch_size} rows{packed}"
        if plan.sequence_packing:
            how += " (planned as padded rows: an upper bound)"
        return f"{how}, {plan.microbatches} micro-batches per mini-batch per DP rank"
    return (f"micro-batch <= {budget} tokens{packed} (actor.max_tokens_per_micro_batch; planned as 1 row of "
            f"{budget} tokens), at most {plan.microbatches} micro-batches per mini-batch per DP rank")


def format_plan(plan: MemoryPlan, gpu_memory_gb: Optional[float] = None, device: str = "cuda") -> str:
    """Human-readable table (GiB per rank) with a warning line when a stage exceeds ``gpu_memory_gb``
    (``device`` "cpu": the numbers are host memory per rank)."""
    o = plan.options
    mem = "GPU memory" if device == "cuda" else "host memory (CPU ranks)"
    lines = [
        f"layout: world={plan.world_size} TP={plan.tp} PP={plan.pp} VPP={plan.vpp} CP={plan.cp} DP={plan.dp}"
        + (f" EP={plan.ep} ETP={plan.etp} expert-DP={plan.expert_dp}" if plan.is_moe else ""),
        f"model: {format_count(plan.total_params)} parameters"
        + (f" ({format_count(plan.active_params)} active per token)" if plan.is_moe else "")
        + f"; sequence {plan.seq_length} tokens "
        f"(prompt {o.prompt_length} + {plan.response_source}), {micro_batching(plan)}",
        f"options: params {o.params_bytes} B, grads {o.grad_bytes} B, distributed optimizer "
        f"{'on' if o.distributed_optimizer else 'off'}, recompute {o.recompute}, log-prob path "
        f"{'fused' if o.fused_logprobs else 'unfused'}, attention {o.attention} "
        f"({'[b, heads, s, s] scores materialised' if plan.keeps_scores else 'no score matrix kept'})"
        f"{', KL reference model' if plan.reference_model else ''}"
        f"{' (parked on the host between its passes)' if plan.reference_model and o.reference_offload else ''}"
        f"{', PPO critic (its weights, grads and Adam state are in TOTAL)' if plan.critic_model else ''}"
        f"{f', optimizer CPU offload {o.optimizer_offload_fraction:g}' if o.optimizer_offload_fraction else ''}",
        "",
        f"{mem} per rank, GiB (ref: KL reference model; activations: none / selective / full recompute; "
        f"logits: unfused / fused)",
        f"{'stage':>5} {'layers':>7} {'params':>8} {'grads':>8} {'optim':>8} {'ref':>8} {'act-none':>8} "
        f"{'act-sel':>8} {'act-full':>8} {'logits':>8} {'logitsF':>8} {'TOTAL':>8}",
    ]
    for st in plan.stages:
        a = st.activations
        lines.append(f"{st.stage:>5} {len(st.layers):>7} {_gb(st.params)} {_gb(st.grads)} {_gb(st.optimizer)} "
                     f"{_gb(st.reference)} {_gb(a['none'])} {_gb(a['selective'])} {_gb(a['full'])} {_gb(st.logits_unfused)} "
                     f"{_gb(st.logits_fused)} {_gb(st.total(o.recompute, o.fused_logprobs))}")
    peak = plan.peak()
    tot = peak.total(o.recompute, o.fused_logprobs)
    lines.append("")
    lines.append(f"peak: stage {peak.stage}, {tot / GiB:.2f} GiB (recompute={o.recompute}, "
                 f"{'fused' if o.fused_logprobs else 'unfused'} log-probs; excludes CUDA context / NCCL buffers)")
    if plan.reference_model and o.reference_offload:
        lines.append(f"KL reference parked (actor.ref_param_offload): on the GPU only during its log-prob pass; the "
                     f"total holds the larger of it and the activations; host memory: up to "
                     f"{max(st.reference for st in plan.stages) / GiB:.2f} GiB per rank")
    if o.optimizer_offload_fraction:
        host = max(st.host - (st.reference if st.reference_parked else 0.0) for st in plan.stages)
        lines.append(f"optimizer CPU offload: {100 * o.optimizer_offload_fraction:g}% of the optimizer state in host "
                     f"memory (CPU RAM, not GPU): up to {host / GiB:.2f} GiB per rank (fp32 main parameters, Adam "
                     f"moments, fp32 gradient copy)")
    if gpu_memory_gb is not None:
        knob = "actor.micro_batch_size" if plan.max_tokens_per_micro_batch is None else "actor.max_tokens_per_micro_batch"
        if tot > gpu_memory_gb * GiB:
            lines.append(f"WARNING: stage {peak.stage} needs {tot / GiB:.2f} GiB > GPU memory {gpu_memory_gb:g} GiB "
                         f"(cluster.gpu_memory_gb / --gpu-memory-gb); "
                         f"raise TP/PP/EP, use full recomputation, a smaller {knob}, or the fused log-prob path")
        else:
            lines.append(f"fits: {tot / GiB:.2f} GiB <= {gpu_memory_gb:g} GiB "
                         f"({100 * tot / (gpu_memory_gb * GiB):.0f}%)")
    return "\n".join(lines)
