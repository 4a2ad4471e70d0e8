"""``check`` on an SGLang-served Qwen2 RM whose checkpoint lacks ``score.bias``: SGLang 0.5.23 builds that head with
a bias and leaves it at its random init, a constant that differs per server seed (measured on a real CPU server:
-0.0477 with --random-seed 0, -0.0410 with 1; with a zero score.bias written, HF's scores to 1e-6). Several servers:
a problem naming reward.model.urls; one: a note; a zero score.bias written: nothing."""
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.config.reward_section import RewardModelConfig
from megatron_rl.tasks.rm_check import check_reward_model
from megatron_rl.testing.tiny_rm import build_tiny_rm

DEAD = ["http://127.0.0.1:9", "http://127.0.0.1:9/"]


def _cfg(path, urls, backend="sglang"):
    return RewardModelConfig(enable=True, path=path, backend=backend, urls=urls)


def test_missing_score_bias_is_named(tmp_path):
    path = build_tiny_rm(tmp_path / "rm", seed=0)
    problems, _ = check_reward_model(_cfg(path, DEAD), None)
    assert len(problems) == 1 and problems[0].startswith("reward.model.urls: 2 servers") and "score.bias" in problems[0]
    problems, lines = check_reward_model(_cfg(path, DEAD[:1]), None)
    assert problems == [] and any("note" in x and "score.bias" in x for x in lines)
    assert check_reward_model(_cfg(path, [], backend="local"), None)[0] == []
    sd = load_file(f"{path}/model.safetensors")
    sd["score.bias"] = torch.zeros(1)
    save_file(sd, f"{path}/model.safetensors", metadata={"format": "pt"})
    problems, lines = check_reward_model(_cfg(path, DEAD), None)
    assert problems == [] and not any("score.bias" in x for x in lines)


def test_a_checkpoint_not_on_disk_is_not_inspected(tmp_path):
    from megatron_rl.tasks.rm_check import score_bias_finding
    assert score_bias_finding(_cfg(str(tmp_path / "hub-org/rm-name"), DEAD)) == ([], [])
