"""Device discipline, review additions (``megatron_rl.testing.fake_accelerator``: ``fakegpu`` tensors, NCCL-like
``fakeccl`` groups).

* The rollout correction with every RS option and IS level, including a batch without response columns, runs
  on ``fakegpu`` with no host tensor mixed in (``seq_max_k2`` built its empty-width statistic on the host),
  and gives the CPU's result.
* The full-model gathers at export (``convert.live``: disk weight sync exports every step) bring the later
  stages' tensors to rank 0 over an NCCL-like default group without padding traffic: ``gather_object``
  padded every rank's payload to the largest stage and had rank 0 allocate world_size x that on its device
  (512 ranks x one stage of a 7B model: terabytes of GPU memory); ranks that hold nothing must send nothing
  beyond a few bytes of metadata.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_device_discipline_review.py -q``
"""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_rl.correction import compute_rollout_correction
from megatron_rl.correction.config import RolloutCorrectionConfig
from megatron_rl.testing import fake_accelerator as fa
from megatron_rl.testing.distributed import run_ranks

RS_OPTIONS = ["token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"]


def _configs():
    out = [dict(rollout_is=lvl, rollout_is_threshold=thr, rollout_is_batch_normalize=lvl is not None)
           for lvl in (None, "token", "sequence", "geometric") for thr in (2.0, "0.5_2.0")]
    out += [dict(rollout_is="token", rollout_rs=rs, rollout_rs_threshold=1.5 if rs.endswith("k1") else 0.5,
                 rollout_token_veto_threshold=1e-3) for rs in RS_OPTIONS]
    out += [dict(rollout_is="sequence", on_invalid="reject"),
            dict(rollout_is="token", bypass_mode=True, loss_type="reinforce")]
    return out


@pytest.mark.parametrize("width", [7, 0], ids=["columns", "no_columns"])
def test_correction_every_option_on_an_accelerator(width):
    fa.install()
    dev = torch.device(fa.DEVICE, 0)
    g = torch.Generator().manual_seed(0)
    B = 6
    mask = (torch.rand(B, 7, generator=g) > 0.3).float()
    mask[0] = 0
    rollout = -torch.rand(B, 7, generator=g) * 3 * mask
    train = (rollout + torch.randn(B, 7, generator=g) * 0.5).clamp(max=-0.01) * mask
    mask, rollout, train = mask[:, :width], rollout[:, :width], train[:, :width]
    failures = []
    for c in _configs():
        cfg = RolloutCorrectionConfig(**c)
        try:
            got = compute_rollout_correction(train.to(dev), rollout.to(dev), mask.to(dev), cfg)
        except RuntimeError as exc:  # a host tensor met the accelerator's
            failures.append(f"{c}: {exc}")
            continue
        ref = compute_rollout_correction(train, rollout, mask, cfg)
        assert got.response_mask.device == dev and (got.weights is None or got.weights.device == dev), c
        assert got.metrics.keys() == ref.metrics.keys()
        for k, v in ref.metrics.items():
            assert got.metrics[k] == pytest.approx(v, rel=1e-12, abs=1e-12), (c, k)
        torch.testing.assert_close(got.response_mask.cpu(), ref.response_mask, rtol=0, atol=0)
        if ref.weights is not None:
            torch.testing.assert_close(got.weights.cpu(), ref.weights, rtol=0, atol=0)
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------- export: stages to rank 0

# 4 ranks = 2 pipeline stages x 2 data-parallel replicas; the first replica's rank of each stage leads
ROLES = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}  # rank: (pp_rank, dp_rank)


def _stage_tensors(pp_rank):
    """The HF tensors of a stage (independent of the code under test: fixed seeds, mixed dtypes / shapes)."""
    g = torch.Generator().manual_seed(100 + pp_rank)
    n = 4 + 12 * pp_rank  # the later stage is the larger one: padding to it shows
    out = {f"model.layers.{pp_rank}.w{i}": torch.randn(32, 8 + i, generator=g) for i in range(n)}
    out[f"model.layers.{pp_rank}.bias_bf16"] = torch.randn(5, generator=g).to(torch.bfloat16)
    out[f"model.layers.{pp_rank}.scalar"] = torch.tensor(float(pp_rank) + 0.5)
    return out


