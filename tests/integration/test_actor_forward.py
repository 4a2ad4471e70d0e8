"""Log-prob pass of ``MegatronActor`` vs HF transformers (fp32) on a tiny checkpoint, at several layouts.

The reference is built independently of the actor's token layout: HF transformers runs each
*unpadded* sequence alone, and a plain Python loop picks log_softmax(logits[t] / T)[token t+1] (and the
entropy at t) into column t. The actor loads the same HF directory (``actor.load_hf``) at TP1, TP2xPP2
(4 gloo ranks), DP2 and TP2 with sequence parallel (micro-batches padded to a multiple of TP, beyond
the batch's odd length), splits the batch into micro-batches of different lengths, and must agree to
<= 1e-4 at every non-padding column, on every rank of the model-parallel group (PP broadcast).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_actor_forward.py -q``
"""
import pytest
import torch

import megatron.core  # noqa: F401  (imported once in the parent: forked ranks start fast)
from megatron_rl.actor import MegatronActor, RolloutBatch
from megatron_rl.plan import actor_spec
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.testing.actor_reference import load_hf_reference
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import knobs, named_job

transformers = pytest.importorskip("transformers")

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_model):
    return tiny_hf_model("qwen2", seed=11, num_hidden_layers=4)


def _sequences(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    plens, rlens = [3, 5, 2, 7, 4, 1], [6, 2, 9, 3, 5, 4]
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p in plens]
    responses = [torch.randint(0, vocab, (r,), generator=g).tolist() for r in rlens]
    return prompts, responses


def _reference(hf_dir, prompts, responses, T):
    """[B, L-1] log-probs / entropies by a plain loop over per-sequence HF logits (float64)."""
    model = load_hf_reference(hf_dir).eval()
    L = max(len(p) + len(r) for p, r in zip(prompts, responses))
    lp = torch.zeros(len(prompts), L - 1, dtype=torch.float64)
    ent = torch.zeros_like(lp)
    with torch.no_grad():
        for b, (p, r) in enumerate(zip(prompts, responses)):
            seq = p + r
            logits = model(input_ids=torch.tensor([seq])).logits[0].double() / T
            for t in range(len(seq) - 1):
                logq = torch.log_softmax(logits[t], dim=-1)
                lp[b, t] = logq[seq[t + 1]]
                ent[b, t] = -(logq.exp() * logq).sum()
    return lp, ent


def _rank_logprobs(rank, world, job, batch, T):
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))
    shard = batch.shard(actor.dp_rank, actor.dp_size)
    lp, ent = actor.compute_log_probs(shard, T)
    return {"dp_rank": actor.dp_rank, "dp_size": actor.dp_size, "lp": lp, "ent": ent}


def _assemble(results, B):
    """Concatenate the DP shards; every rank of a DP shard must hold identical values."""
    by_dp = {}
    for r in results:
        if r["dp_rank"] in by_dp:
            torch.testing.assert_close(r["lp"], by_dp[r["dp_rank"]]["lp"], rtol=0, atol=0)
            torch.testing.assert_close(r["ent"], by_dp[r["dp_rank"]]["ent"], rtol=0, atol=0)
        else:
            by_dp[r["dp_rank"]] = r
    lp = torch.cat([by_dp[i]["lp"] for i in sorted(by_dp)])
    ent = torch.cat([by_dp[i]["ent"] for i in sorted(by_dp)])
    assert lp.shape[0] == B
    return lp, ent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,pp,sp,world", [(1, 1, False, 1), (2, 2, False, 4), (1, 1, False, 2), (2, 1, True, 2)],
                         ids=["tp1", "tp2pp2", "dp2", "tp2sp"])
