"""Validation during training in the real RL loop: megatron actor on 2 gloo ranks (DP2), the embedded engine in
fp32, the copy task with a held-out split (``data.val_heldout``) and a validation file (``data.val_files``).

* ``val/*`` is logged at step 0 (``trainer.val_before_train``), every ``trainer.test_freq`` steps and after the last
  -- and only then.
* Each logged value equals an offline evaluation of the same weights: the checkpoint of that step exported to HF
  (``megatron-rl convert mcore-to-hf``'s export; step 0: the initial model), greedy decoding by HF transformers (argmax per token, up to
  EOS or max_new_tokens), scored with the job's reward function (``data.reward_fn``, one that varies between
  samples, so three steps change what greedy decoding gives).
* No validation prompt is trained on: every trained row (dumped rollouts) is a training draw, the count is
  steps x prompts_per_step x n_samples, and none of their prompts is a validation prompt.
"""
import json
import os

import pytest
import torch

from megatron_rl.plan import load_job_config
from megatron_rl.testing.distributed import run_ranks

pytestmark = [pytest.mark.mcore, pytest.mark.timeout(300)]

HELDOUT = {"min_digits": 1, "max_digits": 2, "heldout_frac": 0.1}
MAX_NEW = 4
REWARD = """
def length(prompt_text, response_text, answer):
    return len(response_text) / 4
"""


def length(response_text):
    """The reward the job uses (``REWARD``): it varies between samples, so the weights change in 3 steps."""
    return len(response_text) / 4


def _train(rank, world, cfg):
    from megatron_rl.trainer.loop import train

    train(cfg)


def _greedy(model, prompt_ids, eos):
    """HF greedy decoding of one prompt: argmax per position, up to EOS (kept) or MAX_NEW tokens."""
    ids = list(prompt_ids)
    out = []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
            if nxt == eos:
                break
    return out


def _offline(model_dir, heldout, file_prompts, tok):
    """The val/* reward and length means of greedy HF decoding with the weights in ``model_dir``."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.tasks.base import response_text

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    held = [_greedy(model, p.prompt_ids, eos) for p in heldout]
    files = [_greedy(model, p.prompt_ids, eos) for p in file_prompts]
    held_r = [length(response_text(tok, r)[0]) for r in held]
    file_r = [length(response_text(tok, r)[0]) for r in files]
    lengths = [len(r) for r in held + files]
    return {"val/copy/reward_mean": sum(held_r) / len(held_r), "val/val.jsonl/reward_mean": sum(file_r) / len(file_r),
            "val/reward_mean": (sum(held_r) + sum(file_r)) / len(lengths),
            "val/response_length_mean": sum(lengths) / len(lengths),
            "val/copy/prompts": float(len(heldout)), "val/val.jsonl/prompts": float(len(file_prompts))}


def test_validation_matches_offline_greedy_eval_and_is_never_trained_on(copy_model, tmp_path):
    from megatron_rl.actor.hf_io import export_checkpoint_to_hf
    from megatron_rl.tasks import DigitTask, FileTask
    from megatron_rl.tokenizer import load_tokenizer

    tok = load_tokenizer(copy_model)
    task = DigitTask("copy", tok, **HELDOUT)
    heldout = task.heldout_prompts()
    val_file = tmp_path / "val.jsonl"
    val_file.write_text("".join(json.dumps({"prompt": p.text, "answer": p.answer}) + "\n" for p in heldout[:5]))
    (tmp_path / "reward.py").write_text(REWARD)
    run = tmp_path / "run"
    cfg = load_job_config(None, [
        "parallel.tensor_model_parallel_size=1", f"rollout.max_new_tokens={MAX_NEW}", "rollout.n_samples_per_prompt=2",
        "rollout.dtype=float32", "data.prompts_per_step=4", "data.task=copy", f"data.task_kwargs={json.dumps(HELDOUT)}",
        "data.val_heldout=true", f"data.val_files={val_file}", f"data.reward_fn={tmp_path / 'reward.py'}:length", "actor.lr=5e-2", "actor.micro_batch_size=8",
        f"actor.load_hf={copy_model}", "trainer.steps=3", "trainer.test_freq=2",
        f"trainer.run_dir={run}", "trainer.dump_rollouts=true", "trainer.progress=false"], world_size=2)
    run_ranks(_train, 2, cfg, timeout=240)

    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    validated = {r["step"]: r for r in records if "val/reward_mean" in r}
    assert sorted(validated) == [0, 2, 3]                          # before training, every 2 steps, the last
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2, 3]

    file_prompts = FileTask(str(val_file), tok).prompts
    export_checkpoint_to_hf(str(run / "checkpoints" / "step_3"), str(tmp_path / "hf_3"))
    want = {0: _offline(copy_model, heldout, file_prompts, tok),   # the initial model
            3: _offline(str(tmp_path / "hf_3"), heldout, file_prompts, tok)}  # the last step's checkpoint
    assert want[0] != want[3]  # training changed what greedy decoding gives: the comparison tells the weights apart
    for step in (0, 3):
        assert {k: validated[step][k] for k in want[step]} == pytest.approx(want[step], abs=1e-9), f"step {step}"

    trained = [json.loads(line) for line in open(run / "rollouts.jsonl")]
    assert len(trained) == 3 * 4 * 2
    val_prompts = {tuple(p.prompt_ids) for p in heldout} | {tuple(p.prompt_ids) for p in file_prompts}
    assert not [r for r in trained if tuple(r["prompt_ids"]) in val_prompts]
