"""Device discipline on a CPU machine: the step runs with the actor's outputs on a device that is not the CPU
and with NCCL-like groups that refuse any other device (``megatron_rl.testing.fake_accelerator``).

* ``parallel.devices`` stages a tensor on the device its group's backend takes and copies the result back
  (gloo: CPU, the NCCL-like ``fakeccl``: ``fakegpu``); the shim itself refuses the wrong device, so these
  tests can fail.
* The step logic of the loop on 2 DP ranks — ``StepBatch.shard`` (the batch, rewards, group index and lag moved
  to the actor's device once), the rollout correction, the policy-lag metrics, the advantages and the stop
  flag — with the actor's log-probs on ``fakegpu``, the DP group and the default group ``fakeccl``: the
  results equal the same step computed in one process on the CPU, and the lag / advantage values equal
  direct formulas (staleness from the token versions, GRPO with ``torch.std``).
* The weight buckets of the later pipeline stage (PP=2) reach rank 0 over a ``fakeccl`` default group and
  equal the checkpoint read by safetensors.
* Each of the four device sites, with its old behaviour put back (the batch left on the host, the lag sums
  reduced as host tensors, the stop flag and the bucket sent as host tensors), fails on this layer with the
  device named.
* The rollout correction with every RS option and IS level, including a batch without response columns, runs
  on ``fakegpu`` with no host tensor mixed in (``seq_max_k2`` built its empty-width statistic on the host),
  and gives the CPU's result.
* The full-model gathers at export (``convert.live``: disk weight sync exports every step) bring the later
  stages' tensors to rank 0 over an NCCL-like default group without padding traffic: ``gather_object``
  padded every rank's payload to the largest stage and had rank 0 allocate world_size x that on its device
  (512 ranks x one stage of a 7B model: terabytes of GPU memory); ranks that hold nothing must send nothing
  beyond a few bytes of metadata.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_device_discipline.py -q``
"""
import os

import pytest
import torch
import torch.distributed as dist

import megatron_rl.correction.lag as lag_module
import megatron_rl.trainer.step_batch as step_batch_module
import megatron_rl.weight_sync.transport as weight_sync_transport
from megatron_rl.actor.batch import RolloutBatch
from megatron_rl.algo.advantages import compute_advantages
from megatron_rl.correction import compute_rollout_correction, correct_in_loss
from megatron_rl.correction.config import RolloutCorrectionConfig
from megatron_rl.correction.lag import policy_lag_metrics
from megatron_rl.testing import fake_accelerator as fa
from megatron_rl.testing.distributed import RankError, run_ranks
from megatron_rl.trainer.step_batch import StepBatch, any_rank

N_SAMPLES, STEP, MAX_LAG = 2, 3, 1
CORR = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                               rollout_rs_threshold=1.5)


def _payload(seed=0, prompts=4):
    """A step's rollouts: prompts x N_SAMPLES rows, async token versions (lag 0 or 1), and the actor's
    fp32 log-probs for the full batch ([B, L-1], the RolloutBatch layout)."""
    g = torch.Generator().manual_seed(seed)
    p_ids, r_ids, r_lp, versions = [], [], [], []
    for _ in range(prompts * N_SAMPLES):
        p = int(torch.randint(1, 5, (1,), generator=g))
        r = int(torch.randint(1, 7, (1,), generator=g))
        p_ids.append(torch.randint(0, 50, (p,), generator=g).tolist())
        r_ids.append(torch.randint(0, 50, (r,), generator=g).tolist())
        r_lp.append((-torch.rand(r, generator=g) * 3).tolist())
        versions.append((STEP - torch.randint(0, MAX_LAG + 1, (r,), generator=g)).tolist())
    rewards = torch.randint(0, 3, (prompts * N_SAMPLES,), generator=g).float().tolist()
    payload = StepBatch(prompt_ids=p_ids, response_ids=r_ids, rollout_log_probs=r_lp, rewards=rewards,
                        weight_version=f"step-{STEP - 1}", token_versions=versions)
    batch = RolloutBatch.from_sequences(p_ids, r_ids, r_lp)
    noise = torch.randn(batch.rollout_log_probs.shape, generator=g) * 0.3
    train_lp = (batch.rollout_log_probs + noise).clamp(max=-0.01) * batch.response_mask
    return payload, train_lp


