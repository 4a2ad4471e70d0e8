"""The actor's log-prob pass with ``compute_sum_pi_squared``: sum_j p_j^2 of softmax(logits / T) at every scored
column vs HF transformers (fp32 model, float64 softmax of each unpadded sequence alone) at TP1, TP2 (with
sequence parallel: micro-batches padded beyond the batch) and PP2 (broadcast from the last stage), identical on
the ranks of a model-parallel group, 0 at
padding; the log-probs unchanged by the flag.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_actor_sum_pi_squared.py -q``
"""
import pytest
import torch

import megatron.core  # noqa: F401  (imported once in the parent: forked ranks start fast)
from megatron_rl.actor import MegatronActor, RolloutBatch
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.plan import actor_spec
from megatron_rl.testing.actor_reference import load_hf_reference
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import knobs, named_job

transformers = pytest.importorskip("transformers")

T = 0.03   # a random tiny model is near-uniform at T = 1: sharpen it so sum pi^2 varies


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_model):
    return tiny_hf_model("qwen2", seed=11, num_hidden_layers=2)


def _sequences(vocab):
    g = torch.Generator().manual_seed(1)
    return ([torch.randint(0, vocab, (p,), generator=g).tolist() for p in (3, 5, 2, 6)],
            [torch.randint(0, vocab, (r,), generator=g).tolist() for r in (5, 2, 7, 3)])


def _reference(hf_dir, prompts, responses):
    model = load_hf_reference(hf_dir).eval()
    L = max(len(p) + len(r) for p, r in zip(prompts, responses))
    out = torch.zeros(len(prompts), L - 1, dtype=torch.float64)
    with torch.no_grad():
        for b, (p, r) in enumerate(zip(prompts, responses)):
            logits = model(input_ids=torch.tensor([p + r])).logits[0, :-1].double() / T
            out[b, :logits.shape[0]] = (torch.softmax(logits, dim=-1) ** 2).sum(-1)
    return out


def _rank(rank, world, job, batch):
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))
    lp, ent, spp = actor.compute_log_probs(batch, T, compute_entropy=False, compute_sum_pi_squared=True)
    lp0, _ = actor.compute_log_probs(batch, T, compute_entropy=False)
    return lp, ent, spp, lp0


@pytest.mark.timeout(150)
@pytest.mark.parametrize("tp,pp,sp,world", [(1, 1, False, 1), (2, 1, True, 2), (1, 2, False, 2)],
                         ids=["tp1", "tp2sp", "pp2"])
def test_sum_pi_squared_matches_hf(hf_dir, tp, pp, sp, world):
    job = named_job("actor", *knobs(tp=tp, pp=pp, sp=sp), hf=hf_dir)
    prompts, responses = _sequences(job.model.vocab_size)
    batch = RolloutBatch.from_sequences(prompts, responses)
    ref = _reference(hf_dir, prompts, responses)
    res = run_ranks(_rank, world, job, batch, timeout=120)
    valid = torch.arange(1, batch.max_length).unsqueeze(0) < batch.lengths.unsqueeze(1)
    for lp, ent, spp, lp0 in res:
        assert ent is None and spp.shape == ref.shape and spp.dtype == torch.float32
        torch.testing.assert_close(spp, res[0][2], rtol=0, atol=0)   # the same on every TP / PP rank
        assert torch.equal(lp, lp0)
        err = ((spp.double() - ref) / ref.clamp(min=1e-12))[valid].abs().max().item()
        assert err <= 1e-4, f"sum pi^2 max relative error {err:.3e}"
        assert torch.all(spp[~valid] == 0)
    assert ref[valid].max() > 2 * ref[valid].min()   # not a constant (non-vacuous)
