"""``schedule.PackedRows`` (a packed THD micro-batch's layout) against a plain-Python reference of megatron's THD
context-parallel rule, on stand-in groups and on real gloo CP (and TP + sequence-parallel) groups.

Reference rule (megatron-core ``get_thd_batch_on_this_cp_rank`` -> TE ``thd_get_partitioned_indices``): every
segment of ``cu_seqlens_padded`` is cut into 2 x CP equal chunks and CP rank r holds chunk r then chunk
2CP-1-r of every segment, segments in order; with sequence parallel the rank's [s_loc] positions are then cut
into TP equal contiguous pieces. Written here from the rule as lists of ints, not from the code under test.

Also: the plan's token count is the model input's size (padded rows of length 1 too); every tensor of a
packed micro-batch on the actor's device (``fake_accelerator``); ``StepBatch.shard(balance_tokens=True)``.

Checked: ``positions`` / ``held``; ``place`` (inputs on this rank's positions); ``loss_rows`` (sum over CP ranks of
value x held rebuilds the rows); ``gather_rows`` after ``place`` returns the rows on a 2-rank CP group (and at
TP2 + SP x CP2); ``routing_targets`` and ``gather_records`` invert each other; ``packed_micro_batches``
at CP2 gives the reference's tokens / position ids / targets / cu_seqlens (int32).

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_packed_rows.py -q``
"""
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.actor.micro_batching import pack_layout
from megatron_rl.actor.schedule import PackedRows
from megatron_rl.testing.distributed import run_ranks


