"""``megatron-rl check`` with token-budget micro-batches (``actor.max_tokens_per_micro_batch``,
``actor.sequence_packing``): the plan of one micro-batch from the budget vs the activation terms written out
here by hand for a tiny GQA / SwiGLU model (TP 2 with sequence parallel, PP 2, CP 2, DP 2 on 16 GPUs), a budget
below the longest row is a ``check`` error naming the key and the row, and the plan without the key is the
fixed-rows plan.

    pytest tests/unit/test_check_token_budget.py
"""
import math

import pytest
import yaml

from megatron_rl.cli import main as cli_main
from megatron_rl.plan import load_job_config
from megatron_rl.logprobs.backend import CUDA_CHUNK_ELEMENTS
from megatron_rl.ops.memory import MemoryOptions, memory_plan
from megatron_rl.plan.sizing import memory_job

WORLD = 16
H, F, HEADS, GROUPS, D, V, LAYERS = 64, 128, 4, 2, 16, 256, 4
TP, PP, CP = 2, 2, 2
PROMPT, NEW = 100, 150
ROWS_PER_DP = 8 * 4 // 2          # prompts_per_step x n_samples_per_prompt / DP, 1 mini-batch
MBS = 4

JOB = {
    "cluster": {"device": "cuda", "nodes": 2, "gpus_per_node": 8, "gpu_memory_gb": 80},
    "model": {"num_layers": LAYERS, "hidden_size": H, "ffn_hidden_size": F, "num_attention_heads": HEADS,
              "num_query_groups": GROUPS, "kv_channels": D, "vocab_size": V, "max_position_embeddings": 4096,
              "untie_embeddings_and_output_weights": True},
    "parallel": {"tensor_model_parallel_size": TP, "pipeline_model_parallel_size": PP,
                 "context_parallel_size": CP, "sequence_parallel": True},
    "rollout": {"engine": "embedded", "max_new_tokens": NEW, "n_samples_per_prompt": 4},
    "data": {"task": "copy", "prompts_per_step": 8},
    "actor": {"micro_batch_size": MBS, "ppo_mini_batches": 1, "bf16": True},  # CP needs TE's bf16 attention
}


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(JOB))
    return str(path)


def _plan(job, *overrides, recompute="selective", world=WORLD, attention="te-fused"):
    cfg = load_job_config(job, list(overrides), world_size=world)
    return memory_plan(memory_job(cfg, world), MemoryOptions(prompt_length=PROMPT, params_bytes=2, recompute=recompute,
                                                 attention=attention))


def hand_layer(tokens, scores, e=2):
    """One layer on one rank holding ``tokens`` tokens (after the CP split), TP 2 with sequence parallel."""
    sp = tokens * H * e / TP                          # one sequence-parallel [tokens/TP, h] tensor
    qkv = tokens * (HEADS + 2 * GROUPS) * D * e / TP  # fused QKV output (V is a view of it)
    qk_rope = tokens * (HEADS + GROUPS) * D * e / TP  # Q and K after RoPE
    core_out = tokens * HEADS * D * e / TP
    if scores:                                        # bf16 probabilities + fp32 softmax output, [tokens x tokens]
        core = HEADS * tokens * tokens * (e + 4) / TP
    else:                                             # flash: fp32 log-sum-exp
        core = 4 * HEADS * tokens / TP
    mlp = 2 * sp + 2 * tokens * F * e / TP + tokens * F * e / TP  # norm in / out, fc1 out (gate, up), fc2 in
    return 2 * sp + qkv + qk_rope + core_out + core + mlp


