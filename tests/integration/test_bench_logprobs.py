"""``tools/bench_logprobs.py --device cpu`` (Triton under the interpreter) runs end to end and reports
float64 errors within the kernels' tolerances, the floor ratios consistent with the measured copy
bandwidth, and every path of every shape.
Run: OMP_NUM_THREADS=1 pytest tests/integration/test_bench_logprobs.py -q
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(300)
def test_bench_device_table_on_cpu(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "bench.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_logprobs.py"), "--device", "cpu",
                           "--reps", "1", "--sweep", "--json", str(out)], capture_output=True, text=True, env=env,
                          timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| shape | path | fwd ms | fwd / floor | train fwd ms |" in proc.stdout
    res = json.loads(out.read_text())
    assert res["copy_GBs"] > 0
    table = res["table"]
    assert sorted((r["shape"], r["path"]) for r in table) == sorted(
        (s, p) for s in ("12x2000", "16x517") for p in ("naive", "triton", "torch"))
    for r in table:
        assert "error" not in r, r
        n, v = (int(a) for a in r["shape"].split("x"))
        floor_ms = 2 * n * v / (res["copy_GBs"] * 1e9) * 1e3
        assert r["fwd_x_floor"] == pytest.approx(r["fwd_ms"] / floor_ms, rel=1e-6)
        assert r["fwdtrain_x_floor"] == pytest.approx(r["fwdtrain_ms"] / floor_ms, rel=1e-6)
        assert r["fwdbwd_x_floor"] == pytest.approx(r["fwdbwd_ms"] / (2 * floor_ms), rel=1e-6)
        assert r["err_logp"] <= 1e-5 and r["err_ent"] <= 1e-5, r
        assert r["grad_rel"] <= 2 ** -7, r  # bf16 gradient: rounded once (relative 2**-9 per element)
    assert {(r["dtype"], r["backend"]) for r in res["fp64"]} == {
        (d, b) for d in ("bfloat16", "float32") for b in ("triton", "torch")}
    for r in res["fp64"]:
        assert r["err_logp"] <= 1e-5 and r["err_ent"] <= 1e-5, r
        assert r["grad_rel"] <= (2 ** -7 if r["dtype"] == "bfloat16" else 1e-6), r
        assert r["grad_dtype"] == r["dtype"], r


def test_median_time_is_per_call_over_back_to_back_batches():
    """Each sample times ``batch`` calls without a synchronisation in between and reports time per call."""
    import time
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import bench_logprobs
    finally:
        sys.path.pop(0)
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.02)
    t = bench_logprobs._median_time(torch, torch.device("cpu"), fn, reps=3, batch=4)
    assert len(calls) == 2 + 3 * 4  # two warm-up calls, then 3 samples of 4
    assert 0.018 <= t <= 0.05, t  # one call's time, not a batch's (0.08 s)
