"""``RolloutBatch`` layout, splitting and bad input, against plain Python loops.

The alignment rule (column t scores token t+1; response token i of row b at column p_b - 1 + i) is
rebuilt here by explicit loops over the original lists; the end-to-end version (model log-probs vs a
per-sequence HF loop) is ``tests/integration/test_actor_forward.py``.

Run: ``pytest tests/unit/test_actor_batch.py -q``
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.actor.batch import BatchError, RolloutBatch, fit_columns, row_blocks, scatter_rows

rows = st.lists(st.tuples(st.integers(1, 6), st.integers(0, 7)), min_size=1, max_size=7)


def _make(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 50, (p,), generator=g).tolist() for p, _ in spec]
    responses = [torch.randint(0, 50, (r,), generator=g).tolist() for _, r in spec]
    lps = [(-torch.rand(r, generator=g)).tolist() for _, r in spec]
    return prompts, responses, lps


@settings(max_examples=60, deadline=None)
@given(rows)
def test_layout_matches_loop(spec):
    prompts, responses, lps = _make(spec)
    b = RolloutBatch.from_sequences(prompts, responses, lps, pad_id=7)
    L = b.max_length
    assert L == max(2, max(p + r for p, r in spec))
    for i, (p, r, lp) in enumerate(zip(prompts, responses, lps)):
        seq = p + r
        assert b.tokens[i, : len(seq)].tolist() == seq
        assert all(x == 7 for x in b.tokens[i, len(seq):].tolist())
        for t in range(L - 1):
            # column t scores token t+1: a response token iff t+1 falls in [len(p), len(seq))
            is_resp = len(p) <= t + 1 < len(seq)
            assert b.response_mask[i, t].item() == float(is_resp)
            assert b.targets[i, t].item() == b.tokens[i, t + 1].item()
            expected = lp[t + 1 - len(p)] if is_resp else 0.0
            assert b.rollout_log_probs[i, t].item() == pytest.approx(expected)
        assert b.response_values(b.rollout_log_probs)[i].tolist() == pytest.approx(lp)


@settings(max_examples=40, deadline=None)
@given(rows, st.integers(1, 4), st.integers(1, 4))
def test_micro_batches_trim_and_cover(spec, mbs, mult):
    prompts, responses, lps = _make(spec)
    b = RolloutBatch.from_sequences(prompts, responses, lps)
    parts = b.micro_batches(mbs, trim=True, multiple_of=mult)
    covered = []
    for (s, e), mb in parts:
        covered += list(range(s, e))
        longest = max(2, max(len(prompts[i]) + len(responses[i]) for i in range(s, e)))
        assert mb.max_length == -(-longest // mult) * mult
        n = min(mb.max_length, b.max_length)
        assert torch.equal(mb.tokens[:, :n], b.tokens[s:e, :n])
        assert torch.equal(mb.response_mask, fit_columns(b.response_mask[s:e], mb.max_length - 1))
        assert torch.equal(mb.rollout_log_probs, fit_columns(b.rollout_log_probs[s:e], mb.max_length - 1))
    assert covered == list(range(b.num_rows))
    # reassembling per-micro-batch values gives the batch tensor back
    back = scatter_rows([((s, e), mb.rollout_log_probs[:, : min(mb.max_length, b.max_length) - 1])
                         for (s, e), mb in parts], b.num_rows, b.max_length - 1)
    assert torch.equal(back, b.rollout_log_probs)


@given(st.integers(1, 40), st.integers(1, 8))
def test_row_blocks_balanced(n, k):
    if n < k:
        with pytest.raises(BatchError, match="non-empty"):
            row_blocks(n, k)
        return
    blocks = row_blocks(n, k)
    sizes = [e - s for s, e in blocks]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1 and blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(blocks[i][1] == blocks[i + 1][0] for i in range(k - 1))


def test_shard_is_contiguous_rows():
    prompts, responses, lps = _make([(2, 3), (1, 1), (4, 2), (3, 5), (1, 6)])
    b = RolloutBatch.from_sequences(prompts, responses, lps)
    shards = [b.shard(r, 2) for r in range(2)]
    assert [s.num_rows for s in shards] == [3, 2]
    assert torch.equal(torch.cat([s.tokens for s in shards]), b.tokens)
    with pytest.raises(BatchError, match="rank 2 outside data-parallel size 2"):
        b.shard(2, 2)


def test_bad_input_names_the_problem():
    with pytest.raises(BatchError, match="row 1 has an empty prompt"):
        RolloutBatch.from_sequences([[1], []], [[2], [3]])
    with pytest.raises(BatchError, match="row 0 has 2 response tokens but 1 rollout log-probs"):
        RolloutBatch.from_sequences([[1]], [[2, 3]], [[-0.1]])
    with pytest.raises(BatchError, match="2 prompts but 1 responses"):
        RolloutBatch.from_sequences([[1], [2]], [[3]])
    with pytest.raises(BatchError, match=r"tokens must be an int64 \[B, L\]"):
        RolloutBatch(tokens=torch.zeros(2, 3), prompt_lengths=torch.ones(2, dtype=torch.long),
                     lengths=torch.ones(2, dtype=torch.long))
    with pytest.raises(BatchError, match=r"row 1: need 1 <= prompt_length \(2\) <= length \(1\)"):
        RolloutBatch(tokens=torch.zeros(2, 3, dtype=torch.long), prompt_lengths=torch.tensor([1, 2]),
                     lengths=torch.tensor([2, 1]))
    with pytest.raises(BatchError, match=r"rollout_log_probs must be a float \[B, L-1\] = \[2, 2\]"):
        RolloutBatch(tokens=torch.zeros(2, 3, dtype=torch.long), prompt_lengths=torch.tensor([1, 1]),
                     lengths=torch.tensor([2, 3]), rollout_log_probs=torch.zeros(2, 3))