def hand_logits(tokens, e=2):
    vloc = V // TP
    chunk = 4 * min(tokens, CUDA_CHUNK_ELEMENTS // vloc) * vloc
    return 2 * e * tokens * vloc + chunk   # logits + their gradient (params dtype) + one fp32 chunk


@pytest.mark.parametrize("recompute,attention,scores", [("selective", "te-fused", False), ("none", "te-fused", False),
                                                       ("none", "te-unfused", True)])
def test_budget_plans_one_row_of_the_budget(job, recompute, attention, scores):
    """Flash attention keeps no scores; an attention that materialises them (TE's unfused, which would refuse
    this packed CP job: the plan alone) keeps the [tokens x tokens] scores of the whole budget, an upper bound."""
    budget = 1000
    plan = _plan(job, f"actor.max_tokens_per_micro_batch={budget}", "actor.sequence_packing=true",
                 recompute=recompute, attention=attention)
    tokens = 500                                       # 1000 tokens / CP 2
    # longest row 100 + 150 = 250 -> multiple of TP 2 x 2*CP 4 = 8 -> 256; floor(1000 / 256) = 3 rows per
    # micro-batch at worst -> ceil(16 / 3) = 6 micro-batches
    assert plan.longest_row.padded == 256
    assert plan.microbatches == 6
    layers_per_stage = LAYERS // PP
    for st, in_flight in zip(plan.stages, (2, 1)):     # 1F1B: min(PP - stage, 6)
        assert st.microbatches_in_flight == in_flight
        assert st.activations[recompute] == pytest.approx(in_flight * layers_per_stage * hand_layer(tokens, scores))
    assert plan.stages[0].logits_unfused == 0
    assert plan.stages[-1].logits_unfused == pytest.approx(hand_logits(tokens))


def test_budget_micro_batch_count_sets_the_pipeline_in_flight(job):
    # 4 mini-batches: 4 rows per DP rank per mini-batch, floor(1024 / 256) = 4 rows fit -> 1 micro-batch;
    # stage 0 then holds only 1 in flight
    plan = _plan(job, "actor.max_tokens_per_micro_batch=1024", "actor.ppo_mini_batches=4")
    assert plan.microbatches == 1
    assert [st.microbatches_in_flight for st in plan.stages] == [1, 1]
    assert plan.stages[0].activations["selective"] == pytest.approx(2 * hand_layer(512, False))


def test_budget_interleaved_pipeline_gets_at_least_pp_micro_batches(job):
    # PP 4 x VPP 2 (8 layers: 1 per model chunk) on 32 GPUs (DP 2): 4 rows per DP rank per mini-batch fit one
    # micro-batch, which the actor splits into PP = 4 for the interleaved schedule; the peak on stage 0 is
    # min(2*(PP-1) + (VPP-1)*PP + 1, M*VPP) = min(11, 8) = 8 chunks = 4 micro-batches of its 2 layers
    plan = _plan(job, "actor.max_tokens_per_micro_batch=1024", "actor.sequence_packing=true", "actor.ppo_mini_batches=4",
                 "parallel.pipeline_model_parallel_size=4", "parallel.virtual_pipeline_model_parallel_size=2",
                 "model.num_layers=8", world=32)
    assert plan.microbatches == 4
    assert plan.stages[0].microbatches_in_flight == 4
    assert plan.stages[0].activations["selective"] == pytest.approx(4 * 2 * hand_layer(512, False))


def test_without_a_budget_the_plan_is_fixed_rows_packed_or_not(job):
    tokens = math.ceil((PROMPT + NEW) / CP) * MBS       # rows x longest sequence per CP rank
    for overrides in ((), ("actor.sequence_packing=true",)):
        plan = _plan(job, *overrides)
        assert plan.micro_batch_size == MBS and plan.microbatches == ROWS_PER_DP // MBS
        assert plan.stages[0].activations["selective"] == pytest.approx(2 * 2 * hand_layer(tokens, False))
        assert plan.stages[-1].logits_unfused == pytest.approx(hand_logits(tokens))


def _check(capsys, job, *args):
    rc = cli_main(["check", job, "--prompt-length", str(PROMPT), *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_check_rejects_a_budget_below_the_longest_row(job, capsys):
    rc, out, err = _check(capsys, job, "actor.max_tokens_per_micro_batch=255")
    assert rc == 2
    assert ("actor.max_tokens_per_micro_batch: 255 tokens cannot hold the longest possible row, 256 tokens: "
            "prompt 100 (--prompt-length) + rollout.max_new_tokens 150 = 250, rounded up to a multiple of 8 "
            "(TP 2 with sequence parallel x 2*CP 4 with context parallel); set it to at least 256") in err
    assert "config OK" not in out and "peak:" not in out


def test_check_passes_a_budget_that_holds_the_longest_row(job, capsys):
    rc, out, err = _check(capsys, job, "actor.max_tokens_per_micro_batch=256", "actor.sequence_packing=true")
    assert rc == 0, err
    assert "config OK" in out and "fits:" in out
    assert "micro-batch <= 256 tokens, packed (actor.max_tokens_per_micro_batch" in out
    assert "at most 16 micro-batches per mini-batch per DP rank" in out   # 1 row of 256 per micro-batch
    assert "error" not in err.lower() and "WARNING" not in out + err


def test_check_says_packing_without_a_budget_is_planned_padded(job, capsys):
    rc, out, err = _check(capsys, job, "actor.sequence_packing=true")
    assert rc == 0, err
    assert f"micro-batch {MBS} rows, packed (planned as padded rows: an upper bound), " \
           f"{ROWS_PER_DP // MBS} micro-batches per mini-batch per DP rank" in out


def test_interleaved_count_not_a_multiple_of_pp_runs_as_one_group(job):
    # 5 micro-batches on PP 4 x VPP 2: megatron's interleaved schedule needs a multiple of its group size, so the
    # actor makes all 5 one group; the warm-up then runs (VPP-1) x 5 micro-batches ahead on stage 0:
    # min(2*(PP-1) + (VPP-1)*5 + 1, 5*VPP) = min(12, 10) = 10 chunks = 5 micro-batches of its layers
    from megatron_rl.ops.memory import _in_flight

    assert _in_flight(0, 4, 2, 5) == 10 / 2
    assert _in_flight(3, 4, 2, 9) == (0 + 9 + 1) / 2            # last stage: (VPP-1) x 9 + 1 chunks
    assert _in_flight(3, 4, 2, 8) == (0 + 4 + 1) / 2            # a multiple of PP: groups of PP
