"""``megatron-rl check``: memory plan of the shipped 7B and MoE configs vs figures computed here by hand
(HF-style per-module parameter counts and the activation terms written out tensor by tensor), the
published total parameter counts, and the CLI's exit codes / messages.

    pytest tests/integration/test_check_memory.py
"""
import os

import pytest

from megatron_rl.plan import load_job_config
from megatron_rl.logprobs.backend import CUDA_CHUNK_ELEMENTS
from megatron_rl.ops.memory import MemoryOptions, memory_plan
from megatron_rl.plan.sizing import memory_job
from megatron_rl.testing.cli import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
Q7 = os.path.join(ROOT, "configs", "qwen2.5_7b_1x8.yaml")
#: the hand-derived Qwen2.5-7B numbers below are for TP=2 / DP=4 (the shipped file runs TP=4 to fit 80 GiB)
Q7_TP2 = ["parallel.tensor_model_parallel_size=2"]
Q30 = os.path.join(ROOT, "configs", "qwen3_30b_a3b_2x8.yaml")
DS = os.path.join(ROOT, "configs", "deepseek_v3_scale_64x8.yaml")
DS671 = os.path.join(ROOT, "configs", "deepseek_v3_671b_64x8.yaml")
#: verl's examples/grpo_trainer/run_deepseek671b_math_megatron_80gb.sh (commit b178a3cd): 32 x 8 H100, TP 1, PP 16
#: (4 / 1 layers on the first / last stage), EP 16, full recompute, 2048 + 4096 tokens, budget 6144, KL loss
VERL_DS_80GB = ["parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
                "parallel.pipeline_model_parallel_size=16", "parallel.expert_model_parallel_size=16",
                "parallel.num_layers_in_first_pipeline_stage=4", "parallel.num_layers_in_last_pipeline_stage=1",
                "rollout.max_new_tokens=4096", "actor.max_tokens_per_micro_batch=6144",
                "actor.recompute_granularity=full", "actor.recompute_method=uniform",
                "actor.recompute_num_layers=1", "actor.policy_loss.kl_loss_coef=0.001"]


def rel(a, b):
    return abs(a - b) / abs(b)


# ------------------------------------------------------------------ published totals (model cards)
def test_total_parameters_match_published_counts():
    from megatron_rl.ops.memory import total_parameters

    q7 = load_job_config(Q7, Q7_TP2, world_size=8).model
    assert rel(total_parameters(q7), 7.61e9) < 0.005          # Qwen2.5-7B: 7.61B
    q30 = load_job_config(Q30, world_size=16).model
    assert rel(total_parameters(q30), 30.5e9) < 0.005         # Qwen3-30B-A3B: 30.5B total
    ds = load_job_config(DS, world_size=512).model
    # DeepSeek-V3: 671B main model; ours has 3 extra MoE layers and GQA instead of MLA (documented).
    h, fm = 7168, 2048
    extra_layers = 3 * (257 * 3 * h * fm + 256 * h + 2 * h + h * (128 + 16) * 128 + 128 * 128 * h)
    assert rel(total_parameters(ds) - extra_layers, 671e9) < 0.01


# ------------------------------------------------------------------ Qwen2.5-7B, TP=2, DP=4, 1 stage
def qwen7b_rank_params(tp=2):
    h, f, V, heads, kv, d = 3584, 18944, 152064, 28, 4, 128
    q_proj = h * heads * d / tp + heads * d / tp          # weight + bias
    k_proj = h * kv * d / tp + kv * d / tp
    v_proj = h * kv * d / tp + kv * d / tp
    o_proj = heads * d * h / tp
    gate = up = h * f / tp
    down = f * h / tp
    norms = 2 * h
    layer = q_proj + k_proj + v_proj + o_proj + gate + up + down + norms
    return 28 * layer + V * h / tp + V * h / tp + h      # embed_tokens + lm_head + final norm


