"""Delta encode / apply (``weight_sync.delta``) against an independent reference: changed positions found by a
Python loop over the integer bits of every element, the new tensor rebuilt by hand-indexed assignment, and
results compared by bits (an integer view), never with ``==`` (which equates -0.0 / +0.0 and no NaN)."""
import struct

import pytest
import torch

from megatron_rl.weight_sync.delta import (DeltaBucket, TensorDelta, apply_delta, changed_positions, encode_delta,
                                           pack_deltas)


def _bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()]).reshape(-1).tolist()


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)


def _ref_positions(new, base):
    return [i for i, (x, y) in enumerate(zip(_bits(new), _bits(base))) if x != y]


def _bf16(bits):
    """bf16 tensor of the given 16-bit patterns."""
    return torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16)


def _specials():
    """base / new with +-0.0, NaN (same and other payload), +-inf and ordinary values."""
    pos0, neg0, nan_a, nan_b, inf, ninf = 0x0000, -0x8000, 0x7FC0, 0x7FC1, 0x7F80, -0x0080
    one, two = 0x3F80, 0x4000
    base = [pos0, neg0, nan_a, nan_a, inf, one, one, two, pos0, 0x1234]
    new = [neg0, pos0, nan_a, nan_b, ninf, one, two, two, pos0, 0x1234]
    return _bf16(new).reshape(2, 5), _bf16(base).reshape(2, 5)


def test_positions_by_bits_match_reference():
    new, base = _specials()
    assert changed_positions(new, base).tolist() == _ref_positions(new, base) == [0, 1, 3, 4, 6]
    assert not torch.equal(changed_positions(new, base), torch.nonzero((new != base).reshape(-1)).reshape(-1))


def test_specials_sparse_apply_is_bitwise_equal():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 33, generator=g).to(torch.bfloat16)
    new = base.clone()
    sp_new, sp_base = _specials()
    base.view(-1)[:10] = sp_base.reshape(-1)
    new.view(-1)[:10] = sp_new.reshape(-1)
    new.view(-1)[500] = float("nan")
    new.view(-1)[2000] = new.view(-1)[2000] * 1.5
    d = encode_delta("w", new, base)
    assert d.kind == "sparse"
    want = _ref_positions(new, base)
    assert d.index.tolist() == want
    target = base.clone()
    apply_delta(target, d)
    ref = base.clone().reshape(-1)  # by hand: the changed positions copied one by one
    for i in want:
        ref[i] = new.reshape(-1)[i]
    assert _same_bits(target, ref.view(64, 33)) and _same_bits(target, new)
    assert d.nbytes == 4 + len(want) * (2 + 2)  # one block count, 2-byte offsets, bf16 values


def test_empty_change_sends_nothing():
    base = torch.randn(8, 8).to(torch.bfloat16)
    d = encode_delta("w", base.clone(), base)
    assert d.kind == "same" and d.nbytes == 0 and d.changed == 0
    target = base.clone()
    apply_delta(target, d)
    assert _same_bits(target, base)


def test_all_changed_is_dense_and_first_version_is_dense():
    base = torch.randn(16, 4).to(torch.bfloat16)
    new = (base.float() + 1.0).to(torch.bfloat16)
    assert len(_ref_positions(new, base)) == 64
    d = encode_delta("w", new, base)
    assert d.kind == "dense" and d.nbytes == 64 * 2 and d.changed == 64
    target = base.clone()
    apply_delta(target, d)
    assert _same_bits(target, new)
    assert encode_delta("w", new, None).kind == "dense"


def test_cast_on_apply_equals_full_copy_and_strided_target():
    """An engine keeping fp32 gets, from a bf16 delta, what ``copy_`` of the bf16 tensor gives it; a
    non-contiguous target (a transposed view) is filled at the right elements."""
    base = torch.randn(6, 10).to(torch.bfloat16)
    new = base.clone()
    new[1, 3] = -0.0
    new[4, 9] = 7.0
    d = encode_delta("w", new, base)
    eng = base.float()
    apply_delta(eng, d)
    assert _same_bits(eng, new.float())
    holder = base.t().contiguous().t()  # same values, column-major strides
    assert not holder.is_contiguous()
    apply_delta(holder, d)
    assert _same_bits(holder.contiguous(), new)


