"""``tools/bench_actor.py`` on CPU (its tiny shape, one gloo rank): fp32 and bf16 side by side in one run.

Checked: both precisions ran their log-prob pass and train step (positive times and tokens/s, finite log-probs
and gradient norm), with the parameter dtype each claims; the FLOP model's weight count equals the weights of the
model the actor built (every 2-D parameter but the input embedding), so its MFU on CUDA counts the right matmuls.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_bench_actor.py -q``
"""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(400)
def test_bench_actor_cpu_runs_both_precisions(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "tools/bench_actor.py", "--device", "cpu", "--repeats", "1", "--json",
                        str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=380)
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