def test_qwen7b_params_grads_optimizer():
    cfg = load_job_config(Q7, Q7_TP2, world_size=8)
    plan = memory_plan(memory_job(cfg, 8), MemoryOptions(prompt_length=1024))
    (st,) = plan.stages
    n = qwen7b_rank_params()
    assert st.dense_params + st.expert_params == n
    assert st.params == 2 * n                   # bf16
    assert st.grads == 4 * n                    # fp32 main grads
    assert st.optimizer == pytest.approx(12 * n / 4)   # fp32 master + 2 moments, sharded over DP=4
    no_dist = memory_plan(memory_job(cfg, 8), MemoryOptions(distributed_optimizer=False)).stages[0]
    assert no_dist.optimizer == pytest.approx(12 * n)
    fp32 = memory_plan(memory_job(cfg, 8), MemoryOptions(params_bytes=4)).stages[0]
    assert fp32.params == 4 * n and fp32.optimizer == pytest.approx(8 * n / 4)   # no master copy


def qwen7b_scores(s, b, tp=2):
    """One Qwen2.5-7B layer's materialised attention scores: fp32 softmax output + bf16 probabilities."""
    return 28 / tp * s * s * b * (4 + 2)


def qwen7b_layer_acts(s, b, scores, tp=2):
    """One Qwen2.5-7B layer, TP=2 with sequence parallel, bf16 activations, no dropout; ``scores``: the core
    attention keeps its [b, heads, s, s] scores (else flash attention's log-sum-exp)."""
    h, f, heads, kv, d = 3584, 18944, 28, 4, 128
    bf16 = 2
    sp_part = s * b * h * bf16 / tp                 # one [s/tp, b, h] tensor
    attn = (sp_part                                 # input RMSNorm input
            + sp_part                               # QKV linear input (kept sequence-parallel)
            + s * b * heads * d * bf16 / tp         # fused QKV output: Q part
            + 2 * s * b * kv * d * bf16 / tp        # fused QKV output: K, V parts (V is a view: all kept)
            + s * b * heads * d * bf16 / tp         # Q after RoPE
            + s * b * kv * d * bf16 / tp            # K after RoPE
            + s * b * heads * d * bf16 / tp)        # attention output = o_proj input (residual add: nothing)
    if scores:
        attn += qwen7b_scores(s, b, tp)             # fp32 scores + bf16 probabilities
    else:
        attn += heads / tp * s * b * 4              # flash attention's fp32 log-sum-exp
    mlp = (sp_part + sp_part                        # pre-MLP norm input, fc1 input
           + s * b * 2 * f * bf16 / tp              # gate and up outputs
           + s * b * f * bf16 / tp)                 # SiLU(gate) * up = down_proj input
    return attn + mlp


@pytest.mark.parametrize("attention", ["te-fused", "te-unfused", "local"])
def test_qwen7b_activations(attention):
    """Flash attention keeps a log-sum-exp; TE's unfused and megatron's local attention materialise the scores:
    kept per layer without recompute, one layer's at a time with selective recompute, part of the working
    layer with full recompute."""
    cfg = load_job_config(Q7, Q7_TP2, world_size=8)
    plan = memory_plan(memory_job(cfg, 8), MemoryOptions(prompt_length=1024, attention=attention))
    (st,) = plan.stages
    s, b, h, tp = 1024 + 4096, 2, 3584, 2
    # 64 prompts x 8 samples / DP 4 = 128 sequences per DP rank, 4 mini-batches -> 32 -> 16 micro-batches of 2;
    # PP = 1: one micro-batch in flight
    assert plan.microbatches == 16 and st.microbatches_in_flight == 1
    scores = attention != "te-fused"
    assert plan.keeps_scores == scores
    assert st.activations["none"] == pytest.approx(28 * qwen7b_layer_acts(s, b, scores), rel=1e-12)
    once = qwen7b_scores(s, b) if scores else 0
    assert st.activations["selective"] == pytest.approx(28 * qwen7b_layer_acts(s, b, False) + once, rel=1e-12)
    kept = 28 * s * b * h * 2 / tp
    assert st.activations["full"] == pytest.approx(kept + qwen7b_layer_acts(s, b, scores), rel=1e-12)


def test_packed_rows_on_the_local_backend_keep_no_scores():
    """Without TE packed rows run through SDPA per segment: no [b, heads, s, s] scores; TE's unfused backend
    refuses packing (validation) and would materialise them."""
    cfg = load_job_config(Q7, Q7_TP2 + ["actor.sequence_packing=true", "actor.max_tokens_per_micro_batch=16384"],
                          world_size=8)
    assert not memory_plan(memory_job(cfg, 8), MemoryOptions(prompt_length=1024, attention="local")).keeps_scores
    assert memory_plan(memory_job(cfg, 8), MemoryOptions(prompt_length=1024, attention="te-unfused")).keeps_scores


