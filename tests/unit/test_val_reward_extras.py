"""Validation logs a dict reward's extras per data source, as verl's validation does (``val-core/<source>/acc/...``
from the reward manager's ``reward_extra_info``, verl/trainer/ppo/ray_trainer.py ``_validate``): here
``val/<source>/reward_extra/<key>/mean`` over the responses whose reward returned the key. Expected values written
by hand from the reward file's rule.

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_val_reward_extras.py -q``
"""
from __future__ import annotations

import json

from megatron_rl.plan import collect_job_config
from megatron_rl.rollout.base import Rollout
from megatron_rl.rollout.versions import version_tag
from megatron_rl.tasks.char_tokenizer import build_char_tokenizer
from megatron_rl.tasks.val_set import build_val_set
from megatron_rl.trainer.validation import Validation, val_metrics


class _CopyEngine:
    """Answers prompt i with "<digit>" where even prompts get the right digit, odd ones a wrong one."""

    def generate(self, prompt_ids, params, n=1, seed=None):
        tok = build_char_tokenizer()
        out = []
        for i in range(len(prompt_ids) * n):
            p = i // n
            text = tok.decode(prompt_ids[p], skip_special_tokens=True)
            digit = text.split(":")[1][0]
            answer = digit if p % 2 == 0 else str((int(digit) + 1) % 10)
            ids = tok.encode(answer, add_special_tokens=False)
            out.append(Rollout(p, prompt_ids[p], ids, [0.0] * len(ids), "stop", version_tag(1)))
        return out


def test_val_metrics_mean_each_extra_per_source():
    m = val_metrics(["a", "a", "b", "b"], [1.0, -1.0, 1.0, 1.0], [1, 1, 1, 1], [False] * 4, 1,
                    extras=[{"acc": 1.0}, {"acc": 0.0}, {"acc": 1.0, "len": 3.0}, None])
    assert m["val/a/reward_extra/acc/mean"] == 0.5 and m["val/b/reward_extra/acc/mean"] == 1.0
    assert m["val/b/reward_extra/len/mean"] == 3.0
    assert "val/a/reward_extra/len/mean" not in m


def test_validation_logs_a_dict_rewards_acc_per_source(tmp_path, monkeypatch):
    (tmp_path / "dapo_vr.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    ok = solution_str.strip() == ground_truth\n"
        "    return {'score': 1.0 if ok else -1.0, 'acc': ok, 'pred': solution_str}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "v.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"copy:{i}=", "answer": str(i), "data_source": "s"}) + "\n"
                            for i in range(5)))
    cfg, problems = collect_job_config(None, ["data.task=copy", f"data.val_files={path}",
                                              "data.reward_fn=dapo_vr:compute_score", "data.reward_workers=0",
                                              "trainer.test_freq=1"], world_size=1)
    assert not [p for p in problems if p.startswith(("data.", "trainer."))], problems
    v = Validation(cfg, build_val_set(None, cfg.data, build_char_tokenizer()), _CopyEngine())
    try:
        m = v.run(1)
    finally:
        v.close()
    # prompts 0, 2, 4 answered right: acc 3/5, score (3 - 2) / 5
    assert m["val/s/reward_extra/acc/mean"] == 3 / 5 and m["val/s/reward_mean"] == 1 / 5