def _step(payload, train_lp, device, dp_rank=0, dp_size=1, group=None):
    """The step's logic after the log-prob pass (trainer/step.py) and the loop's stop flag (trainer/loop.py)."""
    inputs = payload.shard(STEP, N_SAMPLES, 0, dp_rank, dp_size, device)
    old_lp = train_lp[list(inputs.rows)].to(device)  # the actor's output for the shard's rows, on its device
    shard = inputs.batch
    corr = compute_rollout_correction(old_lp, shard.rollout_log_probs, shard.response_mask, CORR, group=group)
    lag = policy_lag_metrics(old_lp, shard.rollout_log_probs, shard.response_mask, inputs.token_lag, MAX_LAG,
                             group=group)
    adv = compute_advantages(inputs.rewards, inputs.group_index, corr.response_mask.float())
    stopping = any_rank(dp_rank == dp_size - 1) if group is not None else False
    devices = {str(t.device) for t in (shard.tokens, shard.rollout_log_probs, inputs.rewards, inputs.group_index,
                                       inputs.token_lag, corr.weights, corr.response_mask, adv)}
    return {"metrics": corr.metrics, "lag": lag, "weights": corr.weights.cpu(), "mask": corr.response_mask.cpu(),
            "adv": adv.cpu(), "stopping": stopping, "devices": devices, "rows": list(inputs.rows)}


def _fake_step_body(rank, world, payload, train_lp):
    fa.install()
    dp_group = dist.new_group(list(range(world)), backend=fa.BACKEND)  # the DP group: "NCCL"
    fa.make_default_group()  # the default group: "NCCL" too (the stop flag, the weight buckets)
    return _step(payload, train_lp, torch.device(fa.DEVICE, 0), rank, world, dp_group)


# ------------------------------------------------------------------------------------------ the helper

def _helper_body(rank, world):
    from megatron_rl.parallel.devices import all_reduce_, backend_device_types, collective_device

    fa.install()
    gloo = dist.new_group([0, 1])
    fake = dist.new_group([0, 1], backend=fa.BACKEND)
    out = {"gloo": (str(collective_device(gloo)), sorted(backend_device_types(gloo))),
           "fake": (str(collective_device(fake)), sorted(backend_device_types(fake)))}
    x = all_reduce_(torch.tensor([1.0 + rank, 2.0], device=fa.DEVICE), group=gloo)   # staged on the CPU
    y = all_reduce_(torch.tensor([1.0 + rank, 2.0]), op=dist.ReduceOp.MAX, group=fake)  # staged on fakegpu
    out["x"], out["y"] = (str(x.device), x.cpu().tolist()), (str(y.device), y.tolist())
    for name, t, g in (("cpu_on_fake", torch.ones(2), fake), ("fake_on_gloo", torch.ones(2, device=fa.DEVICE), gloo)):
        try:
            dist.all_reduce(t, group=g)
            out[name] = "accepted"
        except RuntimeError as exc:
            out[name] = str(exc)
    return out


def test_collectives_are_staged_on_the_backends_device():
    for out in run_ranks(_helper_body, 2, timeout=120):
        assert out["gloo"] == ("cpu", ["cpu"])
        assert out["fake"] == ("fakegpu:0", ["fakegpu"])
        assert out["x"] == ("fakegpu:0", [3.0, 4.0])  # the caller's tensor keeps its device
        assert out["y"] == ("cpu", [2.0, 2.0])
        # the layer refuses the wrong device by itself (so the tests below can fail)
        assert "takes fakegpu tensors only" in out["cpu_on_fake"]
        assert "fakegpu" in out["fake_on_gloo"] and out["fake_on_gloo"] != "accepted"


# -------------------------------------------------------------------------------------------- the step

