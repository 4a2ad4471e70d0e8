"""``rollout.mode: async`` in the real RL loop (megatron actor on 2 gloo ranks, embedded bf16 engine, copy task):

* async with max_staleness 0 reproduces the sync run exactly (every metric but wall-clock timings);
* async with max_staleness 1 generates step t from the weights after t - 1 steps (the dumped rollouts carry
  that version), the lag metrics are non-zero exactly on the steps that have lagged tokens, and lag-0 mismatch
  equals the correction's own k3 KL where every token is current;
* a checkpoint + ``--resume`` in async mode reproduces the uninterrupted run (in-flight rollouts are dropped
  at the checkpoint and regenerated deterministically);
* the engine failing, or refusing published weights, inside the producer thread ends the step with the
  cause on every rank.
"""
import json
import math
import os

import pytest

from megatron_rl.tasks.char_tokenizer import build_task_model
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job

pytestmark = pytest.mark.timeout(400)
# wall-clock readings differ between any two runs; weight_sync/* describe the transport, which differs by design
# (sync streams and verifies buckets, async hands owned copies to the producer)
TIMING = ("timing/", "perf/", "time", "weight_sync/")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_task_model(str(tmp_path_factory.mktemp("m") / "m"), task="copy", seed=0, hidden_size=64,
                            num_layers=2)


