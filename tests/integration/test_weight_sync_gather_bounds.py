"""The TP / ETP gather of the weight sync at its edges (``weight_sync.gather``, ``shm_owned``):

* ``shm``: pieces larger than a batch, in growing sizes, keep the segment within what ``megatron-rl check`` counts
  (``shm.segment_bytes``: two slots of at most ``max(largest piece, 2 batches)``), and every batch reaches the
  sender equal to ``partition.merge_tensors`` of the pieces;
* ``flat`` (the GPU path) on the fake accelerator (``testing.fake_accelerator``: an NCCL-like group that refuses
  host tensors): every split kind of a GQA model gathered on the device equals ``merge_tensors`` of the pieces, and
  its HF tensors copied into a bf16 host engine weight equal ``mapping.hf_tensors`` of the merged tensor, cast;
* an async owned bucket (``shm_owned._owned``) of a held bucket keeps ``HeldBucket``'s meaning: its tensors cast to
  the bucket's dtype as an engine would.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_weight_sync_gather_bounds.py -q``
"""
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.convert.partition import merge_tensors, split_tensor
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.weight_sync import shm

MiB = 1 << 20


def _grow(rank, world, sizes):
    import torch.distributed as dist

    from megatron_rl.weight_sync import gather

    g = dist.new_group([0, 1])
    gatherer = gather._ShmGather(batch_bytes=MiB, timeout_s=60)
    out = {"segment": [], "equal": []}
    for i, n in enumerate(sizes):
        full = torch.arange(2 * n // 4, dtype=torch.float32).reshape(-1, 64) + i
        parts = list(full.chunk(2, 0))
        got = gatherer.gather_many([(parts[rank], "column", f"p{i}")], g, 2, None)[0]
        if rank == 0:
            out["equal"].append(torch.equal(got.materialize(), merge_tensors(parts, "column", f"p{i}")))
        else:
            out["segment"].append(gatherer.groups[id(g)][1].mine.nbytes)
    return out


@pytest.mark.skipif(not shm.available(), reason="needs memfd_create and /proc")
@pytest.mark.timeout(120)
def test_growing_pieces_keep_the_segment_within_what_check_counts():
    sizes = [3 * MiB // 2, 13 * MiB // 8]  # per-rank pieces above a 1 MiB batch, the second just larger
    out = run_ranks(_grow, 2, sizes, timeout=90)
    assert out[0]["equal"] == [True, True]
    settings = SimpleNamespace(bucket_bytes=MiB, tp_gather="shm", sender_transport="gloo")
    bound = shm.segment_bytes(settings, largest_piece=max(sizes))[0]
    assert max(out[1]["segment"]) <= bound, (out[1]["segment"], bound)


def _flat(rank, world):
    import torch.distributed as dist

    from megatron_rl.convert.geometry import HFGeometry
    from megatron_rl.convert.mapping import hf_tensors, param_rules
    from megatron_rl.convert.partition import param_kind, split_layer_name
    from megatron_rl.convert.pieces import Pieces, hf_pieces
    from megatron_rl.convert.tiny_hf import tiny_config
    from megatron_rl.testing import fake_accelerator as fa
    from megatron_rl.weight_sync.gather import piece_gather

    fa.install()
    group = dist.new_group([0, 1], backend=fa.BACKEND)
    vocab, padded = 100, 104
    g = HFGeometry.from_hf_config(tiny_config("qwen2", vocab, num_hidden_layers=1, num_attention_heads=8,
                                              num_key_value_heads=2, tie_word_embeddings=False).to_dict())
    gather = piece_gather("flat")
    gen = torch.Generator().manual_seed(0)
    bad, kinds = [], set()
    for rule in param_rules(g):
        rows = vocab if rule.mcore_name in ("embedding.word_embeddings.weight", "output_layer.weight") else None
        shape = (padded,) + tuple(rule.mcore_shape[1:]) if rows else tuple(rule.mcore_shape)
        full = torch.randn(shape, generator=gen)
        layer = split_layer_name(rule.mcore_name)
        kind = param_kind(rule.mcore_name if layer is None else layer[1])
        if kind == "replicated":
            continue
        kinds.add(kind)
        parts = [split_tensor(full, kind, r, 2, rule.mcore_name) for r in range(2)]
        got = gather(parts[rank].to(fa.DEVICE), kind, group, 2, rule.mcore_name, torch.bfloat16)
        if rank != 0:
            continue
        assert got.device.type == fa.DEVICE, rule.mcore_name
        ref = merge_tensors([p.to(torch.bfloat16) for p in parts], kind, rule.mcore_name)
        if not torch.equal(got.cpu(), ref):
            bad.append(rule.mcore_name)
        want = dict(hf_tensors(rule, ref[:rows] if rows else ref, g))
        for name, t in hf_pieces(rule, got, g, rows):  # the engine's copy: device pieces into a host weight
            dst = torch.empty(want[name].shape, dtype=torch.bfloat16)
            if isinstance(t, Pieces):
                t.copy_into(dst)
            else:
                dst.copy_(t)
            if not torch.equal(dst, want[name]):
                bad.append(name)
    return bad, sorted(kinds)


@pytest.mark.timeout(120)
def test_flat_gather_on_the_device_equals_the_merged_pieces():
    out = run_ranks(_flat, 2, timeout=90)
    bad, kinds = out[0]
    assert bad == []
    assert kinds == ["column", "glu_column", "row", "vocab"]


def test_owned_held_bucket_is_cast_to_the_bucket_dtype():
    from megatron_rl.convert.pieces import from_parts
    from megatron_rl.weight_sync.buckets import HeldBucket
    from megatron_rl.weight_sync.shm_owned import _owned

    gen = torch.Generator().manual_seed(1)
    a = torch.randn(4, 6, generator=gen)
    full = torch.randn(8, 6, generator=gen)
    parts = [split_tensor(full, "column", r, 2, "w") for r in range(2)]
    held = [a, from_parts(parts, "column", full.shape, torch.float32)]
    bucket = HeldBucket(["a", "w"], [(4, 6), (8, 6)], torch.bfloat16, None, held)  # an engine casts to bf16
    owned = _owned(bucket)
    assert owned.nbytes == bucket.nbytes and owned.dtype == torch.bfloat16
    got = dict(owned.tensors())
    assert torch.equal(got["a"], a.to(torch.bfloat16)) and torch.equal(got["w"], full.to(torch.bfloat16))