@pytest.mark.parametrize("bf16,dist_opt", [(True, True), (True, False), (False, False)])
def test_kl_reference_model(bf16, dist_opt):
    """kl_loss_coef > 0: the frozen reference holds its weights in the params dtype, sharded like the actor (TP=2
    here), and nothing else: no gradient buffer, no main copy, no Adam state, whatever the optimizer."""
    n = qwen7b_rank_params()
    pb = 2 if bf16 else 4
    opts = MemoryOptions(prompt_length=1024, params_bytes=pb, distributed_optimizer=dist_opt)
    cfg = load_job_config(Q7, Q7_TP2 + ["actor.policy_loss.kl_loss_coef=0.1"], world_size=8)
    plan = memory_plan(memory_job(cfg, 8), opts)
    (st,) = plan.stages
    assert plan.reference_model and st.reference == pytest.approx(pb * n)
    without = memory_plan(memory_job(load_job_config(Q7, Q7_TP2, world_size=8), 8), opts).stages[0]
    assert without.reference == 0
    assert st.total("none", False) - without.total("none", False) == pytest.approx(st.reference)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_optimizer_cpu_offload_moves_the_state_to_the_host(fraction):
    """``optimizer_offload_fraction`` f: the device keeps (1 - f) of the 12 bytes per optimizer element (bf16
    params: fp32 main + 2 moments); the host holds f x 16 bytes (those + megatron's fp32 gradient copy); params,
    grads and activations do not move. DP=4 with the distributed optimizer: n / 4 elements per rank."""
    n = qwen7b_rank_params()
    cfg = load_job_config(Q7, Q7_TP2, world_size=8)
    base = memory_plan(memory_job(cfg, 8), MemoryOptions(prompt_length=1024, params_bytes=2)).stages[0]
    st = memory_plan(memory_job(cfg, 8), MemoryOptions(prompt_length=1024, params_bytes=2,
                                           optimizer_offload_fraction=fraction)).stages[0]
    assert base.optimizer == pytest.approx(12 * n / 4) and base.host == 0
    assert st.optimizer == pytest.approx((1 - fraction) * 12 * n / 4)
    assert st.host == pytest.approx(fraction * 16 * n / 4)
    assert (st.params, st.grads, st.activations) == (base.params, base.grads, base.activations)
    with pytest.raises(ValueError, match="optimizer_offload_fraction"):
        memory_plan(memory_job(cfg, 8), MemoryOptions(prompt_length=1024, optimizer_offload_fraction=1.5))


def test_parked_kl_reference_is_held_when_the_activations_are_not():
    """``actor.ref_param_offload``: the reference's weights (2 B x the rank's parameters, by hand) go to the host
    line; the stage total holds the larger of them and the train step's activations instead of their sum."""
    n = qwen7b_rank_params()
    kl = Q7_TP2 + ["actor.policy_loss.kl_loss_coef=0.1"]
    opts = dict(prompt_length=1024, params_bytes=2)
    held = memory_plan(memory_job(load_job_config(Q7, kl, world_size=8), 8), MemoryOptions(**opts)).stages[0]
    parked = memory_plan(memory_job(load_job_config(Q7, kl + ["actor.ref_param_offload=true"], world_size=8), 8),
                         MemoryOptions(**opts, reference_offload=True)).stages[0]
    assert parked.reference == held.reference == pytest.approx(2 * n) and parked.host == pytest.approx(2 * n)
    acts = held.activations["none"]
    assert held.total("none", False) - parked.total("none", False) == pytest.approx(min(2 * n, acts))


def test_verls_deepseek_v3_80gb_job_fits_with_the_reference_as_its_weights():
    """verl runs DeepSeek-V3 on 256 x 80 GB with a KL reference: here too, once the reference is its bf16 weights
    (= the params column) -- planned as a second actor (+ fp32 grads + fp32 main / DP) it would not fit."""
    cfg = load_job_config(DS671, VERL_DS_80GB, world_size=256)
    plan = memory_plan(memory_job(cfg, 256), MemoryOptions(prompt_length=2048, params_bytes=2, recompute="full"))
    peak = plan.peak()
    for st in plan.stages:
        assert st.reference == st.params
    assert peak.total("full", False) < 80 * 2**30
    second_actor = peak.grads + 4 * (peak.dense_params / plan.dp + peak.expert_params / plan.expert_dp)
    assert peak.total("full", False) + second_actor > 80 * 2**30


