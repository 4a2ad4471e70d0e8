"""Buckets of a streamed sync: one reused buffer (``bucketize(reuse=True)``) and held tensors for an engine in the
sender's process (``hold_buckets``), checked against torch's own cast of each input tensor."""
import torch

from megatron_rl.weight_sync.buckets import HeldBucket, bucketize, hold_buckets


def _pairs(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (32,), (128, 16), (16, 16), (300,), (8, 8, 4)]
    return [(f"t{i}", torch.randn(s, generator=g)) for i, s in enumerate(shapes)]


def test_reused_buffer_gives_each_bucket_its_own_values_when_consumed():
    pairs = _pairs()
    seen, ptrs = [], []
    for bucket in bucketize(iter(pairs), 4096, torch.bfloat16, reuse=True):
        ptrs.append(bucket.flat.data_ptr())
        seen += [(n, t.clone()) for n, t in bucket.tensors()]  # consumed before the next is packed
    assert [n for n, _ in seen] == [n for n, _ in pairs]
    for (_, got), (_, src) in zip(seen, pairs):
        assert got.dtype == torch.bfloat16 and torch.equal(got, src.to(torch.bfloat16))
    assert len(ptrs) > 2 and len(set(ptrs)) == 1  # one buffer served every bucket


def test_without_reuse_each_bucket_keeps_its_own_bytes():
    pairs = _pairs(1)
    buckets = list(bucketize(iter(pairs), 4096, torch.bfloat16))
    got = [(n, t) for b in buckets for n, t in b.tensors()]
    for (_, t), (_, src) in zip(got, pairs):
        assert torch.equal(t, src.to(torch.bfloat16))


def test_held_buckets_hold_the_tensors_themselves_within_the_bucket_size():
    pairs = _pairs(2)
    keep = {"t1"}
    buckets = list(hold_buckets(iter(pairs), 4096, torch.bfloat16, keep))
    assert all(isinstance(b, HeldBucket) and b.flat is None for b in buckets)
    got = [(n, t) for b in buckets for n, t in b.tensors()]
    assert [n for n, _ in got] == [n for n, _ in pairs]
    for (_, t), (_, src) in zip(got, pairs):
        assert t.data_ptr() == src.data_ptr()  # not copied: the engine casts as it copies them in
    for b in buckets:
        held = sum(t.numel() * t.element_size() for _, t in b.tensors())
        assert held <= 4096 or len(b.names) == 1
        item = torch.empty((), dtype=b.dtype).element_size()
        assert b.nbytes == sum(t.numel() for _, t in b.tensors()) * item
    dtypes = {n: b.dtype for b in buckets for n in b.names}
    assert dtypes["t1"] == torch.float32 and dtypes["t0"] == torch.bfloat16  # a kept tensor stays in its dtype
