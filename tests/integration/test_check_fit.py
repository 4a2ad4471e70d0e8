"""``megatron-rl check``'s fit verdict for every CUDA job: against ``cluster.gpu_memory_gb``, else 80 GiB (a printed
default); "config OK" only when the plan fits; ``--strict`` exits 3 when it does not.

The job that must not fit is Qwen2.5-7B at TP 1 without the distributed optimizer: its weights (bf16), fp32
gradients and Adam state alone, counted here from the published shapes, exceed 80 GiB per GPU before any
activation.

    pytest tests/integration/test_check_fit.py
"""
import os

from megatron_rl.testing.cli import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
Q7 = os.path.join(ROOT, "configs", "qwen2.5_7b_1x8.yaml")
NO_LIMIT = "cluster.gpu_memory_gb=null"
TP1 = ("parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false",
       "actor.use_distributed_optimizer=false")
DEFAULT_LINE = "fit: checked against 80 GiB per GPU, the default: cluster.gpu_memory_gb is not set"


def qwen7b_static_bytes_tp1():
    """bf16 weights + fp32 gradients + fp32 main + 2 fp32 moments of Qwen2.5-7B on one TP-1 rank."""
    h, f, V, heads, kv, d = 3584, 18944, 152064, 28, 4, 128
    layer = h * (heads + 2 * kv) * d + (heads + 2 * kv) * d + heads * d * h + 3 * h * f + 2 * h
    n = 28 * layer + 2 * V * h + h
    return n * (2 + 4 + 12)


def test_a_job_that_does_not_fit_never_prints_config_ok():
    assert qwen7b_static_bytes_tp1() > 80 * 2**30   # the premise, by hand
    r = run_cli("check", Q7, NO_LIMIT, *TP1)
    assert r.returncode == 0, r.stderr                  # not an error without --strict ...
    assert DEFAULT_LINE in r.stdout                     # ... but the default is said
    assert "config OK" not in r.stdout
    assert "config valid but does NOT FIT" in r.stdout and "> 80 GiB (the default)" in r.stdout
    strict = run_cli("check", Q7, NO_LIMIT, *TP1, "--strict")
    assert strict.returncode == 3 and "config OK" not in strict.stdout


def test_the_config_limit_wins_over_the_default():
    r = run_cli("check", Q7, "cluster.gpu_memory_gb=1000", *TP1, "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "config OK" in r.stdout and "fits:" in r.stdout and DEFAULT_LINE not in r.stdout


def test_a_job_that_fits_the_default_says_so():
    r = run_cli("check", Q7, NO_LIMIT, "--strict")
    assert r.returncode == 0, r.stderr
    assert DEFAULT_LINE in r.stdout and "config OK" in r.stdout and "fits:" in r.stdout