def test_qwen7b_full_recompute_and_logits():
    cfg = load_job_config(Q7, Q7_TP2, world_size=8)
    st = memory_plan(memory_job(cfg, 8), MemoryOptions(prompt_length=1024)).stages[0]
    s, b, h, V, tp = 5120, 2, 3584, 152064, 2
    kept = 28 * s * b * h * 2 / tp
    assert st.activations["full"] == pytest.approx(kept + qwen7b_layer_acts(s, b, False))
    T = s * b
    rows = CUDA_CHUNK_ELEMENTS // (V // tp)                   # tokens per fp32 chunk on GPU
    assert st.logits_fused == 4 * rows * (V // tp)
    # the actor's vocab-parallel path: bf16 logits + their bf16 gradient + one fp32 chunk
    assert st.logits_unfused == 2 * 2 * T * V / tp + 4 * rows * (V // tp)
    assert st.logits_fused < st.logits_unfused / 20


# ------------------------------------------------------------------ Qwen3-30B-A3B, TP2 PP2 EP8 ETP1 on 16
def test_qwen3_moe_per_stage():
    cfg = load_job_config(Q30, world_size=16)
    plan = memory_plan(memory_job(cfg, 16), MemoryOptions(prompt_length=1024))
    assert (plan.dp, plan.expert_dp) == (4, 1)
    h, heads, kv, d, E, fm, V, tp, ep = 2048, 32, 4, 128, 128, 768, 151936, 2, 8
    attn = h * heads * d / tp + 2 * h * kv * d / tp + heads * d * h / tp
    norms = 2 * h + 2 * d                              # input/post-attn RMSNorm + q_norm/k_norm
    router = E * h
    experts = (E / ep) * (3 * h * fm)                  # gate, up, down of the local experts (ETP=1)
    dense_layer = attn + norms + router
    emb = V * h / tp
    s0_dense, s0_exp = 24 * dense_layer + emb, 24 * experts
    s1_dense, s1_exp = 24 * dense_layer + emb + h, 24 * experts   # lm_head + final norm on the last stage
    for st, dn, ex in ((plan.stages[0], s0_dense, s0_exp), (plan.stages[1], s1_dense, s1_exp)):
        assert st.dense_params == dn and st.expert_params == ex
        assert st.params == 2 * (dn + ex) and st.grads == 4 * (dn + ex)
        # dense Adam state over DP=4, expert state over expert-DP=1
        assert st.optimizer == pytest.approx(12 * dn / 4 + 12 * ex / 1)
    # activations, selective recompute: 1F1B keeps PP - stage micro-batches on each stage
    s, b, k = 1024 + 8192, 1, 8
    sp = lambda: s * b * h * 2 / tp                    # noqa: E731
    attn_act = (2 * sp() + s * b * (heads + 2 * kv) * d * 2 / tp + s * b * (heads + kv) * d * 2 / tp
                + s * b * heads * d * 2 / tp + heads / tp * s * b * 4)
    pairs = s * b * k / tp                            # token-expert pairs after the all-to-all (balanced)
    moe_act = (sp() + s * b * E * 4 / tp + sp()       # norm in, fp32 router logits, dispatcher input
               + pairs * h * 2                        # permuted tokens (expert input; outputs are not kept)
               + pairs * (2 * fm * 2 + fm * 2))       # fc1 out (gate, up) and fc2 in
    per_layer = attn_act + moe_act
    assert plan.stages[0].microbatches_in_flight == 2 and plan.stages[1].microbatches_in_flight == 1
    assert plan.stages[0].activations["selective"] == pytest.approx(2 * 24 * per_layer, rel=1e-12)
    assert plan.stages[1].activations["selective"] == pytest.approx(1 * 24 * per_layer, rel=1e-12)
    rows = min(s * b, CUDA_CHUNK_ELEMENTS // (V // tp))
    assert plan.stages[0].logits_unfused == 0
    assert plan.stages[1].logits_unfused == 2 * 2 * s * b * V / tp + 4 * rows * (V // tp)


def test_deepseek_interleaved_in_flight_matches_korthikanti():
    cfg = load_job_config(DS, world_size=512)
    plan = memory_plan(memory_job(cfg, 512))
    p, v = 8, 4
    # stage 0 of the interleaved schedule holds L*(1 + (p-1)/(p*v)) layers' activations (Korthikanti eq. 5)
    layers_per_stage = 64 / p
    assert plan.stages[0].microbatches_in_flight * layers_per_stage == pytest.approx(64 * (1 + (p - 1) / (p * v)))
    # dense layers 0-2 are on stages 0, 0, 1 (chunk 0 of stages 0..1 holds layers 0-1 and 2-3)
    assert plan.stages[0].layers[:2] == [0, 1] and plan.stages[1].layers[:2] == [2, 3]
    assert plan.stages[0].layers[2:4] == [16, 17]
    assert plan.stages[0].expert_params == 6 * (256 // 64) * 3 * 7168 * 2048


# ------------------------------------------------------------------ CLI
def _cli(*args):
    """``megatron-rl check ARGS`` in this process (tests/integration/test_check_cli.py starts the console script)."""
    return run_cli("check", *args, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_cli_ok_prints_plan():
    """No flags: the file's cluster: section (2 nodes x 8 GPUs, 80 GiB) is planned."""
    r = _cli(Q30)
    assert r.returncode == 0, r.stderr
    assert "world size 16 (2 node(s) x 8 GPU(s))" in r.stdout
    assert "TP=2" in r.stdout and "DP=4" in r.stdout and "EP=8" in r.stdout and "fits:" in r.stdout
    assert "WARNING" not in r.stdout


def _row(out):
    line = [ln for ln in out.splitlines() if ln.split()[:1] == ["0"]][0].split()
    return [float(x) for x in line[2:6]]  # params, grads, optim, ref in GiB


def test_cli_plans_what_the_actor_builds_and_flags_override():
    """The shipped file: bf16 params (2 B) and Adam state sharded over DP=4 (actor.bf16,
    actor.use_distributed_optimizer); fp32 and replicated state when the keys say so, or by the flags. Params of
    one rank of Qwen2.5-7B at TP=2 counted by hand."""
    n = qwen7b_rank_params(tp=2)
    r = _cli(Q7, *Q7_TP2)
    assert r.returncode == 0, r.stderr
    params, grads, optim, ref = _row(r.stdout)
    assert params == pytest.approx(2 * n / 2**30, abs=0.01) and grads == pytest.approx(4 * n / 2**30, abs=0.01)
    assert optim == pytest.approx(12 * n / 4 / 2**30, abs=0.01) and ref == 0  # sharded over DP=4
    assert "params 2 B (the actor builds bf16)" in r.stdout and "sharded over DP" in r.stdout
    assert "fits:" in r.stdout
    r = _cli(Q7, *Q7_TP2, "actor.bf16=false", "actor.use_distributed_optimizer=false", "--gpu-memory-gb", "200")
    assert r.returncode == 0, r.stderr
    params, grads, optim, ref = _row(r.stdout)
    assert params == pytest.approx(4 * n / 2**30, abs=0.01) and optim == pytest.approx(8 * n / 2**30, abs=0.01)
    assert "params 4 B (the actor builds fp32)" in r.stdout and "on every DP rank" in r.stdout
    r = _cli(Q7, *Q7_TP2, "--params-bytes", "4", "--no-distributed-optimizer", "--gpu-memory-gb", "200")
    assert _row(r.stdout)[:3] == [params, grads, optim]


def test_cli_plans_the_kl_reference_model():
    n = qwen7b_rank_params(tp=2)
    r = _cli(Q7, *Q7_TP2, "actor.policy_loss.kl_loss_coef=0.05")
    assert r.returncode == 0, r.stderr
    ref = _row(r.stdout)[3]
    assert ref == pytest.approx(2 * n / 2**30, abs=0.01)  # bf16 weights only
    assert "KL reference model" in r.stdout


def test_cli_attention_backend_and_its_scores():
    """The attention line names the backend; without TE (local attention) the bf16 scores of Qwen2.5-7B's
    padded rows are planned, and they do not fit 80 GiB; fp32 on TE (unfused) likewise."""
    r = _cli(Q7, *Q7_TP2)
    assert "attention: te-fused" in r.stdout and "assumed installed" in r.stdout and "WARNING" not in r.stdout
    r = _cli(Q7, *Q7_TP2, "--no-transformer-engine")
    assert r.returncode == 0, r.stderr
    assert "attention: local" in r.stdout and "scores materialised" in r.stdout and "WARNING" in r.stdout
    r = _cli(Q7, *Q7_TP2, "actor.bf16=false", "--transformer-engine")
    assert "attention: te-unfused" in r.stdout and "WARNING" in r.stdout


def test_cli_warns_and_strict_exit():
    r = _cli(Q7, *Q7_TP2, "--recompute", "none", "--no-transformer-engine")
    assert r.returncode == 0 and "WARNING" in r.stdout and "> GPU memory 80 GiB" in r.stdout
    r = _cli(Q7, "--gpu-memory-gb", "20", "--strict")
    assert r.returncode == 3


def test_cli_invalid_config_names_the_key_and_the_nodes_that_fit():
    r = _cli(Q30, "--nodes", "1", "--gpus-per-node", "8", "actor.lr=-1")
    assert r.returncode == 2
    assert "actor.lr: must be > 0" in r.stderr
    assert ("world size: 8 ranks are not divisible by parallel.expert_tensor_parallel_size x "
            "parallel.expert_model_parallel_size x parallel.pipeline_model_parallel_size = 1x8x2 = 16") in r.stderr
    assert "hint: --nodes 2 (world size 16) fits this layout" in r.stderr
    r = _cli(DS, "--nodes", "32")
    assert r.returncode == 2 and "hint: --nodes 64 (world size 512)" in r.stderr
    r = _cli(Q7, "parallel.tensor_model_paralel_size=4")
    assert r.returncode == 2 and "parallel.tensor_model_paralel_size: unknown key (did you mean " \
                                  "'tensor_model_parallel_size'?)" in r.stderr
    r = _cli(os.path.join(ROOT, "configs", "nope.yaml"))
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_cli_options_after_overrides():
    r = _cli(Q30, "rollout.max_new_tokens=1024", "--nodes", "2", "--recompute", "full", "--prompt-length", "1024")
    assert r.returncode == 0, r.stderr
    assert "sequence 2048 tokens" in r.stdout and "recompute full" in r.stdout
    # default prompt: the task's longest prompt, 'add:99999+99999=' = 14 char-tokenizer tokens (add : 5 + 5 =)
    r = _cli(Q30, "rollout.max_new_tokens=1024", "data.task=add", "data.path=null", "data.task_kwargs={max_digits: 5}")
    assert "sequence 1038 tokens (prompt 14 + " in r.stdout, r.stdout + r.stderr


def test_cli_prompt_length_of_a_prompt_file_without_tokenizer(tmp_path):
    """No tokenizer available: the longest prompt's UTF-8 bytes (an upper bound for byte-level BPE)."""
    p = tmp_path / "prompts.jsonl"
    p.write_text('{"prompt": "short", "answer": "1"}\n{"prompt": "caf\u00e9 longer prompt", "answer": "2"}\n')
    r = _cli(Q30, "data.task=file", f"data.path={p}", "data.task_kwargs={}", "rollout.max_new_tokens=100")
    assert r.returncode == 0, r.stderr
    assert "prompt 19 tokens (UTF-8 bytes of the longest prompt" in r.stdout  # 'café longer prompt': 18 chars, é = 2 B
    assert "sequence 119 tokens" in r.stdout


def test_cli_recompute_follows_the_actor():
    r = _cli(Q7, "actor.recompute_granularity=full", "actor.recompute_method=uniform",
             "actor.recompute_num_layers=1")
    assert r.returncode == 0, r.stderr
    assert "recompute full" in r.stdout
    r = _cli(Q7, "actor.recompute_granularity=full", "actor.recompute_method=uniform", "actor.recompute_num_layers=1",
             "--recompute", "none")
    assert "recompute none" in r.stdout
    assert "recompute none" in _cli(Q7).stdout  # the trainer's default: no recompute


def test_cli_suggests_no_node_count_when_the_model_refuses_the_parallel_size():
    """TP=3 on a model with 4 heads: no node count fixes it, so no `--nodes` hint (it suggested --nodes 3)."""
    r = _cli(Q7, "parallel.tensor_model_parallel_size=3")
    assert r.returncode == 2
    assert "is not divisible by parallel.tensor_model_parallel_size=3" in r.stderr
    assert "hint: --nodes" not in r.stderr
    assert "hint: fix parallel.tensor_model_parallel_size first" in r.stderr