def test_bad_input_is_named():
    base = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'w'"):
        encode_delta("w", torch.zeros(5, dtype=torch.bfloat16), base)
    with pytest.raises(ValueError, match="'w'.*target"):
        apply_delta(torch.zeros(3, dtype=torch.bfloat16), encode_delta("w", base + 1, base))
    bad = TensorDelta("w", (4,), torch.bfloat16, "sparse", index=torch.tensor([9], dtype=torch.int32),
                      values=torch.ones(1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="outside"):
        apply_delta(base.clone(), bad)


def test_buckets_round_trip_through_bytes():
    """Deltas packed into small buckets, moved as (meta, bytes) like a transport does, applied to the base:
    every tensor equals the new one bit for bit; check entries ride after the engine's bytes."""
    g = torch.Generator().manual_seed(1)
    names = [f"t{i}" for i in range(7)]
    base = {n: torch.randn(5 + i, 3, generator=g).to(torch.bfloat16) for i, n in enumerate(names)}
    base["t6"] = torch.randn(9, generator=g)  # an fp32-kept tensor
    base["t2"] = torch.randn(200_000, generator=g).to(torch.bfloat16)  # several blocks of 65536
    new = {n: t.clone() for n, t in base.items()}
    new["t0"][0, 0] = -new["t0"][0, 0]
    new["t1"] += 1
    new["t3"][2, 1] = float("inf")
    new["t6"][4] = float("nan")
    new["t2"][[0, 65535, 65536, 98304, 131071, 199999]] = -0.0
    deltas = [encode_delta(n, new[n], base[n]) for n in names]
    deltas.insert(3, TensorDelta("t5", (10, 3), torch.bfloat16, "check", values=new["t5"]))
    assert deltas[2].index.tolist() == _ref_positions(new["t2"], base["t2"])
    assert len(deltas[2].index) >= 5 and deltas[2].nbytes == 4 * 4 + len(deltas[2].index) * 4
    buckets = list(pack_deltas(deltas, 64, base="step-1", version="step-2"))
    assert len(buckets) > 2
    target = {n: t.clone() for n, t in base.items()}
    applied, checked = [], {}
    for b in buckets:
        meta = b.engine_meta()
        moved = DeltaBucket.from_meta(meta, b.flat[:b.engine_nbytes].clone())
        assert all(e["kind"] != "check" for e in moved.entries) and moved.base == "step-1"
        for d in moved.deltas():
            apply_delta(target[d.name], d)
            applied.append(d.name)
        checked.update(dict(b.full_tensors()))
        received = DeltaBucket.empty(b.meta())  # the trainer-side path (checks included)
        received.flat.copy_(b.flat)
        assert [d.name for d in received.deltas(checks=True)] == [d.name for d in b.deltas(checks=True)]
    assert sorted(applied) == names
    for n in names:
        assert _same_bits(target[n], new[n]), n
    assert set(checked) == {"t1", "t5"} and _same_bits(checked["t5"], new["t5"])
    kinds = [(d.name, d.kind) for d in deltas]
    assert kinds == [("t0", "sparse"), ("t1", "dense"), ("t2", "sparse"), ("t5", "check"), ("t3", "sparse"),
                     ("t4", "same"), ("t5", "same"), ("t6", "sparse")]
    with pytest.raises(ValueError, match="bytes"):
        DeltaBucket.from_meta(buckets[0].meta(), buckets[0].flat[:-8])


def _delta_errors(**rollout):
    from megatron_rl.config import job_config_from_dict
    from megatron_rl.plan import job_errors

    if rollout.get("engine") == "sglang":
        rollout["sglang_urls"] = ["http://127.0.0.1:9"]
    return [e for e in job_errors(job_config_from_dict({"rollout": rollout}), world_size=1) if "delta" in e]


def test_delta_knob_is_validated():
    assert _delta_errors(engine="embedded", weight_sync_delta=True) == []            # auto -> tensor
    assert _delta_errors(engine="sglang", weight_sync="tensor", weight_sync_delta=True) == []
    assert _delta_errors(engine="sglang", weight_sync="disk", weight_sync_delta=False) == []
    (e,) = _delta_errors(engine="sglang", weight_sync_delta=True)
    assert "'tensor'" in e and "'distributed' (auto)" in e
    (e,) = _delta_errors(engine="embedded", weight_sync="disk", weight_sync_delta=True)
    assert "got 'disk'" in e
    (e,) = _delta_errors(engine="embedded", mode="async", weight_sync_delta=True)
    assert "rollout.mode 'sync'" in e
    from megatron_rl.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.weight_sync_delta: expected true or false"):
        _delta_errors(engine="embedded", weight_sync_delta="yes")


def test_check_prints_the_expected_delta_bytes():
    from megatron_rl.config import job_config_from_dict
    from megatron_rl.ops.weight_sync_plan import DELTA_CHANGED_FRAC
    from megatron_rl.plan.sizing import job_sync_plan

    model = {"vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "ffn_hidden_size": 128}
    cfg = job_config_from_dict({"model": model, "rollout": {"engine": "embedded", "weight_sync_delta": True}})
    n = 10_000_000
    line = job_sync_plan(cfg, n).line()
    changed = int(n * DELTA_CHANGED_FRAC)
    want = (-(-n // 65536)) * 4 + changed * (2 + 2)  # block counts + (offset, bf16 value) per change
    assert f"delta sync: ~{want / 1e6:.2f} MB per sync" in line, line
    cfg.rollout.weight_sync_delta = False
    assert "delta" not in job_sync_plan(cfg, n).line()


def test_server_store_hands_whole_tensors_and_refuses_a_foreign_base():
    """The loader inside an SGLang server: a full version fills its copies, a delta from that version brings
    them to the new one (whole tensors handed on, bit for bit the new ones), a delta from any other version
    is refused."""
    from megatron_rl.weight_sync.server_loader import DeltaStore

    g = torch.Generator().manual_seed(3)
    v1 = {"a": torch.randn(4, 6, generator=g).to(torch.bfloat16), "b": torch.randn(5, generator=g)}
    v2 = {k: t.clone() for k, t in v1.items()}
    v2["a"][1, 2] = -0.0
    store = DeltaStore()
    (full,) = pack_deltas([encode_delta(k, t, None) for k, t in v1.items()], 1 << 20, None, "step-1")
    got = store.apply(DeltaBucket.from_meta(full.engine_meta(), full.flat.clone()))
    assert [n for n, _ in got] == ["a", "b"] and all(_same_bits(t, v1[n]) for n, t in got)
    (delta,) = pack_deltas([encode_delta(k, v2[k], v1[k]) for k in v1], 1 << 20, "step-1", "step-2")
    assert delta.engine_nbytes < full.engine_nbytes
    got = dict(store.apply(DeltaBucket.from_meta(delta.engine_meta(), delta.flat.clone())))
    assert _same_bits(got["a"], v2["a"]) and _same_bits(got["b"], v2["b"]) and store.version == "step-2"
    (stale,) = pack_deltas([encode_delta("a", v2["a"], v1["a"])], 1 << 20, "step-1", "step-3")
    with pytest.raises(ValueError, match="from 'step-1'.*holds 'step-2'.*full sync"):
        store.apply(stale)


def test_sender_copies_live_on_the_host_whatever_device_the_tensors_come_from():
    """``DeltaSender`` (trainer side of a delta sync) fed tensors on a stand-in accelerator (``fake_accelerator``:
    mixing its tensors with CPU tensors raises, as CUDA does): its copies are host tensors, exactly the tensors'
    bytes in the engine's dtype (the fp32-kept one in fp32); a delta sync from them sends exactly the changed
    positions, and the copies follow the new version bit for bit."""
    from megatron_rl.testing import fake_accelerator as fa
    from megatron_rl.weight_sync.delta_sender import DeltaSender

    fa.install()
    dev = torch.device(fa.DEVICE)
    g = torch.Generator().manual_seed(5)
    v1 = {"a": torch.randn(40, 30, generator=g), "b": torch.randn(70, generator=g), "bias": torch.randn(9, generator=g)}
    v2 = {k: t.clone() for k, t in v1.items()}
    v2["a"][3, 4] += 1.0
    v2["bias"][2] = -v2["bias"][2]

    def sync(sender, version, tensors, base):
        pairs = [(k, t.to(dev)) for k, t in tensors.items()]  # "the gathered tensors, on the GPU"
        buckets = list(sender.pack(pairs, 1 << 20, torch.bfloat16, {"bias"}, base, version, set()))
        sender.committed(version)
        return [d for b in buckets for d in b.deltas()]

    sender = DeltaSender()
    sync(sender, "step-1", v1, None)
    assert {k: t.device.type for k, t in sender.base.items()} == {"a": "cpu", "b": "cpu", "bias": "cpu"}
    want = {"a": v1["a"].to(torch.bfloat16), "b": v1["b"].to(torch.bfloat16), "bias": v1["bias"]}
    assert all(_same_bits(sender.base[k], want[k]) for k in want)
    held = sum(t.numel() * t.element_size() for t in sender.base.values())
    assert held == 40 * 30 * 2 + 70 * 2 + 9 * 4  # one copy, engine dtype (the kept tensor fp32)
    deltas = {d.name: d for d in sync(sender, "step-2", v2, "step-1")}
    assert [deltas[k].kind for k in ("a", "b", "bias")] == ["sparse", "same", "sparse"]
    assert deltas["a"].index.tolist() == [3 * 30 + 4] and deltas["bias"].index.tolist() == [2]
    assert all(t.device.type == "cpu" for t in sender.base.values())
    assert _same_bits(sender.base["a"], v2["a"].to(torch.bfloat16)) and _same_bits(sender.base["bias"], v2["bias"])


def test_check_counts_the_server_store_per_tp_process():
    """With SGLang every server TP process keeps the whole model (engine dtype) in its host memory: ``check``
    says so per TP process and per server (x TP), not one model; the trainer's copies are host memory per sender."""
    from megatron_rl.config import job_config_from_dict
    from megatron_rl.plan.sizing import job_sync_plan

    model = {"vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "ffn_hidden_size": 128}
    rollout = {"engine": "sglang", "weight_sync": "tensor", "weight_sync_delta": True,
               "sglang_urls": ["http://127.0.0.1:9"]}
    cfg = job_config_from_dict({"model": model, "rollout": rollout})
    n = 1_000_000_000
    plan = job_sync_plan(cfg, n)
    model_bytes = n * 2  # bf16 engine
    assert plan.engine_store_bytes == model_bytes
    line = plan.line()
    assert f"{model_bytes / 2**30:.2f} GiB per TP process" in line, line
    assert f"{8 * model_bytes / 2**30:.2f} GiB at TP 8" in line, line
    assert "none on the GPU" in line
    cfg.rollout.sglang_urls, cfg.rollout.sglang_launch = [], True
    line = job_sync_plan(cfg, n).line()
    assert f"the launched server (TP 1): {model_bytes / 2**30:.2f} GiB" in line, line
    cfg.rollout.engine = "embedded"  # deltas applied to the engine's own weights: no store
    assert job_sync_plan(cfg, n).engine_store_bytes == 0 and "TP process" not in job_sync_plan(cfg, n).line()
