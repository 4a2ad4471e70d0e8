"""Shared memory between trainer ranks when it cannot be used: a reader refuses a file that is not the writer's
segment (the same ``/proc/<pid>/fd/<n>`` names another process's file in another pid namespace or on another host),
and both transports fall back to gloo -- with the right bytes -- for a rank whose shared memory rank 0 cannot map
(``/proc`` access refused: containers, ptrace policy). References: ``partition.split_tensor`` pieces of a full
tensor, and the bytes a sender packed."""
import os

import pytest
import torch

from megatron_rl.testing.distributed import run_ranks
from megatron_rl.weight_sync import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs memfd_create and /proc")

KINDS = {"column": (8, 6), "vocab": (16, 6), "row": (6, 8), "glu_column": (16, 6), "expert_row": (6, 8),
         "expert_glu_column": (16, 6)}


def test_attach_refuses_a_file_that_is_not_the_writers_segment():
    a, b = shm.Segment.create("a", 64), shm.Segment.create("b", 64)
    a.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert shm.Segment.attach(a.path, a.key, 64).tensor[:4].tolist() == [1, 2, 3, 4]
    with pytest.raises(OSError, match="not the weight-sync segment"):  # a's path, b's key: another process's fd
        shm.Segment.attach(a.path, b.key, 64)
    with open(os.devnull, "rb") as fh:  # any other file at the path
        with pytest.raises(OSError, match="not the weight-sync segment"):
            shm.Segment.attach(f"/proc/{os.getpid()}/fd/{fh.fileno()}", a.key, 0)


def _refuse(rank, what):
    """``proc``: rank 0 may not open another process's ``/proc/<pid>/fd``; ``memfd``: rank 1 may not create one;
    ``host``: rank 1 is on another host (whose ``/proc`` paths name this host's processes' files)."""
    if what == "host" and rank == 1:
        from megatron_rl.weight_sync import shm_reach

        shm_reach.host_id = lambda: "another-host/boot"
    if what == "proc" and rank == 0:
        def refused(cls, path, key, nbytes):
            raise PermissionError(1, "Operation not permitted", path)
        shm.Segment.attach = classmethod(refused)
    if what == "memfd" and rank == 1:
        def no_memfd(*args):
            raise PermissionError(1, "Operation not permitted")
        os.memfd_create = no_memfd


def _gather_body(rank, world, refuse):
    import torch.distributed as dist

    from megatron_rl.convert.partition import split_tensor
    from megatron_rl.weight_sync.gather import piece_gather

    _refuse(rank, refuse)
    group = dist.new_group([0, 1], backend="gloo")
    gather = piece_gather("shm")
    out = {}
    for i, (kind, shape) in enumerate(sorted(KINDS.items())):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(i))
        got = gather(split_tensor(full, kind, rank, 2, "w"), kind, group, 2, "w", torch.bfloat16)
        out[kind] = (full, got)
    return out


@pytest.mark.parametrize("refuse", [None, "proc", "memfd", "host"])
def test_tp_gather_falls_back_to_gloo_when_the_sender_cannot_map_pieces(refuse):
    out = run_ranks(_gather_body, 2, refuse, timeout=60)
    for kind, (full, got) in out[0].items():
        assert torch.equal(got, full.to(torch.bfloat16)), kind
    assert all(got is None for _, got in out[1].values())


class _Keep:
    def __init__(self):
        self.got = {}

    def load(self, bucket):
        self.got.update({n: t.clone() for n, t in bucket.tensors()})


def _sender_body(rank, world, refuse):
    from megatron_rl.weight_sync import in_process
    from megatron_rl.weight_sync.buckets import bucketize

    _refuse(rank, refuse)
    receiver = _Keep() if rank == 0 else None
    channel = in_process.InProcessSpec(30.0).open(rank, [0, 1], receiver, "shm")
    sent = {}
    if rank == 1:
        pairs = [(f"w{i}", torch.randn(64, 32, generator=torch.Generator().manual_seed(i))) for i in range(5)]
        sent = {n: t.clone() for n, t in pairs}
        for bucket in bucketize(pairs, 16 << 10, torch.bfloat16, reuse=True, alloc=getattr(channel, "alloc", None)):
            channel.send(bucket)
    channel.close()
    return {"got": receiver.got if receiver else None, "sent": sent, "channel": type(channel).__name__}


@pytest.mark.parametrize("refuse", [None, "proc", "memfd", "host"])
def test_sender_falls_back_to_gloo_when_rank0_cannot_map_its_segment(refuse):
    out = run_ranks(_sender_body, 2, refuse, timeout=60)
    assert out[1]["channel"] == ("_ToRank0Channel" if refuse else "_ShmToRank0Channel")
    sent, got = out[1]["sent"], out[0]["got"]
    assert sorted(got) == sorted(sent)
    for n, t in sent.items():
        assert torch.equal(got[n], t.to(torch.bfloat16)), n


def _flat_body(rank, world):
    import torch.distributed as dist

    from megatron_rl.convert.partition import split_tensor
    from megatron_rl.testing import fake_accelerator as fa
    from megatron_rl.weight_sync.gather import piece_gather

    fa.install()
    group = dist.new_group([0, 1], backend=fa.BACKEND)  # an "NCCL" group: device tensors only
    out = {}
    for i, (kind, shape) in enumerate(sorted(KINDS.items())):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(i))
        got = piece_gather("flat")(split_tensor(full, kind, rank, 2, "w").to(fa.DEVICE), kind, group, 2, "w",
                                   torch.bfloat16)
        out[kind] = (full, None if got is None else (got.device.type, got.cpu()))
    return out


def test_flat_gather_on_an_nccl_like_group():
    """``tp_gather: flat`` (the GPU choice): one all_gather_single per parameter of device tensors, merged on the
    device, equals the full tensor cast to the engine's dtype."""
    out = run_ranks(_flat_body, 2, timeout=60)
    for kind, (full, got) in out[0].items():
        assert got[0] == "fakegpu" and torch.equal(got[1], full.to(torch.bfloat16)), kind
    assert all(got is None for _, got in out[1].values())


def _bad_meta_body(rank, world):
    import torch.distributed as dist

    from megatron_rl.weight_sync import in_process
    from megatron_rl.weight_sync.buckets import bucketize

    receiver = _Keep() if rank == 0 else None
    channel = in_process.InProcessSpec(30.0).open(rank, [0, 1], receiver, "shm")
    if rank == 1:
        pairs = [("w", torch.randn(64, 32))]
        for bucket in bucketize(pairs, 16 << 10, reuse=True, alloc=channel.alloc):
            channel.send(bucket)  # a good one: rank 0 maps the segment
            seg = in_process._WRITER[0]
            meta = dict(bucket.meta(), shm=seg.path, shm_key=seg.key, shm_nbytes=seg.nbytes, shm_offset=seg.nbytes)
            dist.send_object_list([meta], dst=0, group=channel.group)  # a corrupted one: bytes past the segment
            dist.recv(channel.ack, src=0, group=channel.group)  # acknowledged all the same: the sender goes on
    try:
        channel.close()
    except Exception as exc:  # noqa: BLE001
        return {"error": str(exc), "mapped": 1 in in_process._READERS}
    return {"error": None}


def test_a_corrupted_bucket_meta_is_named_and_its_segment_unmapped():
    out = run_ranks(_bad_meta_body, 2, timeout=60)
    assert "sender rank 1" in out[0]["error"] and "outside its shared-memory segment" in out[0]["error"]
    assert out[0]["mapped"] is False and out[1]["error"] is None
