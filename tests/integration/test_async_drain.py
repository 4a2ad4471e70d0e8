"""The async checkpoint drain (issue 20 item 6) is on the shared-error path: a producer failure while a
checkpoint drains its rollouts is named on EVERY rank within the drain's bound (half of
``trainer.checkpoint_timeout_s``), and the already-trained step is still checkpointed -- without the drained
rollouts, which ``--resume`` regenerates from its weights.

Real RL loop on 2 forked gloo ranks (embedded bf16 engine, copy task, ``rollout.mode: async``, max_staleness 1,
a checkpoint after step 2). The fault -- the engine raising, or hanging, while the producer generates step 3's
rollouts (the ones the step-2 checkpoint must hold) -- is injected into rank 0's engine.

Run: OMP_NUM_THREADS=1 pytest tests/integration/test_async_drain.py   (~1 min on 2 cores)
"""
import glob
import os
import threading
import time

import pytest
import torch

from megatron_rl.tasks.char_tokenizer import build_task_model
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_task_model(str(tmp_path_factory.mktemp("m") / "m"), task="copy", seed=0, hidden_size=32,
                            num_layers=1)


def _train(rank, world, cfg, fault):
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.trainer.loop import train

    if rank == 0:
        real = EmbeddedEngine.generate

        def generate(self, prompt_ids, sampling, n=1, seed=None):
            if seed == cfg.trainer.seed * 7919 + 2:    # step 3's rollouts: the step-2 checkpoint drains them
                if fault == "hang":
                    threading.Event().wait()
                raise RuntimeError("engine process died (injected)")
            return real(self, prompt_ids, sampling, n=n, seed=seed)

        EmbeddedEngine.generate = generate
    t0 = time.time()
    try:
        train(cfg)
    except Exception as exc:  # noqa: BLE001 - the test checks every rank's error
        return f"{type(exc).__name__}: {exc}", time.time() - t0
    return None, time.time() - t0


def _extra(run_dir, step):
    found = glob.glob(os.path.join(run_dir, "checkpoints", f"step_{step}", "**", "extra_state.pt"), recursive=True)
    assert len(found) == 1, found
    return torch.load(found[0], weights_only=False)


def _check(run_dir, results, cause):
    for rank, (err, _) in enumerate(results):
        assert err is not None and err.startswith("AsyncDrainError: rank 0: draining the async rollouts for the "
                                                  "checkpoint of step 2 failed"), (rank, err)
        assert cause in err, (rank, err)
    ckpt = os.path.join(run_dir, "checkpoints", "step_2")
    assert os.path.isfile(os.path.join(ckpt, "COMPLETE"))                   # the trained step is kept
    assert not os.path.exists(os.path.join(run_dir, "checkpoints", "step_3"))
    assert "async_rollouts" not in _extra(run_dir, 2)                       # without the drained rollouts


def test_producer_error_in_the_drain_is_named_on_every_rank_and_the_step_is_checkpointed(model_dir, tmp_path):
    run = str(tmp_path / "run")
    cfg = named_job("async_drain", hf=model_dir, run_dir=run, world_size=2)
    results = run_ranks(_train, 2, cfg, "raise", timeout=300)
    _check(run, results, "RuntimeError: engine process died (injected)")


def test_producer_hang_in_the_drain_ends_within_its_bound(model_dir, tmp_path):
    run = str(tmp_path / "run")
    cfg = named_job("async_drain", "trainer.checkpoint_timeout_s=20", hf=model_dir, run_dir=run, world_size=2)
    results = run_ranks(_train, 2, cfg, "hang", timeout=300)
    _check(run, results, "did not hand them over within 10 s (half of trainer.checkpoint_timeout_s)")


def test_last_checkpoint_does_not_wait_for_rollouts_no_step_trains_on(model_dir, tmp_path):
    """The run's last checkpoint (after trainer.steps = 2) would drain step 3's rollouts, which no step of this run
    trains on: their generation hangs, yet the run checkpoints step 2 and ends without an error, well within the
    drain's bound (20 s here)."""
    run = str(tmp_path / "run")
    cfg = named_job("async_drain", "trainer.steps=2", "trainer.checkpoint_timeout_s=40", hf=model_dir, run_dir=run,
                    world_size=2)
    results = run_ranks(_train, 2, cfg, "hang", timeout=300)
    assert [err for err, _ in results] == [None, None]
    assert all(seconds < 60 for _, seconds in results), results
    assert os.path.isfile(os.path.join(run, "checkpoints", "step_2", "COMPLETE"))
    assert _extra(run, 2)["async_rollouts"] == {}     # step 3's rollouts were never made: none kept