def _train(rank, world, cfg, fault=None):
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.trainer.loop import train

    if fault == "generate" and rank == 0:
        real = EmbeddedEngine.generate

        def generate(self, prompt_ids, sampling, n=1, seed=None):
            if seed == cfg.trainer.seed * 7919 + 2:    # step 3's call
                raise RuntimeError("engine process died (test)")
            return real(self, prompt_ids, sampling, n=n, seed=seed)

        EmbeddedEngine.generate = generate
    if fault == "weights" and rank == 0:
        real_begin = EmbeddedEngine.begin_weight_sync

        def begin(self, version, *a, **k):
            if version == "step-1":   # needed by step 3 (k = 1)
                raise RuntimeError("engine refused weights step-1 (test)")
            return real_begin(self, version, *a, **k)

        EmbeddedEngine.begin_weight_sync = begin
    try:
        train(cfg)
    except Exception as exc:  # noqa: BLE001 - the test checks every rank's error
        return f"{type(exc).__name__}: {exc}"
    return None


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def _rollouts(run_dir):
    with open(os.path.join(run_dir, "rollouts.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def _same(a, b, keys_from):
    keys = [k for k in keys_from if not k.startswith(TIMING)]
    diff = {k: (a.get(k), b.get(k)) for k in keys if not (a.get(k) == b.get(k) or
                                                         (isinstance(a.get(k), float) and math.isnan(a[k])
                                                          and math.isnan(b.get(k, 0.0))))}
    return diff


def test_async_k0_reproduces_sync_exactly(model_dir, tmp_path):
    sync, asy = str(tmp_path / "sync"), str(tmp_path / "async")
    assert run_ranks(_train, 2, named_job("async_copy", hf=model_dir, run_dir=sync, world_size=2),
                     timeout=300) == [None, None]
    cfg = named_job("async_copy", "rollout.mode=async", "rollout.max_staleness=0", hf=model_dir, run_dir=asy,
                    world_size=2)
    assert run_ranks(_train, 2, cfg, timeout=300) == [None, None]
    ms, ma = _metrics(sync), _metrics(asy)
    assert len(ms) == len(ma) == 4
    assert any(m["actor/grad_norm"] > 0 for m in ms[:-1])   # the weights really moved between the steps
    for a, b in zip(ms, ma):
        assert _same(a, b, set(a) | set(b)) == {}
    ra = _rollouts(asy)
    for rec in ra:   # async records also carry per-token versions: k = 0 means every token is current
        assert rec.pop("token_versions") == [rec["step"] - 1] * len(rec["response_ids"])
    assert _rollouts(sync) == ra


def test_async_k1_versions_and_lag_metrics(model_dir, tmp_path):
    run = str(tmp_path / "run")
    cfg = named_job("async_copy", "rollout.mode=async", "rollout.max_staleness=1", hf=model_dir, run_dir=run,
                    world_size=2)
    assert run_ranks(_train, 2, cfg, timeout=300) == [None, None]
    ms = _metrics(run)
    for m in ms:
        lagged = m["step"] >= 2                              # step t (1-based) uses version t - 2 for t >= 2
        assert m["rollout_corr/lagged_token_fraction"] == (1.0 if lagged else 0.0)
        assert m["rollout/staleness_mean"] == m["rollout/staleness_max"] == (1.0 if lagged else 0.0)
        assert ("rollout_corr/lag1_k3_kl" in m) == lagged
        assert ("rollout_corr/lag0_k3_kl" in m) == (not lagged)
        # all of a step's tokens share one lag: that bucket is the whole batch, and it must agree with the
        # correction's own k3 KL / k1 KL (two implementations of the same formula)
        bucket = "lag1" if lagged else "lag0"
        assert m[f"rollout_corr/{bucket}_k3_kl"] == pytest.approx(m["rollout_corr/k3_kl"], rel=1e-5, abs=1e-9)
        assert m[f"rollout_corr/{bucket}_kl"] == pytest.approx(m["rollout_corr/kl"], rel=1e-5, abs=1e-9)
    for rec in _rollouts(run):
        assert rec["weight_version"] == f"step-{max(rec['step'] - 2, 0)}"


def _interrupted_after_step_2(model_dir, run_dir, *extra):
    """A run of 3 steps whose step-3 checkpoint never completed (as if killed while writing it): ``--resume``
    continues from step 2's, which holds step 3's rollouts (made from the weights after step 1)."""
    cfg = named_job("async_copy", *extra, "trainer.steps=3", hf=model_dir, run_dir=run_dir, world_size=2)
    assert run_ranks(_train, 2, cfg, timeout=300) == [None, None]
    os.remove(os.path.join(run_dir, "checkpoints", "step_3", "COMPLETE"))


def test_async_resume_reproduces_the_uninterrupted_run(model_dir, tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    extra = ("rollout.mode=async", "rollout.max_staleness=1", "trainer.save_interval=2")
    cfg = named_job("async_copy", *extra, hf=model_dir, run_dir=full, world_size=2)
    assert run_ranks(_train, 2, cfg, timeout=300) == [None, None]
    _interrupted_after_step_2(model_dir, part, *extra)
    cfg = named_job("async_copy", *extra, "trainer.resume=true", hf=model_dir, run_dir=part, world_size=2)
    assert run_ranks(_train, 2, cfg, timeout=300) == [None, None]
    mf, mp = _metrics(full), _metrics(part)
    assert [m["step"] for m in mp] == [1, 2, 3, 4]
    for a, b in zip(mf, mp):
        assert _same(a, b, set(a) | set(b)) == {}, a["step"]


def test_async_resume_with_other_prompt_groups_regenerates_the_drained_rollouts(model_dir, tmp_path):
    """Step 3's rollouts in step 2's checkpoint were made with 2 samples per prompt; a resume with 4 groups rows
    by 4 (row // n): it must train on 16 rows, each group of 4 one prompt, not on the 8 saved rows regrouped."""
    part = str(tmp_path / "part")
    extra = ("rollout.mode=async", "rollout.max_staleness=1", "trainer.save_interval=2")
    _interrupted_after_step_2(model_dir, part, *extra, "rollout.n_samples_per_prompt=2")
    cfg = named_job("async_copy", *extra, "trainer.resume=true", hf=model_dir, run_dir=part, world_size=2)
    assert run_ranks(_train, 2, cfg, timeout=300) == [None, None]
    rows = [r for r in _rollouts(part) if r["step"] == 3]
    assert len(rows) == 16
    for g in range(4):
        assert len({tuple(r["prompt_ids"]) for r in rows[4 * g: 4 * g + 4]}) == 1, g
    assert [m["step"] for m in _metrics(part)] == [1, 2, 3, 4]


@pytest.mark.parametrize("fault, message", [("generate", "engine process died (test)"),
                                            ("weights", "engine refused weights step-1 (test)")])
def test_producer_failures_end_the_step_on_every_rank(model_dir, tmp_path, fault, message):
    run = str(tmp_path / "run")
    cfg = named_job("async_copy", "rollout.mode=async", "rollout.max_staleness=1", hf=model_dir, run_dir=run,
                    world_size=2)
    errors = run_ranks(_train, 2, cfg, fault=fault, timeout=300)
    for rank, err in enumerate(errors):
        assert err is not None and message in err and "async rollouts of step 3 failed" in err, (rank, err)
    assert [m["step"] for m in _metrics(run)] == [1, 2]      # nothing of step 3 was applied


def test_bad_async_settings_are_rejected_with_the_key(model_dir, tmp_path):
    from megatron_rl.config import ConfigError

    where = dict(hf=model_dir, run_dir=str(tmp_path), world_size=2)
    with pytest.raises(ConfigError, match="rollout.segment_tokens"):
        named_job("async_copy", "rollout.mode=async", "rollout.partial_rollout=interrupt", **where)
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        named_job("async_copy", "rollout.mode=async", "rollout.max_staleness=-1", **where)
    with pytest.raises(ConfigError, match="rollout.mode"):
        named_job("async_copy", "rollout.mode=overlap", **where)

