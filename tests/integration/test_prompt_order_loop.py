"""The prompt order of a data file in the real RL loop (megatron actor on one gloo rank, embedded engine, a JSONL
file of copy prompts, exact-match reward): the trained prompts, read back from the dumped rollouts, go through the
file without replacement, epoch by epoch, in the numpy permutation of (trainer.seed, epoch) (docs/datasets.md), and
a run stopped at a checkpoint and resumed trains exactly the prompts (and responses) of the uninterrupted run --
sync, and async one step off where the checkpoint was taken while the producer drew ahead (its step-3 checkpoint
lost: ``--resume`` continues from step 2's, which holds step 3's rollouts and the order's position after them).
An async resume from a checkpoint without a prompt order (max_staleness 2, a checkpoint every step) trains the
two steps of rollouts it holds, then starts the order over at epoch 0, and its own checkpoints of those held steps
are written (they raised before).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_prompt_order_loop.py -q``
"""
import json
import os

import numpy as np
import pytest

from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import named_job

pytestmark = [pytest.mark.mcore, pytest.mark.timeout(400)]

N, SAMPLES, STEPS = 7, 4, 4      # 4 prompts a step (copy_loop): 16 draws over 7 prompts, epochs straddled


def _train(rank, world, cfg):
    from megatron_rl.trainer.loop import train

    train(cfg)
    return None


def _cfg(tmp_path, model, run, *extra):
    path = tmp_path / "prompts.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"prompt": f"copy:{i}=", "answer": str(i)}) + "\n" for i in range(N)))
    return named_job("copy_loop", "data.task=file", f"data.path={path}", "data.task_kwargs={}", "data.reward_fn=exact",
                     "data.reward_workers=0", f"trainer.steps={STEPS}", *extra, hf=model,
                     run_dir=tmp_path / run, world_size=1)


def _steps(cfg, steps=STEPS):
    """Per step, the prompt index of each group and the rows' (prompt, response) ids, from rollouts.jsonl."""
    from megatron_rl.trainer.job import build_task

    task, _ = build_task(cfg)
    index_of = {tuple(p.prompt_ids): int(p.answer) for p in task.prompts}
    task.close()
    with open(os.path.join(cfg.trainer.run_dir, "rollouts.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    out = []
    for step in range(1, steps + 1):
        mine = [r for r in rows if r["step"] == step]
        out.append(([index_of[tuple(r["prompt_ids"])] for r in mine[::SAMPLES]],
                    [(r["prompt_ids"], r["response_ids"]) for r in mine]))
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_file_prompts_epoch_by_epoch_and_resumed_exactly(copy_model, tmp_path, mode):
    extra = ("trainer.save_interval=2",) if mode == "sync" else (
        "rollout.mode=async", "rollout.max_staleness=1", "trainer.save_interval=2")
    full = _cfg(tmp_path, copy_model, "full", *extra)
    assert run_ranks(_train, 1, full, timeout=300) == [None]
    straight = _steps(full)
    flat = [i for prompts, _ in straight for i in prompts]
    assert flat[:N] == [int(i) for i in np.random.default_rng([full.trainer.seed % 2 ** 64, 0]).permutation(N)]
    for e in range(len(flat) // N):
        assert sorted(flat[e * N:(e + 1) * N]) == list(range(N)), e      # every prompt once per epoch
    for prompts, _ in straight:
        assert len(set(prompts)) == len(prompts)                          # never twice in a step

    # sync: stopped after step 2; async: the producer drew step 4 ahead and the step-3 checkpoint is lost, so the
    # resume continues from step 2's (which holds step 3's rollouts)
    stopped = _cfg(tmp_path, copy_model, "part", *extra, f"trainer.steps={2 if mode == 'sync' else 3}")
    assert run_ranks(_train, 1, stopped, timeout=300) == [None]
    if mode == "async":
        os.remove(os.path.join(tmp_path, "part", "checkpoints", "step_3", "COMPLETE"))
    part = _cfg(tmp_path, copy_model, "part", *extra, "trainer.resume=true")
    assert run_ranks(_train, 1, part, timeout=300) == [None]
    assert _steps(part) == straight


def test_async_resume_without_a_prompt_order_starts_it_over_after_the_held_steps(copy_model, tmp_path, capfd):
    import glob

    import torch

    extra = ("rollout.mode=async", "rollout.max_staleness=2", "trainer.save_interval=1")
    first = _cfg(tmp_path, copy_model, "run", *extra)
    assert run_ranks(_train, 1, first, timeout=300) == [None]
    before = _steps(first)
    for step in (3, 4):                                     # resume from step 2's checkpoint
        os.remove(os.path.join(tmp_path, "run", "checkpoints", f"step_{step}", "COMPLETE"))
    (path,) = glob.glob(os.path.join(tmp_path, "run", "checkpoints", "step_2", "**", "extra_state.pt"),
                        recursive=True)
    state = torch.load(path, weights_only=False)
    assert sorted(state["async_rollouts"]) == [2, 3]        # it holds the rollouts of steps 3 and 4
    del state["prompt_order"]                               # as a checkpoint written before the order was saved
    torch.save(state, path)
    resumed = _cfg(tmp_path, copy_model, "run", *extra, "trainer.resume=true", "trainer.steps=5")
    assert run_ranks(_train, 1, resumed, timeout=300) == [None]
    assert "the prompt order starts over at epoch 0" in capfd.readouterr().out
    after = _steps(resumed, 5)
    assert after[:4] == before                              # steps 3, 4: the held rollouts
    assert after[4][0] == [int(i) for i in np.random.default_rng([resumed.trainer.seed % 2 ** 64, 0])
                           .permutation(N)][:4]             # step 5: the fresh order's first prompts
    for step in (3, 4, 5):                                  # the held steps' checkpoints too
        assert os.path.isfile(os.path.join(tmp_path, "run", "checkpoints", f"step_{step}", "COMPLETE")), step