# ------------------------------------------------------------------------------------------- plain reference
def ref_segments(lengths, cp, total_multiple):
    """(padded segment lengths incl. a non-empty tail, offsets of the rows)."""
    m = 2 * cp if cp > 1 else 1
    padded = [-(-x // m) * m for x in lengths]
    total = -(-sum(padded) // total_multiple) * total_multiple
    offsets = [sum(padded[:i]) for i in range(len(padded))]
    segs = padded + ([total - sum(padded)] if total > sum(padded) else [])
    return segs, offsets, total


def ref_positions(segs, r, cp):
    """megatron's THD CP rule: chunk r and chunk 2CP-1-r of every segment."""
    if cp == 1:
        return list(range(sum(segs)))
    out, off = [], 0
    for p in segs:
        c = p // (2 * cp)
        for k in (r, 2 * cp - 1 - r):
            out += list(range(off + k * c, off + (k + 1) * c))
        off += p
    return out


def ref_packed(rows, lengths, offsets, total, fill):
    """The whole packed sequence (python list) of per-row value lists ``rows[i][c]``."""
    seq = [fill] * total
    for i, n in enumerate(lengths):
        for c in range(n):
            seq[offsets[i] + c] = rows[i][c]
    return seq


def stub(cp, cp_rank, tp=1, tp_rank=0, sp=False):
    return SimpleNamespace(cp_size=cp, cp_rank=cp_rank, tp_size=tp, tp_rank=tp_rank, sequence_parallel=sp,
                           cp_group=None, tp_group=None)


CASES = [([1], 1, 1), ([2], 1, 1), ([5, 1, 3], 1, 1), ([5, 1, 3], 1, 4), ([1], 2, 4), ([1, 2], 2, 4),
         ([7, 4, 1, 9], 2, 4), ([7, 4, 1, 9], 2, 8), ([3, 6, 2], 3, 6), ([3, 6, 2], 3, 12), ([11, 1], 4, 8)]


@pytest.mark.parametrize("lengths,cp,total_multiple", CASES)
def test_positions_place_and_loss_rows_match_reference(lengths, cp, total_multiple):
    n, s_rows = len(lengths), max(max(lengths), 2)
    segs, offsets, total = ref_segments(lengths, cp, total_multiple)
    lay = pack_layout(lengths, row_multiple=2 * cp if cp > 1 else 1, total_multiple=total_multiple)
    assert list(lay.segments) == segs and lay.total == total and list(lay.offsets) == offsets
    g = torch.Generator().manual_seed(len(lengths) * 7 + cp)
    x = torch.randn(n, s_rows, generator=g)
    real = torch.zeros(n, s_rows, dtype=torch.bool)
    for i, ln in enumerate(lengths):
        real[i, :ln] = True
    packed = ref_packed(x.tolist(), lengths, offsets, total, fill=-7.0)
    rebuilt = torch.zeros(n, s_rows)
    held_total = torch.zeros(n, s_rows, dtype=torch.int64)
    for r in range(cp):
        pr = PackedRows(0, n, lay, s_rows, stub(cp, r), "cpu")
        pos = ref_positions(segs, r, cp)
        assert pr.positions.tolist() == pos
        placed = pr.place(x, -7.0)
        assert placed.shape == (1, len(pos))
        assert placed[0].tolist() == [packed[p] for p in pos]
        # the model's output on this rank = the placed inputs: back into rows
        back = pr.loss_rows(placed)
        assert back.shape == (n, s_rows)
        held = pr.held
        # held: exactly the real (row, column) positions whose packed position this rank holds
        mine = set(pos)
        for i, ln in enumerate(lengths):
            for c in range(s_rows):
                assert bool(held[i, c]) == (c < ln and offsets[i] + c in mine), (i, c)
        assert torch.equal(back * held, torch.where(held, x, torch.zeros_like(x)))
        rebuilt += back * held
        held_total += held.long()
    assert torch.equal(held_total, real.long()), "every real token held by exactly one CP rank"
    torch.testing.assert_close(rebuilt, x * real, rtol=0, atol=0)


@pytest.mark.parametrize("cp,tp", [(1, 2), (2, 1), (2, 2), (3, 2)])
def test_routing_targets_match_reference(cp, tp):
    """Replay targets in megatron's router token order: the packed sequence's routing (-1 at each row's last
    token and at padding), this CP rank's positions, then this SP rank's contiguous piece."""
    lengths, NL, k = [5, 1, 2, 7], 3, 2
    n, s_rows = len(lengths), max(lengths)
    mult = 2 * cp * tp if cp > 1 else tp
    segs, offsets, total = ref_segments(lengths, cp, mult)
    lay = pack_layout(lengths, row_multiple=2 * cp if cp > 1 else 1, total_multiple=mult)
    W = s_rows + 3  # the batch's routing is wider than the micro-batch's longest row
    routing = torch.randint(0, 8, (n + 2, W, NL, k), generator=torch.Generator().manual_seed(3))
    all_lengths = torch.tensor([4, 4] + lengths)  # the micro-batch is rows [2, 2 + n) of the batch
    rows_val = [[routing[2 + i, c].tolist() if c < ln - 1 else [[-1] * k] * NL for c in range(s_rows)]
                for i, ln in enumerate(lengths)]
    packed = ref_packed(rows_val, lengths, offsets, total, fill=[[-1] * k] * NL)
    for r in range(cp):
        pos = ref_positions(segs, r, cp)
        piece = len(pos) // tp
        for t in range(tp):
            pr = PackedRows(2, 2 + n, lay, s_rows, stub(cp, r, tp, t, sp=True), "cpu")
            got = pr.routing_targets(routing, all_lengths, stub(cp, r, tp, t, sp=True), "cpu")
            want = torch.tensor([packed[p] for p in pos[t * piece:(t + 1) * piece]]).permute(1, 0, 2)
            assert got.dtype == torch.int64
            assert torch.equal(got, want), (r, t)


# ------------------------------------------------------------------------------------------- real groups
def _rank_roundtrip(rank, world, cp, tp, lengths):
    from megatron_rl.actor.micro_batching import pack_layout as _pack
    from megatron_rl.parallel import ParallelConfig, initialize_model_parallel
    from megatron_rl.parallel.groups import ActorGroups

    sp = tp > 1
    initialize_model_parallel(ParallelConfig(context_parallel_size=cp, tensor_model_parallel_size=tp,
                                             sequence_parallel=sp), seed=1)
    groups = ActorGroups.from_parallel_state(sequence_parallel=sp)
    n, s_rows, NL, k = len(lengths), max(lengths), 2, 3
    lay = _pack(lengths, row_multiple=2 * cp, total_multiple=groups.seq_multiple)
    pr = PackedRows(0, n, lay, s_rows, groups, "cpu")
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, s_rows, 4, generator=g)
    rows_back = pr.gather_rows(pr.place(x, 0.0), groups)
    routing = torch.randint(0, 16, (n, s_rows, NL, k), generator=g)
    t = pr.routing_targets(routing, torch.tensor(lengths), groups, "cpu")
    records = pr.gather_records(t, groups)
    return {"cp_rank": groups.cp_rank, "tp_rank": groups.tp_rank, "x": x, "rows": rows_back, "routing": routing,
            "records": records, "n_local": t.shape[1], "seq_multiple": groups.seq_multiple}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cp,tp", [(2, 1), (2, 2)], ids=["cp2", "tp2sp-cp2"])
def test_gather_rows_and_records_invert_place_and_targets(cp, tp):
    lengths = [7, 1, 2, 12, 3]
    res = run_ranks(_rank_roundtrip, cp * tp, cp, tp, lengths, timeout=100)
    _, _, total = ref_segments(lengths, cp, res[0]["seq_multiple"])
    real = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
    valid = torch.zeros_like(real)
    for i, ln in enumerate(lengths):
        real[i, :ln] = True
        valid[i, : ln - 1] = True
    for r in res:
        assert r["n_local"] == total // cp // tp
        torch.testing.assert_close(r["rows"], r["x"] * real[:, :, None], rtol=0, atol=0)
        want = torch.where(valid[:, :, None, None], r["routing"], torch.full_like(r["routing"], -1))
        assert torch.equal(r["records"], want)


def _rank_prepare(rank, world, cp, lengths):
    from megatron_rl.actor.batch import RolloutBatch
    from megatron_rl.actor.schedule import packed_micro_batches
    from megatron_rl.parallel import ParallelConfig, initialize_model_parallel
    from megatron_rl.parallel.groups import ActorGroups

    initialize_model_parallel(ParallelConfig(context_parallel_size=cp), seed=1)
    groups = ActorGroups.from_parallel_state()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 50, (max(1, ln // 2),), generator=g).tolist() for ln in lengths]
    responses = [torch.randint(3, 50, (ln - len(p),), generator=g).tolist() for p, ln in zip(prompts, lengths)]
    batch = RolloutBatch.from_sequences(prompts, responses, pad_id=0)
    mask = batch.response_mask
    bounds = [(0, 2), (2, len(lengths))]
    mbs = packed_micro_batches(batch, bounds, groups, per_token={"response_mask": mask})
    return {"cp_rank": groups.cp_rank, "tokens": batch.tokens, "mask": mask,
            "mbs": [{"tokens": mb.tokens, "pos": mb.position_ids, "targets": mb.targets, "full": mb.full_length,
                     "cu": mb.packed_seq_params.cu_seqlens_q, "cu_pad": mb.packed_seq_params.cu_seqlens_q_padded,
                     "max": mb.packed_seq_params.max_seqlen_q, "svt": mb.seq_valid_tokens,
                     "mask": mb.per_token["response_mask"], "held": mb.layout.held} for mb in mbs]}


@pytest.mark.timeout(120)
def test_packed_micro_batches_at_cp2_match_reference():
    """tokens / position ids / targets of each CP rank, cu_seqlens (int32, real vs padded), the loss's mask."""
    cp, lengths = 2, [7, 1, 2, 12, 5]
    res = run_ranks(_rank_prepare, cp, cp, lengths, timeout=100)
    for r in res:
        tok = r["tokens"]
        for (s, e), mb in zip([(0, 2), (2, 5)], r["mbs"]):
            ls = lengths[s:e]
            segs, offsets, total = ref_segments(ls, cp, 2 * cp)
            assert mb["full"] == total
            pos = ref_positions(segs, r["cp_rank"], cp)
            rows_tok = [tok[i].tolist() for i in range(s, e)]
            seq_tok = ref_packed(rows_tok, ls, offsets, total, fill=0)
            nxt = [[tok[i, c + 1].item() if c + 1 < ln else 0 for c in range(ln)] for i, ln in zip(range(s, e), ls)]
            seq_tgt = ref_packed(nxt, ls, offsets, total, fill=0)
            seq_pos = []
            for p in segs:
                seq_pos += list(range(p))
            assert mb["tokens"].tolist() == [[seq_tok[p] for p in pos]]
            assert mb["targets"].tolist() == [[seq_tgt[p] for p in pos]]
            assert mb["pos"].tolist() == [[seq_pos[p] for p in pos]]
            cu_pad = [0]
            for p in segs:
                cu_pad.append(cu_pad[-1] + p)
            cu = [0]
            for x in ls + segs[len(ls):]:
                cu.append(cu[-1] + x)
            assert mb["cu"].dtype == torch.int32 and mb["cu_pad"].dtype == torch.int32
            assert mb["cu"].tolist() == cu and mb["cu_pad"].tolist() == cu_pad
            assert mb["max"] == max(segs)
            # the loss's mask: whole-row valid counts, this rank's held positions only
            full_mask = r["mask"][s:e]
            want_svt = full_mask.sum(-1).double()
            torch.testing.assert_close(mb["svt"], want_svt)
            w = mb["mask"].shape[1]
            padded_mask = torch.nn.functional.pad(full_mask, (0, max(0, w - full_mask.shape[1])))[:, :w]
            assert torch.equal(mb["mask"], padded_mask * mb["held"])
    # the two CP ranks' masks add up to the whole rows' mask
    for i in range(2):
        total_mask = res[0]["mbs"][i]["mask"] + res[1]["mbs"][i]["mask"]
        s, e = [(0, 2), (2, 5)][i]
        assert float(total_mask.sum()) == float(res[0]["mask"][s:e].sum())


# ------------------------------------------------------------------------------------------- plan vs model input
def _groups(cp_size=1):
    """Stand-in ``ActorGroups`` of CP rank 0 of ``cp_size`` (no process groups), with the layout's real sizes."""
    from megatron_rl.parallel.dims import ParallelDims

    dims = ParallelDims(tp=1, pp=1, vpp=1, cp=cp_size, ep=1, etp=1, dp=1, edp=1, world_size=cp_size,
                        sequence_parallel=False)
    return SimpleNamespace(cp_size=cp_size, cp_rank=0, tp_size=1, tp_rank=0, sequence_parallel=False, cp_group=None,
                           tp_group=None, seq_multiple=dims.seq_multiple, dims=dims)


@pytest.mark.parametrize("packed", [pytest.param(False, id="padded"),
                                    pytest.param(True, id="packed")])
@pytest.mark.parametrize("shapes,budget", [
    ([(1, 0), (1, 0), (1, 0)], 3),                   # prompt-only rows of length 1
    ([(1, 0), (1, 1), (2, 0), (1, 0)], 4),           # lengths 1, 2, 2, 1
    ([(3, 4), (1, 0), (2, 5), (6, 1), (1, 1)], 14)])
def test_budget_bounds_the_model_input(shapes, budget, packed):
    """Every micro-batch's model input (rows x sequence positions before the CP split) holds at most
    ``actor.max_tokens_per_micro_batch`` tokens, and ``MicroBatchPlan.tokens`` is exactly that size."""
    from megatron_rl.actor.batch import RolloutBatch
    from megatron_rl.actor.batcher import MicroBatcher

    batch = RolloutBatch.from_sequences([[5] * p for p, _ in shapes], [[6] * r for _, r in shapes], pad_id=0)
    groups = _groups()
    batcher = MicroBatcher(groups.dims, packed=packed, max_tokens=budget)
    plan = batcher.plan(batch.lengths.tolist())
    ordered = batch.take(plan.order)
    mbs = batcher.cut(ordered, plan.bounds, groups)
    for mb, tokens in zip(mbs, plan.tokens):
        assert mb.tokens.numel() == tokens, (mb.rows, tuple(mb.tokens.shape), tokens)
        assert mb.tokens.numel() <= budget


# ------------------------------------------------------------------------------------------- devices
def _rank_devices(rank, world, cp_size):
    """On a stand-in accelerator (``fake_accelerator``: mixing its tensors with CPU tensors raises, like CUDA):
    every tensor of a packed micro-batch is on the actor's device, cu_seqlens int32; the layout's round trips
    run on device outputs; replay targets come from the host-side routing."""
    import megatron_rl.actor.schedule as schedule
    from megatron_rl.actor.batch import RolloutBatch
    from megatron_rl.testing import fake_accelerator as fa

    fa.install()
    dev = torch.device(fa.DEVICE)
    schedule.actor_device = lambda: dev
    groups = _groups(cp_size)
    shapes = [(3, 4), (1, 0), (2, 5), (6, 1), (1, 1)]
    batch = RolloutBatch.from_sequences([[5] * p for p, _ in shapes], [[6] * r for _, r in shapes], pad_id=0)
    routing = torch.randint(0, 4, (batch.num_rows, batch.max_length - 1, 2, 2))
    mask = batch.response_mask
    on_dev = batch.to(dev)
    per_token = {"response_mask": mask.to(dev), "advantages": torch.ones_like(mask).to(dev), "is_weights": None}
    mbs = schedule.packed_micro_batches(on_dev, [(0, 2), (2, 5)], groups, per_token=per_token)
    seen = []
    for mb in mbs:
        psp = mb.packed_seq_params
        tensors = {"tokens": mb.tokens, "position_ids": mb.position_ids, "targets": mb.targets,
                   "seq_valid_tokens": mb.seq_valid_tokens, "cu_seqlens_q": psp.cu_seqlens_q,
                   "cu_seqlens_kv": psp.cu_seqlens_kv, "cu_seqlens_q_padded": psp.cu_seqlens_q_padded,
                   "cu_seqlens_kv_padded": psp.cu_seqlens_kv_padded,
                   **{f"per_token.{k}": v for k, v in mb.per_token.items() if v is not None},
                   **{f"layout.{k}": v for k, v in vars(mb.layout).items() if isinstance(v, torch.Tensor)}}
        for name, t in tensors.items():
            seen.append((name, t.device.type, str(t.dtype)))
        assert isinstance(psp.max_seqlen_q, int)
        # the model's output on the device, back into rows (loss) and whole rows (log-prob pass)
        y = torch.randn(mb.tokens.shape).to(dev)
        seen.append(("loss_rows", mb.layout.loss_rows(y).device.type, ""))
        if cp_size == 1:
            seen.append(("gather_rows", mb.layout.gather_rows(y, groups).device.type, ""))
        t = mb.layout.routing_targets(routing, batch.lengths, groups, device=mb.tokens.device)
        seen.append(("routing_targets", t.device.type, str(t.dtype)))
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cp", [1, 2])
def test_packed_micro_batch_tensors_live_on_the_actor_device(cp):
    (seen,) = run_ranks(_rank_devices, 1, cp, timeout=100)
    off = [s for s in seen if s[1] != "fakegpu"]
    assert not off, off
    for name, _, dtype in seen:
        if name.startswith("cu_seqlens"):
            assert dtype == "torch.int32", name


# ------------------------------------------------------------------------------------------- balanced DP shards
def test_step_batch_balanced_shards_are_whole_groups_with_their_own_data():
    """``StepBatch.shard(balance_tokens=True)``: the DP ranks' rows partition the step's rows into whole prompt
    groups with balanced tokens, and every per-row tensor of a shard (tokens, lengths, rollout log-probs, loss
    mask, rewards, group index, token lag) belongs to the row it is next to — checked against the step's rows
    taken one by one."""
    import itertools

    from megatron_rl.actor.batch import RolloutBatch
    from megatron_rl.trainer.step_batch import StepBatch

    n, groups_resp = 2, [[9, 8], [1, 2], [7, 7], [1, 1], [3, 2], [2, 3]]   # 6 prompt groups of 2 samples
    g = torch.Generator().manual_seed(0)
    prompts, responses, lps, versions, masks = [], [], [], [], []
    for gi, lens in enumerate(groups_resp):
        p = torch.randint(3, 50, (2 + gi % 3,), generator=g).tolist()
        for r in lens:
            prompts.append(p)
            responses.append(torch.randint(3, 50, (r,), generator=g).tolist())
            lps.append((-torch.rand(r, generator=g)).tolist())
            versions.append(torch.randint(3, 6, (r,), generator=g).tolist())
            masks.append(torch.randint(0, 2, (r,), generator=g).tolist())
    rewards = torch.rand(len(prompts), generator=g).tolist()
    sb = StepBatch(prompt_ids=prompts, response_ids=responses, rollout_log_probs=lps, rewards=rewards,
                   weight_version="step-5", token_versions=versions, loss_masks=masks)
    full = RolloutBatch.from_sequences(prompts, responses, lps, pad_id=0, loss_masks=masks)
    shards = [sb.shard(6, n, 0, r, 2, torch.device("cpu"), balance_tokens=True) for r in range(2)]
    rows = [list(s.rows) for s in shards]
    assert sorted(rows[0] + rows[1]) == list(range(len(prompts)))
    assert rows[0] != list(range(6)), "the balanced split differs from contiguous blocks here"
    tok = [len(p) + len(r) for p, r in zip(prompts, responses)]
    # best split into two halves of 3 whole groups (brute force) vs the shards' larger sum: greedy within 4/3
    gt = [tok[2 * i] + tok[2 * i + 1] for i in range(6)]
    best = min(max(sum(gt[i] for i in c), sum(gt) - sum(gt[i] for i in c))
               for c in itertools.combinations(range(6), 3))
    got = max(sum(tok[i] for i in r) for r in rows)
    assert 3 * got <= 4 * best
    for s, rs in zip(shards, rows):
        for i, row in enumerate(rs):
            assert row // n == rs[i - i % n] // n, "whole groups, samples of a group consecutive"
            ref = full.select(row, row + 1)
            assert torch.equal(s.batch.tokens[i], ref.tokens[0])
            assert int(s.batch.lengths[i]) == int(ref.lengths[0])
            assert int(s.batch.prompt_lengths[i]) == int(ref.prompt_lengths[0])
            assert torch.equal(s.batch.rollout_log_probs[i], ref.rollout_log_probs[0])
            assert torch.equal(s.batch.loss_mask[i], ref.loss_mask[0])
            assert float(s.rewards[i]) == pytest.approx(rewards[row])
            assert int(s.group_index[i]) == row // n
            p = len(prompts[row])
            lag = torch.zeros(full.max_length - 1, dtype=torch.int64)
            lag[p - 1: p - 1 + len(versions[row])] = 6 - torch.tensor(versions[row])
            assert torch.equal(s.token_lag[i], lag)
