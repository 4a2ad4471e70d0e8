"""``seq-mean-token-sum-norm`` (Dr. GRPO) through ``MegatronActor.train_step`` equals verl 0.9.1's ``agg_loss``.

verl lays each row's response out in a ``[B, response_length]`` tensor padded to the configured response length,
and ``agg_loss`` divides the seq-mean-token-sum loss by ``loss_mask.shape[-1]``: a constant of the config. The
actor's rows hold prompt + response, so its divisor must come from the job's response budget
(``rollout.max_new_tokens``; multi-turn ``multi_turn.max_total_tokens``), not from the batch's widest row.

Reference: ``verl_agg_loss`` below is a transcription of ``verl.trainer.ppo.core_algos.agg_loss`` (verl 0.9.1,
single process: ``dp_size=1``, no global counts), run on verl's layout of the same rows. The actor's old
log-probs are its own log-prob pass, so the PPO ratio is 1 and the per-token loss is ``-A * w`` (token IS weight
``w``); the check is then the aggregation alone. Two batches whose prompts differ in length (same responses)
must give the same loss, as in verl.
"""
import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.testing.actor_reference import TOKEN_IS, actor_on_shard
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job, setting

T = 0.8
BUDGET = 12
#: the response budget is the trajectory's in multi-turn (max_total_tokens, not max_new_tokens)
BUDGET_KEYS = {False: (f"rollout.max_new_tokens={BUDGET}",),
               True: ("rollout.max_new_tokens=4", "multi_turn.env=megatron_rl.envs.lookup:LookupEnv",
                      "multi_turn.max_turns=2", f"multi_turn.max_total_tokens={BUDGET}")}


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                  loss_scale_factor=None):
    """verl 0.9.1 ``core_algos.agg_loss``, the two modes used here (``verl_F.masked_sum`` = sum of x * mask)."""
    if loss_agg_mode in ["seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            global_batch_size = seq_mask.sum()
        loss = (seq_losses * seq_mask).sum() / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if loss_scale_factor is None:
                loss_scale_factor = loss_mask.shape[-1]
            loss /= loss_scale_factor
        return loss
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")


def _data(vocab, prompt_lens, seed=0):
    """Rows with the given prompt lengths and the same responses (lengths 1..BUDGET), a rejected first response
    token in row 1, advantages and token IS weights."""
    from megatron_rl.actor import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    rlens = [BUDGET, 3, 1, 7, 5, 10]
    responses = [torch.randint(0, vocab, (r,), generator=g).tolist() for r in rlens]
    g2 = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(0, vocab, (p,), generator=g2).tolist() for p in prompt_lens]
    batch = RolloutBatch.from_sequences(prompts, responses, [[-1.0] * r for r in rlens])
    mask = batch.response_mask.clone()
    mask[1, int(batch.prompt_lengths[1]) - 1] = 0
    w = (torch.rand(len(rlens), BUDGET, generator=g) + 0.5)   # per response token, verl's layout
    is_w = torch.zeros_like(mask, dtype=torch.float32)
    for i, r in enumerate(rlens):
        p = int(batch.prompt_lengths[i])
        is_w[i, p - 1: p - 1 + r] = w[i, :r]
    adv = torch.randn(len(rlens), generator=g)
    return batch, adv, mask, is_w


def _to_verl(per_token, batch):
    """[B, L-1] (column t scores token t+1) -> verl's [B, BUDGET] response tensor (response token k at column k)."""
    out = torch.zeros(batch.num_rows, BUDGET, dtype=per_token.dtype)
    for i in range(batch.num_rows):
        p, r = int(batch.prompt_lengths[i]), int(batch.lengths[i]) - int(batch.prompt_lengths[i])
        out[i, :r] = per_token[i, p - 1: p - 1 + r]
    return out


def _rank(rank, world, job, datasets):
    out = []
    for batch, adv, mask, is_w in datasets:
        actor, shard, _, _ = actor_on_shard(job, batch)
        old, _ = actor.compute_log_probs(shard, T)
        m = actor.train_step(shard, old, adv, mask, is_w, T)
        out.append(m["actor/pg_loss"])
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_sum_norm_divides_by_the_response_budget_like_verl(dense_model, multi_turn):
    job = named_job("actor", "actor.lr=1e-3", "actor.policy_loss={loss_agg_mode: seq-mean-token-sum-norm}",
                    setting("algorithm.rollout_correction", TOKEN_IS), *BUDGET_KEYS[multi_turn], hf=dense_model)
    vocab = job.model.vocab_size
    short = _data(vocab, [2, 1, 3, 2, 1, 2])
    long = _data(vocab, [9, 1, 14, 2, 6, 2])       # the same responses after longer prompts
    widths = {short[0].max_length - 1, long[0].max_length - 1, BUDGET}
    assert len(widths) == 3, widths     # neither batch is as wide as the budget, nor as each other
    (losses,) = run_ranks(_rank, 1, job, [short, long], timeout=200)
    for (batch, adv, mask, is_w), got in zip([short, long], losses):
        loss_mat = _to_verl(-adv[:, None] * is_w, batch)      # PPO ratio 1: per-token loss -A * w
        loss_mask = _to_verl(mask.to(torch.float32), batch)
        ref = verl_agg_loss(loss_mat, loss_mask, "seq-mean-token-sum-norm")
        assert loss_mask.shape[-1] == BUDGET and float(loss_mask[1].sum()) == float(batch.lengths[1]
                                                                                  - batch.prompt_lengths[1] - 1)
        assert got == pytest.approx(float(ref), rel=1e-5, abs=1e-7), (got, float(ref))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5), "the divisor moved with the prompt lengths"
