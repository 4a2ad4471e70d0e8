"""Parallel layouts of the GPT / MoE builder match the TP1/PP1 megatron reference.

A TP1/PP1 model is built once (world 1); its full state dict is loaded into each layout with
``megatron_rl.convert.live`` (and gathered back, which must give it unchanged). Every layout then runs megatron's own
``get_forward_backward_func()`` (forward-only, then forward+backward with per-token CE through
Megatron DDP + ``finalize_model_grads``) on micro-batches of *different lengths*; logits and the
(unsharded) gradients must equal the reference. The PP schedules exercise the CPU patches (p2p,
``device="cuda"`` literals, tied embeddings across stages), SP the norm patch, EP the alltoall patches.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_models_parallel.py -q``
"""
import dataclasses
import functools

import pytest
import torch

from megatron_rl.parallel.groups import ActorGroups  # noqa: E402
from megatron_rl.platform.select import apply_cpu_patches

apply_cpu_patches()

from megatron_rl.convert.live import gather_full_state_dict, load_full_state_dict_into_model  # noqa: E402
from megatron_rl.convert.partition import RankCoords, merge_state_dicts  # noqa: E402
from megatron_rl.models import ModelConfig, build_gpt_model  # noqa: E402
from megatron_rl.parallel import ParallelConfig, destroy_model_parallel, initialize_model_parallel  # noqa: E402
from megatron_rl.testing.distributed import run_ranks  # noqa: E402

DENSE = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64,
                    ffn_hidden_size=48, add_qkv_bias=True, untie_embeddings_and_output_weights=False,
                    max_position_embeddings=64, rotary_base=10000.0, init_method_std=0.05)
MOE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64,
                  ffn_hidden_size=48, kv_channels=8, qk_layernorm=True, untie_embeddings_and_output_weights=True,
                  max_position_embeddings=64, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                  moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1], init_method_std=0.05)
DENSE8 = dataclasses.replace(DENSE, num_layers=8)  # PP4 x VPP2
SEQ_LENS = (8, 12, 6, 10)  # one micro-batch each (batch 2); lengths even so SP over TP2 divides them
# With VPP the builder fixes shapes (megatron-core 0.16's interleaved schedule cannot exchange
# variable shapes), so the interleaved test pads every micro-batch to one length.
EQUAL_LENS = (10, 10, 10, 10)


