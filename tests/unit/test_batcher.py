"""``MicroBatcher``'s decisions, against references that do not use it: every row of a shard lands in exactly one
micro-batch, whose model input holds that row's tokens (read back from the ``RolloutBatch`` itself); the
interleaved schedule gets micro-batches of one sequence length and at least PP of them, or a refusal naming the
config key; a padded budget under VPP is refused naming both keys; megatron's interleaved group size divides
the pass.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.actor.batch import RolloutBatch
from megatron_rl.actor.batcher import MicroBatcher
from megatron_rl.parallel.dims import ParallelDims


def _dims(pp=1, vpp=1):
    return ParallelDims(tp=1, pp=pp, vpp=vpp, cp=1, ep=1, etp=1, dp=1, edp=1, world_size=pp, sequence_parallel=False)


def _groups(dims):
    """Stand-in ``ActorGroups`` of a rank without CP / TP (no process groups)."""
    return SimpleNamespace(cp_size=1, cp_rank=0, tp_size=1, tp_rank=0, sequence_parallel=False, cp_group=None,
                           tp_group=None, seq_multiple=dims.seq_multiple, dims=dims)


def _batch(seed, n):
    rng = random.Random(seed)
    prompts = [[rng.randint(3, 90) for _ in range(rng.randint(1, 6))] for _ in range(n)]
    responses = [[rng.randint(3, 90) for _ in range(rng.randint(0, 9))] for _ in range(n)]
    return RolloutBatch.from_sequences(prompts, responses, pad_id=0)


def _row_tokens(mb, i, length):
    """The ``length`` input tokens of row ``i`` of micro-batch ``mb`` (packed: its segment of the sequence)."""
    if mb.packed_seq_params is None:
        return mb.tokens[i, :length]
    start = int(mb.packed_seq_params.cu_seqlens_q_padded[i])
    return mb.tokens[0, start:start + length]


@pytest.mark.parametrize("packed,pp,vpp,budget,mbs", [
    (False, 1, 1, None, 3), (True, 1, 1, None, 3), (False, 1, 1, 24, 1), (True, 1, 1, 24, 1),
    (False, 4, 2, None, 2), (True, 4, 2, None, 2), (True, 4, 2, 30, 1)],     # a padded budget under VPP: refused
    ids=["rows", "rows-packed", "budget", "budget-packed", "vpp-rows", "vpp-rows-packed", "vpp-budget-packed"])
def test_cut_holds_every_row_once(packed, pp, vpp, budget, mbs):
    dims = _dims(pp, vpp)
    batcher = MicroBatcher(dims, packed=packed, max_tokens=budget, micro_batch_size=mbs)
    groups = _groups(dims)
    for seed in range(6):
        batch = _batch(seed, 9)
        plan = batcher.plan(batch.lengths.tolist())
        ordered = batch.take(plan.order)
        cut = batcher.cut(ordered, plan.bounds, groups)
        seen = []
        for mb, tokens in zip(cut, plan.tokens):
            s, e = mb.rows
            for i, r in enumerate(plan.order[s:e]):
                n = int(batch.lengths[r])
                assert torch.equal(_row_tokens(mb, i, n), batch.tokens[r, :n]), (seed, r)
                seen.append(r)
            if budget is not None:
                assert tokens <= budget
        assert sorted(seen) == list(range(batch.num_rows)), seed   # each row exactly once
        if dims.interleaved:   # megatron-core 0.16's interleaved schedule: >= PP micro-batches of one length
            assert len(cut) >= pp
            assert len({mb.tokens.shape[1] for mb in cut}) == 1
            g = batcher.vp_group_size(len(cut))
            assert g >= pp and len(cut) % g == 0
        else:
            assert batcher.vp_group_size(len(cut)) is None


def test_too_few_rows_for_the_interleaved_schedule_names_the_keys():
    batcher = MicroBatcher(_dims(pp=4, vpp=2), micro_batch_size=2)
    with pytest.raises(ValueError) as e:
        batcher.plan([5, 6, 7])   # 3 rows: at most 3 micro-batches < PP = 4
    msg = str(e.value)
    assert "pipeline_model_parallel_size=4" in msg and "actor.micro_batch_size" in msg


def test_padded_budget_under_vpp_is_refused_naming_the_keys():
    from megatron_rl.parallel import ParallelConfig

    with pytest.raises(ValueError) as e:
        MicroBatcher(_dims(pp=4, vpp=2), packed=False, max_tokens=64)
    assert "actor.max_tokens_per_micro_batch" in str(e.value) and "actor.sequence_packing" in str(e.value)
    MicroBatcher(_dims(pp=4, vpp=2), packed=True, max_tokens=64)   # packed: one shape, allowed
    actor = SimpleNamespace(max_tokens_per_micro_batch=0, sequence_packing=True)
    errs = MicroBatcher.config_errors(actor, ParallelConfig())
    assert len(errs) == 1 and errs[0].startswith("actor.max_tokens_per_micro_batch")
