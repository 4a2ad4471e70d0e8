"""The attention a job gets is decided before any process group (``models.attention``), and the jobs that
attention cannot run are refused by name -- by ``megatron-rl check`` and by the launcher's pre-start validation
(``python -m megatron_rl.train --check-world-size N``, what ``launch/torchrun.sh`` runs first) -- in seconds.

Refusals: packing or context parallelism with fp32 on Transformer Engine (its flash / fused attention takes bf16
/ fp16 only; the unfused backend refuses THD and CP): named ``actor.bf16``; context parallelism without TE
(megatron's local attention asserts CP == 1). ``model.extra`` keys: unknown ones and the ones a project key sets
(``model.extra.bf16`` -> ``actor.bf16``) are refused by name.

    pytest tests/integration/test_attention_backend.py
"""
import os
import subprocess
import sys
import time

import pytest

from megatron_rl.plan import collect_job_config
from megatron_rl.models.attention import BACKENDS, attention_backend, attention_errors, expected_te
from megatron_rl.testing.cli import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
Q7 = os.path.join(ROOT, "configs", "qwen2.5_7b_1x8.yaml")
TINY = os.path.join(ROOT, "configs", "tiny_cpu.yaml")
#: a launcher refusal must come before any process group: seconds (the interpreter and config load included)
LAUNCH_SECONDS = 90


@pytest.mark.parametrize("device,te,bf16,name", [
    ("cuda", True, True, "te-fused"), ("cuda", True, False, "te-unfused"), ("cuda", False, True, "local"),
    ("cuda", False, False, "local"), ("cpu", True, True, "local"), ("cpu", False, False, "local")])
def test_backend_from_device_te_and_precision(device, te, bf16, name):
    assert attention_backend(device, te, bf16) is BACKENDS[name]


def test_what_each_backend_keeps():
    assert not BACKENDS["te-fused"].keeps_scores(packed=False)
    assert BACKENDS["te-unfused"].keeps_scores(packed=False)
    assert BACKENDS["local"].keeps_scores(packed=False) and not BACKENDS["local"].keeps_scores(packed=True)


def test_te_expectation():
    assert expected_te("cpu") == (False, "CPU: Transformer Engine needs CUDA")
    assert expected_te("cuda", has_te=False)[0] is False
    import torch

    if not torch.cuda.is_available():
        assert expected_te("cuda")[0] is True and "assumed" in expected_te("cuda")[1]


def _problems(overrides, has_te=None):
    """(config, its problems) of the Qwen2.5-7B file at its 8 GPUs, Transformer Engine as given."""
    return collect_job_config(Q7, list(overrides), world_size=8, has_te=has_te)


@pytest.mark.parametrize("overrides,has_te,key,fix", [
    (["actor.bf16=false", "actor.sequence_packing=true"], True, "actor.sequence_packing", "set actor.bf16: true"),
    (["actor.bf16=false", "parallel.context_parallel_size=2"], True, "parallel.context_parallel_size",
     "set actor.bf16: true"),
    (["parallel.context_parallel_size=2"], False, "parallel.context_parallel_size", "Transformer Engine"),
])
def test_impossible_combinations_are_named(overrides, has_te, key, fix):
    _, problems = _problems(overrides, has_te)
    errs = [e for e in problems if e.startswith(key + ":")]
    assert len(errs) == 1 and fix in errs[0], problems
    # the same job with bf16 on TE runs flash / fused attention: nothing to refuse
    ok, _ = _problems([o for o in overrides if not o.startswith("actor.bf16")] + ["actor.bf16=true"], True)
    assert not attention_errors(attention_backend("cuda", True, True), bool(ok.actor.sequence_packing),
                                ok.parallel.context_parallel_size)


def test_packing_without_te_is_accepted():
    _, problems = _problems(["actor.sequence_packing=true", "actor.max_tokens_per_micro_batch=16384"], False)
    assert not problems, problems


def test_model_extra_keys_refused_by_name():
    _, errs = _problems(["model.extra.bf16=true", "model.extra.recompute_granularit=full",
                         "model.extra.recompute_granularity=full"])
    assert "model.extra.bf16: set from actor.bf16; use that key instead" in errs
    assert ("model.extra.recompute_granularit: not a megatron-core TransformerConfig field (did you mean "
            "'recompute_granularity'?)") in errs
    assert "model.extra.recompute_granularity: set from actor.recompute_granularity; use that key instead" in errs


# ----------------------------------------------------------------------------- the CLI and the launcher
def _run(*cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=env, cwd=ROOT, timeout=180)
    return r, time.monotonic() - t0


@pytest.mark.parametrize("overrides,flag,expected", [
    (["actor.bf16=false", "actor.sequence_packing=true", "actor.max_tokens_per_micro_batch=16384"],
     "--transformer-engine", "actor.sequence_packing: Transformer Engine's flash / fused attention takes bf16 / "
                             "fp16 only, and its unfused backend refuses packed (THD) sequences: set actor.bf16: "
                             "true"),
    (["parallel.context_parallel_size=2", "parallel.tensor_model_parallel_size=2"], "--no-transformer-engine",
     "parallel.context_parallel_size: 2 needs Transformer Engine attention"),
])
def test_check_names_the_refusal(overrides, flag, expected):
    r = run_cli("check", Q7, flag, *overrides, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 2 and expected in r.stderr, r.stderr


@pytest.mark.parametrize("config,overrides,expected", [
    (TINY, ["parallel.context_parallel_size=2", "parallel.pipeline_model_parallel_size=1"],
     "parallel.context_parallel_size: 2 needs Transformer Engine attention"),
    (Q7, ["actor.bf16=false", "actor.sequence_packing=true", "actor.max_tokens_per_micro_batch=16384"],
     "set actor.bf16: true"),
    (Q7, ["model.extra.bf16=true"], "model.extra.bf16: set from actor.bf16"),
])
def test_launcher_refuses_in_seconds(config, overrides, expected, tmp_path):
    """The launcher's first step; the CUDA config is validated here (no CUDA) with Transformer Engine assumed,
    as on a GPU cluster."""
    r, took = _run("-m", "megatron_rl.train", "--config", config, "--check-world-size", "8" if config == Q7 else "4",
                   f"trainer.run_dir={tmp_path / 'run'}", *overrides)
    assert r.returncode == 2 and expected in r.stderr, r.stderr
    assert took < LAUNCH_SECONDS
