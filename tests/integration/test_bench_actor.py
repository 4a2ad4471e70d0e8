"""``tools/bench_actor.py`` on CPU (its tiny shape, one gloo rank): fp32 and bf16 side by side in one run.

Checked: both precisions ran their log-prob pass and train step (positive times and tokens/s, finite log-probs
and gradient norm), with the parameter dtype each claims; the FLOP model's weight count equals the weights of the
model the actor built (every 2-D parameter but the input embedding), so its MFU on CUDA counts the right matmuls.
The check reads the first train step: at a learning rate that clips every token's ratio within the 4 steps on the
same batch (lr 1e-2 here, a 16-layer model at 1e-5 on CUDA), the first step still has ratio 1 (clip fraction 0,
pg_loss = -token-mean of the advantages, PPO's value at ratio 1) and a non-zero grad norm, and a later step whose
clip fraction is 1 has a gradient norm of exactly 0.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_bench_actor.py -q``
"""
import json
import math
import os
import subprocess
import sys

import importlib.util

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(400)
def test_bench_actor_cpu_runs_both_precisions(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "tools/bench_actor.py", "--device", "cpu", "--repeats", "3", "--lr", "1e-2",
                        "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=380)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["tokens"] == res["shape"]["rows"] * res["shape"]["seq"]
    assert set(res["precisions"]) == {"fp32", "bf16"}
    for name, dtype in (("fp32", "torch.float32"), ("bf16", "torch.bfloat16")):
        p = res["precisions"][name]
        assert p["check"]["param_dtype"] == dtype
        assert math.isfinite(p["check"]["mean_log_prob"]) and math.isfinite(p["check"]["grad_norm"])
        assert p["check"]["matmul_params"] == res["matmul_params"]
        for pass_ in ("logprob", "train"):
            assert p[pass_]["seconds"] > 0 and p[pass_]["tokens_per_s"] > 0 and p[pass_]["peak_gib"] > 0
            assert "mfu_vs_bf16_matmul" not in p[pass_]  # MFU on CUDA only
    assert "bf16 / fp32:" in r.stdout
    spec = importlib.util.spec_from_file_location("bench_actor", os.path.join(ROOT, "tools", "bench_actor.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    batch, adv = bench._batch(res["shape"])
    mask = batch.response_mask.to(torch.float64)
    at_ratio_one = float(-(adv.to(torch.float64)[:, None] * mask).sum() / mask.sum())  # PPO-clip loss at ratio 1
    for name, tol in (("fp32", 1e-5), ("bf16", 2e-2)):
        c = res["precisions"][name]["check"]
        assert c["pg_clipfrac"] == 0 and c["grad_norm"] > 0 and c["update_successful"] == 1, (name, c)
        assert abs(c["pg_loss"] - at_ratio_one) <= tol * max(1.0, abs(at_ratio_one)), (name, c, at_ratio_one)
        assert len(c["later_grad_norms"]) == 3
    fp32 = res["precisions"]["fp32"]["check"]
    assert fp32["later_pg_clipfracs"][-1] == 1.0, fp32  # lr 1e-2 moved every ratio past the clip by the 4th step
    assert fp32["later_grad_norms"][-1] == 0.0, fp32    # ... where PPO-clip's gradient is exactly 0