def test_step_logic_on_an_accelerator_with_nccl_like_groups():
    payload, train_lp = _payload()
    ranks = run_ranks(_fake_step_body, 2, payload, train_lp, timeout=240)
    ref = _step(payload, train_lp, torch.device("cpu"))  # one process, the whole batch, on the CPU
    for r in ranks:
        assert r["devices"] == {"fakegpu:0"}  # nothing fell back to the host
        assert r["stopping"] is True  # raised on rank 1 only, seen by both
        assert r["metrics"].keys() == ref["metrics"].keys()
        for k, v in ref["metrics"].items():  # exact over DP: global statistics, not means of rank means
            assert r["metrics"][k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
        assert r["lag"] == pytest.approx(ref["lag"], rel=1e-12)
    rows = torch.tensor([i for r in ranks for i in r["rows"]])
    assert rows.tolist() == list(range(len(payload.rewards)))
    width = ref["weights"].shape[1]

    def cat(key):
        return torch.cat([torch.nn.functional.pad(r[key], (0, width - r[key].shape[1])) for r in ranks])

    torch.testing.assert_close(cat("weights"), ref["weights"], rtol=0, atol=0)
    torch.testing.assert_close(cat("mask"), ref["mask"], rtol=0, atol=0)
    torch.testing.assert_close(cat("adv"), ref["adv"], rtol=0, atol=0)
    # independent of the code under test: staleness from the token versions, GRPO advantages with torch.std
    lags = [STEP - v for vs in payload.token_versions for v in vs]
    assert ref["lag"]["rollout/staleness_mean"] == pytest.approx(sum(lags) / len(lags))
    assert ref["lag"]["rollout/staleness_frac_lag1"] == pytest.approx(lags.count(1) / len(lags))
    r = torch.tensor(payload.rewards, dtype=torch.float64).view(-1, N_SAMPLES)
    grpo = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    kept = ref["mask"].sum(1) > 0
    per_row = torch.where(ref["mask"].bool(), ref["adv"].double(), torch.nan).nanmean(1)
    torch.testing.assert_close(per_row[kept], grpo[kept], rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- weight buckets at PP > 1

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from megatron_rl.testing.tiny_hf import build_tiny_hf_model

    return build_tiny_hf_model(tmp_path_factory.mktemp("devices") / "actor", arch="qwen2", seed=1,
                               num_hidden_layers=2)


def _pp_job(hf_dir):
    """The table's actor row on ``hf_dir`` at PP2 with tensor weight sync."""
    from megatron_rl.testing.jobs import layout, named_job

    return named_job("actor", *layout(tp=1, pp=2), "rollout.weight_sync=tensor", hf=hf_dir)


def _buckets_body(rank, world, job):
    from megatron_rl.actor import MegatronActor
    from megatron_rl.plan import actor_spec
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.weight_sync.senders import stream_buckets

    initialize_model_parallel(job.parallel, seed=3, model=job.model)  # the model's own groups: gloo, CPU
    actor = MegatronActor(actor_spec(job))
    fa.install()
    fa.make_default_group()  # stage leaders send to rank 0 over the default group: "NCCL"
    got = {}
    for bucket in stream_buckets(actor, 1 << 14, None):
        for name, t in bucket.tensors():
            got[name] = t.clone()
    return got


def test_later_stage_buckets_reach_rank0_over_an_nccl_like_group(hf_dir):
    from safetensors.torch import load_file

    got = run_ranks(_buckets_body, 2, _pp_job(hf_dir), timeout=300)[0]
    ref = load_file(os.path.join(hf_dir, "model.safetensors"))
    assert sorted(got) == sorted(ref)
    assert any(".layers.1." in n for n in got)  # the second stage's layers came over the wire
    for name, t in ref.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)


# -------------------------------------------------------------- each site with its old behaviour put back

def _host_all_reduce(t, op=dist.ReduceOp.SUM, group=None):
    """The old lag metrics: their sums reduced as host tensors."""
    host = t.cpu()
    dist.all_reduce(host, op=op, group=group)
    return t.copy_(host)


def _plain_all_reduce(t, op=dist.ReduceOp.SUM, group=None):
    """The old stop flag: a host tensor handed to ``dist.all_reduce`` as it is."""
    dist.all_reduce(t, op=op, group=group)
    return t


def _plain_send(t, dst, group=None):
    dist.send(t, dst=dst, group=group)


def _plain_recv(t, src, group=None):
    dist.recv(t, src=src, group=group)
    return t


OLD_SITES = {
    "batch_left_on_host": ((RolloutBatch, "to", lambda self, device: self),
                           "response_mask on cpu"),
    "lag_sums_on_host": ((lag_module, "all_reduce_", _host_all_reduce),
                         "fakeccl all_reduce: a tensor on cpu"),
    "stop_flag_on_host": ((step_batch_module, "all_reduce_", _plain_all_reduce),
                          "fakeccl all_reduce: a tensor on cpu"),
    "bucket_sent_from_host": ((weight_sync_transport, "send_", _plain_send),
                              "fakeccl (send|recv): a tensor on cpu"),
}


@pytest.mark.parametrize("site", sorted(OLD_SITES))
def test_each_old_device_site_is_caught(site, monkeypatch, request):
    (owner, attr, old), expected = OLD_SITES[site]
    monkeypatch.setattr(owner, attr, old)
    if site == "bucket_sent_from_host":
        monkeypatch.setattr(weight_sync_transport, "recv_", _plain_recv)
        with pytest.raises(RankError, match=expected):
            run_ranks(_buckets_body, 2, _pp_job(request.getfixturevalue("hf_dir")), timeout=300)
        return
    payload, train_lp = _payload()
    with pytest.raises(RankError, match=expected):
        run_ranks(_fake_step_body, 2, payload, train_lp, timeout=240)


# -------------------------------------------------------------------------------- correction and export gathers
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
        # bypass mode's in-loss correction of the same log-probs (the loss runs where the logits are)
        try:
            lc = correct_in_loss(train.to(dev), rollout.to(dev), mask.to(dev), cfg)
        except RuntimeError as exc:
            failures.append(f"correct_in_loss {c}: {exc}")
            continue
        lc_ref = correct_in_loss(train, rollout, mask, cfg)
        assert lc.keep.device == dev and lc.kept_tokens.device == dev, c
        assert torch.equal(lc.keep.cpu(), lc_ref.keep) and torch.equal(lc.kept_tokens.cpu(), lc_ref.kept_tokens), c
        if lc_ref.weights is not None:
            assert lc.weights.device == dev, c
            torch.testing.assert_close(lc.weights.cpu(), lc_ref.weights, rtol=0, atol=0)
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
    from types import SimpleNamespace

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