def test_log_probs_match_hf(hf_dir, tp, pp, sp, world):
    job = named_job("actor", *knobs(tp=tp, pp=pp, sp=sp), hf=hf_dir)
    prompts, responses = _sequences(job.model.vocab_size)
    batch = RolloutBatch.from_sequences(prompts, responses)
    ref_lp, ref_ent = _reference(hf_dir, prompts, responses, TEMPERATURE)
    lp, ent = _assemble(run_ranks(_rank_logprobs, world, job, batch, TEMPERATURE, timeout=100), batch.num_rows)
    valid = torch.arange(1, batch.max_length).unsqueeze(0) < batch.lengths.unsqueeze(1)
    assert lp.shape == ref_lp.shape == (batch.num_rows, batch.max_length - 1)
    assert ref_lp[valid].std() > 0.1  # non-vacuous
    err_lp = (lp.double() - ref_lp)[valid].abs().max().item()
    err_ent = (ent.double() - ref_ent)[valid].abs().max().item()
    assert err_lp <= 1e-4, f"log-prob max error {err_lp:.3e}"
    assert err_ent <= 1e-4, f"entropy max error {err_ent:.3e}"
    assert torch.all(lp[~valid] == 0) and torch.all(ent[~valid] == 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp,pp,sp,world,actor", [
    (1, 1, False, 1, {"sequence_packing": True}),
    (1, 1, False, 1, {"max_tokens_per_micro_batch": 16}),
    (1, 1, False, 1, {"max_tokens_per_micro_batch": 16, "sequence_packing": True}),
    (2, 2, True, 4, {"max_tokens_per_micro_batch": 16, "sequence_packing": True}),
    (1, 1, False, 2, {"max_tokens_per_micro_batch": 12, "sequence_packing": True})],
    ids=["tp1-packed", "tp1-budget", "tp1-budget-packed", "tp2sp-pp2-budget-packed", "dp2-budget-packed"])
def test_packed_and_token_budget_log_probs_match_hf(hf_dir, tp, pp, sp, world, actor):
    """Issue 25: rows grouped by tokens (padded or packed into one THD sequence per micro-batch, attention
    within each row only) give every row's log-probs and entropy as HF on that row alone, in the batch's own
    row order (the plan permutes rows; the results are put back)."""
    job = named_job("actor", *knobs(tp=tp, pp=pp, sp=sp, **actor), hf=hf_dir)
    prompts, responses = _sequences(job.model.vocab_size)
    batch = RolloutBatch.from_sequences(prompts, responses)
    ref_lp, ref_ent = _reference(hf_dir, prompts, responses, TEMPERATURE)
    lp, ent = _assemble(run_ranks(_rank_logprobs, world, job, batch, TEMPERATURE, timeout=100), batch.num_rows)
    valid = torch.arange(1, batch.max_length).unsqueeze(0) < batch.lengths.unsqueeze(1)
    assert (lp.double() - ref_lp)[valid].abs().max().item() <= 1e-4
    assert (ent.double() - ref_ent)[valid].abs().max().item() <= 1e-4
    assert torch.all(lp[~valid] == 0) and torch.all(ent[~valid] == 0)


@pytest.mark.timeout(120)
def test_log_probs_from_converted_checkpoint(hf_dir, tmp_path):
    """actor.load_hf may name a ``megatron-rl convert hf-to-mcore`` directory saved at another layout
    (TP2 here, resharded to TP1 x PP2 on load); the log-probs still equal HF's, and the HF export
    (config from the converted directory's hf_assets) returns the original tensors bit for bit."""
    from megatron_rl.convert import ShardLayout, convert_hf_to_mcore
    from megatron_rl.convert.storage import read_hf_state_dict

    out = str(tmp_path / "mcore")
    convert_hf_to_mcore(hf_dir, out, ShardLayout(tensor_model_parallel_size=2))
    # the HF directory's model section, the converted checkpoint's weights
    job = named_job("actor", "parallel.pipeline_model_parallel_size=2", f"actor.load_hf={out}", hf=hf_dir)
    prompts, responses = _sequences(job.model.vocab_size, seed=1)
    batch = RolloutBatch.from_sequences(prompts, responses)
    ref_lp, _ = _reference(hf_dir, prompts, responses, TEMPERATURE)
    lp, _ = _assemble(run_ranks(_rank_logprobs, 2, job, batch, TEMPERATURE, timeout=100), batch.num_rows)
    valid = torch.arange(1, batch.max_length).unsqueeze(0) < batch.lengths.unsqueeze(1)
    assert (lp.double() - ref_lp)[valid].abs().max().item() <= 1e-4
    sd = run_ranks(_rank_export, 2, job, timeout=100)[0]
    ref = read_hf_state_dict(hf_dir)
    assert sorted(sd) == sorted(ref) and all(torch.equal(sd[k], v) for k, v in ref.items())


def _rank_export(rank, world, job):
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    return MegatronActor(actor_spec(job)).full_state_dict_hf()