def _microbatches(vocab, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    mbs = []
    for s in lens:
        ids = torch.randint(0, vocab, (2, s + 1), generator=g)
        mbs.append({"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(),
                    "position_ids": torch.arange(s).unsqueeze(0).expand(2, -1).contiguous()})
    return mbs


def _forward_step(with_labels, data_iterator, model):
    mb = next(data_iterator)
    out = model(mb["tokens"], mb["position_ids"], attention_mask=None,
                labels=mb["labels"] if with_labels else None)

    def loss_func(output):
        if with_labels:
            return output.float().mean(), {}
        return output.sum() * 0.0, {"logits": output.detach().clone()}

    return out, loss_func


def _run_layout(rank, world, pc, mc, full_sd, microbatches, optimizer_step=False):
    """Build the layout, load weights, forward-only + one forward/backward (+ optionally one Megatron
    Adam step with gradient clipping); return local results."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    initialize_model_parallel(pc, seed=123, model=mc)
    groups = ActorGroups.from_parallel_state(sequence_parallel=pc.sequence_parallel)
    chunks = build_gpt_model(mc, pc)
    if full_sd is None:
        assert world == 1
        full_sd = {k: v.clone() for k, v in chunks[0].state_dict().items() if not k.endswith("_extra_state")}
    else:
        load_full_state_dict_into_model(chunks, full_sd, mc, groups)
    gathered = gather_full_state_dict(chunks, mc, groups)  # collective; full dict on rank 0
    if rank == 0:
        assert sorted(gathered) == sorted(full_sd), (sorted(set(gathered) ^ set(full_sd)))
        for k in full_sd:
            assert torch.equal(gathered[k], full_sd[k]), f"gather_full_state_dict: {k} differs"
    tcfg = chunks[0].config
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=False)
    model = [DistributedDataParallel(tcfg, ddp_cfg, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    tcfg.finalize_model_grads_func = finalize_model_grads
    opt = None
    if optimizer_step:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        # clip_grad far below the grad norm so clipping (with the model-parallel grad norm) is active;
        # adam_eps=1e-2: Adam's first step is lr*g/(|g|+eps), ill-conditioned for |g| << 1e-8 eps
        ocfg = OptimizerConfig(optimizer="adam", lr=1e-2, adam_eps=1e-2, weight_decay=0.01, clip_grad=0.05,
                               bf16=False,
                               fp16=False, params_dtype=torch.float32, use_distributed_optimizer=False)
        opt = get_megatron_optimizer(ocfg, model)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = microbatches[dp_rank::dp]
    fb = get_forward_backward_func()
    seq = max(mb["tokens"].shape[1] for mb in microbatches)
    common = dict(model=model, num_microbatches=len(mine), seq_length=seq, micro_batch_size=2)
    def data():  # one iterator per model chunk (interleaved VPP pulls from each)
        its = [iter(mine) for _ in model]
        return its if len(its) > 1 else its[0]

    out = fb(forward_step_func=functools.partial(_forward_step, False), data_iterator=data(),
             forward_only=True, **common)
    logits = [d["logits"] for d in out] if ps.is_pipeline_last_stage() else None
    for m in model:
        m.zero_grad_buffer()
    fb(forward_step_func=functools.partial(_forward_step, True), data_iterator=data(),
       forward_only=False, **common)
    grads = {}
    for i, m in enumerate(model):
        grads[RankCoords.from_groups(groups, vp_stage=i)] = {
            n: p.main_grad.detach().clone() for n, p in m.module.named_parameters()}
    res = {"dp_rank": dp_rank, "dp": dp, "tp_rank": ps.get_tensor_model_parallel_rank(),
           "logits": logits, "grads": grads, "full_sd": full_sd if world == 1 else None}
    if opt is not None:
        ok, grad_norm, _ = opt.step()
        res["step"] = (ok, grad_norm)
        res["params"] = {RankCoords.from_groups(groups, vp_stage=i): {
            k: v.detach().clone() for k, v in m.module.state_dict().items() if not k.endswith("_extra_state")}
            for i, m in enumerate(model)}
    destroy_model_parallel()
    return res


def _gather_logits(results, n_mb):
    """Per micro-batch full-vocab logits from the last-stage ranks (concatenated over TP)."""
    per_mb = {}
    for r in results:
        if r["logits"] is None:
            continue
        for j, lg in enumerate(r["logits"]):
            mb = r["dp_rank"] + j * r["dp"]
            per_mb.setdefault(mb, {})[r["tp_rank"]] = lg
    assert sorted(per_mb) == list(range(n_mb))
    return [torch.cat([per_mb[i][t] for t in sorted(per_mb[i])], dim=-1) for i in range(n_mb)]


def _gather_grads(results, mc, pc, key="grads"):
    shards = {}
    for r in results:
        for coords, g in r[key].items():
            if coords in shards:  # data-parallel replica: DDP all-reduced, must be identical
                for k in g:
                    torch.testing.assert_close(g[k], shards[coords][k], rtol=0, atol=0)
            shards[coords] = g
    return merge_state_dicts(shards, mc.num_layers, not mc.untie_embeddings_and_output_weights,
                             pc.tensor_model_parallel_size, pc.etp, mc.num_moe_experts or 0)


@functools.lru_cache(maxsize=None)
def _reference(which, lens=SEQ_LENS):
    mc = {"dense": DENSE, "dense8": DENSE8, "moe": MOE}[which]
    mbs = _microbatches(mc.vocab_size, lens)
    (res,) = run_ranks(_run_layout, 1, ParallelConfig(), mc, None, mbs, timeout=60)
    return mc, mbs, res["full_sd"], _gather_logits([res], len(mbs)), _gather_grads([res], mc, ParallelConfig())


def _check_layout(which, pc, world, lens=SEQ_LENS):
    mc, mbs, full_sd, ref_logits, ref_grads = _reference(which, lens)
    results = run_ranks(_run_layout, world, pc, mc, full_sd, mbs, timeout=90)
    logits = _gather_logits(results, len(mbs))
    for i, (a, b) in enumerate(zip(logits, ref_logits)):
        assert a.shape == b.shape == (2, lens[i], mc.vocab_size)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=lambda m: f"logits micro-batch {i}: {m}")
    grads = _gather_grads(results, mc, pc)
    assert sorted(grads) == sorted(ref_grads)
    for k in ref_grads:
        assert ref_grads[k].abs().max() > 0, f"reference grad of {k} is all zero (test would be vacuous)"
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {k}: {m}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,pc,world", [
    ("tp2", ParallelConfig(tensor_model_parallel_size=2), 2),
    ("tp2_sp", ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), 2),
    ("pp2", ParallelConfig(pipeline_model_parallel_size=2), 2),
    ("dp2", ParallelConfig(), 2),
    ("tp2_pp2", ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 4),
])
def test_dense_layout_matches_tp1(name, pc, world):
    _check_layout("dense", pc, world)


@pytest.mark.timeout(120)
def test_dense_interleaved_vpp_matches_tp1():
    pc = ParallelConfig(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    _check_layout("dense8", pc, 4, lens=EQUAL_LENS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,pc,world", [
    ("ep2", ParallelConfig(expert_model_parallel_size=2), 2),
    ("tp2_sp_etp2", ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), 2),
    ("tp2_ep2_sp", ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                  expert_tensor_parallel_size=1, sequence_parallel=True), 2),
    ("pp2_ep2", ParallelConfig(pipeline_model_parallel_size=2, expert_model_parallel_size=2), 4),
])
def test_moe_layout_matches_tp1(name, pc, world):
    _check_layout("moe", pc, world)


def _step(mc, pc, world, full_sd, mbs):
    results = run_ranks(_run_layout, world, pc, mc, full_sd, mbs, True, timeout=90)
    norms = {round(r["step"][1], 6) for r in results}
    assert all(r["step"][0] for r in results) and len(norms) == 1, norms
    return results[0]["step"][1], _gather_grads(results, mc, pc, key="params")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which,name,pc,world", [
    ("dense", "tp2_pp2", ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 4),
    ("moe", "tp2_ep2_sp", ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                         expert_tensor_parallel_size=1, sequence_parallel=True), 2),
])
def test_megatron_optimizer_step_with_clipping_matches_tp1(which, name, pc, world):
    mc, mbs, full_sd, _, _ = _reference(which)
    ref_norm, ref_params = _step(mc, ParallelConfig(), 1, full_sd, mbs)
    norm, params = _step(mc, pc, world, full_sd, mbs)
    assert ref_norm > 0.05 * 5  # clipping is active
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm
    assert sorted(params) == sorted(ref_params)
    for k in ref_params:
        assert not torch.equal(ref_params[k], full_sd[k]), f"{k} was not updated"
        torch.testing.assert_close(params[k], ref_params[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")
