"""MoE gradient norm when expert TP differs from TP (Megatron-LM #5916, first in megatron-core 0.19.0).

Method (upstream's own regression recipe): every gradient of the actor's model is set to 1, then megatron's
optimizer (the project's ``build_optimizer``: dense + expert optimizers chained) computes the global gradient
norm. A correct norm counts every *logical* parameter once, so the reference is ``sqrt(N)`` with N the
parameter count of the single-process HF model (independent of megatron and of the layout). Clipping is on
(``clip_grad`` > 0), so 0.19's clip path (``device='cuda'`` allocations, PR #4116) runs on CPU too.

* megatron-core >= 0.19: the norm equals ``sqrt(N)`` at every layout below;
* megatron-core 0.16.1: at expert_model_parallel_size=1 with ETP != TP the expert parameters are deduplicated
  with the dense TP group (and their gradients reduced over the dense DP group): at TP2 x ETP1 the replicated
  experts are counted twice (over-count), at TP1 x ETP2 half of the expert shards are dropped (under-count).
  The norm is ``sqrt(N + (c - 1) * N_expert)`` with the measured factor c (2 and 1/2) — asserted exactly,
  documenting what users on 0.16 get (docs/megatron_versions.md). EP2 x ETP1 at TP2 counts right on both.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_moe_grad_norm.py -q``
"""
import math

import pytest

import megatron.core  # noqa: F401  (imported once in the parent: forked ranks start fast)
from megatron_rl.actor import MegatronActor
from megatron_rl.plan import actor_spec
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.platform.mcore_version import MCORE
from megatron_rl.testing.actor_reference import load_hf_reference
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import layout, named_job

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_model):
    return tiny_hf_model("qwen3_moe", seed=31)


def _rank_norm_of_ones(rank, world, job):
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))
    for chunk in actor.model:
        chunk.zero_grad_buffer()
        for p in chunk.module.parameters():
            p.main_grad.fill_(1.0)
    ok, grad_norm, _ = actor.optimizer.step()
    return float(grad_norm)


def _counts(hf_dir):
    """(all parameters, routed-expert parameters) of the single-process HF model."""
    model = load_hf_reference(hf_dir)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert 0 < experts < total
    return total, experts


# (id, tp, ep, etp, world, how many times 0.16.1 counts the routed-expert parameters: measured)
CASES = [("tp2sp-ep1-etp1", 2, 1, 1, 2, 2.0),     # TP > ETP: experts replicated over the 2 TP ranks, both counted
         ("tp1-ep1-etp2", 1, 1, 2, 2, 0.5),       # ETP > TP: only one of the 2 expert shards counted
         ("tp2sp-ep2-etp1", 2, 2, 1, 2, 1.0)]     # EP2 x ETP1: counted right before 0.19 too


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,tp,ep,etp,world,count_016", CASES, ids=[c[0] for c in CASES])
def test_moe_grad_norm_counts_every_parameter_once(hf_dir, name, tp, ep, etp, world, count_016):
    total, experts = _counts(hf_dir)
    job = named_job("actor", "actor.lr=1e-3", "actor.clip_grad=0.5", *layout(tp=tp, ep=ep, etp=etp, sp=tp > 1),
                    hf=hf_dir)
    norms = run_ranks(_rank_norm_of_ones, world, job, timeout=240)
    assert len(set(norms)) == 1, f"ranks disagree on the grad norm: {norms}"
    norm = norms[0]
    reference = math.sqrt(total)
    if MCORE.counts_expert_grads_at_etp_ne_tp:
        assert norm == pytest.approx(reference, rel=1e-6), (
            f"megatron-core {MCORE.text} at {name}: grad norm {norm} vs single-process sqrt(N)={reference}")
    else:
        # megatron-core < 0.19: the known miscount of Megatron-LM #5916 (fixed in 0.19.0)
        expected = math.sqrt(total + (count_016 - 1) * experts)
        assert norm == pytest.approx(expected, rel=1e-6), (
            f"megatron-core {MCORE.text} at {name}: grad norm {norm}; documented {expected} "
            f"(N={total}, routed-expert params={experts}, counted {count_016}x); reference {reference}")