def _collect_body(rank, world):
    from megatron_rl.convert.live import _collect_on_rank0

    fa.install()
    fa.make_default_group()  # the default group: "NCCL"
    pp, dp = ROLES[rank]
    groups = SimpleNamespace(tp_rank=0, dp_rank=dp, cp_rank=0, edp_rank=dp, ep_rank=0, etp_rank=0, pp_rank=pp,
                             pp_size=2)
    # every rank of a stage runs the (collective) stream; the tensors live on the accelerator
    pairs = ((n, t.to(fa.DEVICE)) for n, t in _stage_tensors(pp).items())
    fa.TRAFFIC.clear()
    got = _collect_on_rank0(pairs, groups)
    dist.barrier()
    return {"got": got, "traffic": sum(fa.TRAFFIC.values()),
            "devices": None if got is None else sorted({str(t.device) for t in got.values()})}


def test_export_gather_sends_each_stage_once_without_padding():
    out = run_ranks(_collect_body, 4, timeout=240)
    ref = {**_stage_tensors(0), **_stage_tensors(1)}
    got = out[0]["got"]
    assert out[0]["devices"] == ["cpu"]
    assert sorted(got) == sorted(ref)
    for name, t in ref.items():
        assert got[name].dtype == t.dtype, name
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)
    assert all(o["got"] is None for o in out[1:])
    stage1 = sum(t.numel() * t.element_size() for t in _stage_tensors(1).values())
    meta = 4096  # object collectives' bytes: roles, names / shapes / dtypes
    for rank in (1, 3):  # hold nothing to export: a few bytes of metadata, no payload padded to a stage
        assert out[rank]["traffic"] < meta, (rank, out[rank]["traffic"], stage1)
    # rank 0 receives the later stage once (not world_size buffers of the largest stage); its leader sends it once
    assert out[0]["traffic"] < stage1 + meta, (out[0]["traffic"], stage1)
    assert out[2]["traffic"] < stage1 + meta, (out[2]["traffic"], stage1)


# ------------------------------------------------------------ correction result from the last PP stage

def _pp_broadcast_body(rank, world, where):
    from megatron_rl.correction import broadcast_from_last_stage

    fa.install()
    pp = dist.new_group([0, 1], backend=fa.BACKEND if where == "host_result_nccl_group" else None)
    dev = torch.device("cpu") if where == "host_result_nccl_group" else torch.device(fa.DEVICE, 0)
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    weights = torch.tensor([[0.5, 0.0, 2.0], [0.0, 1.5, 1.0]])
    result = None
    if rank == 1:  # the last stage
        from megatron_rl.correction.core import CorrectionResult
        result = CorrectionResult(weights=weights.to(dev), response_mask=mask.to(dev), metrics={"m": 1.0},
                                  num_collectives=0)
    got = broadcast_from_last_stage(result, pp)
    return {"mask": got.response_mask.cpu(), "weights": got.weights.cpu(), "metrics": got.metrics,
            "device": str(got.response_mask.device), "ref": (mask, weights)}


@pytest.mark.parametrize("where", ["host_result_nccl_group", "device_result_gloo_group"])
def test_correction_broadcast_from_last_stage_is_staged_for_the_group(where):
    out = run_ranks(_pp_broadcast_body, 2, where, timeout=120)
    for o in out:
        mask, weights = o["ref"]
        torch.testing.assert_close(o["mask"], mask, rtol=0, atol=0)
        torch.testing.assert_close(o["weights"], weights, rtol=0, atol=0)
        assert o["metrics"] == {"m": 1.0}
    # a receiving stage gets its tensors on the group's device (fakeccl: fakegpu; gloo: the CPU)
    assert out[0]["device"] == ("fakegpu:0" if where == "host_result_nccl_group" else "cpu")
