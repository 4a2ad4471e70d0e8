"""Paths of a migrated verl job name the files verl opens. verl opens a relative path (``data.train_files``, a
custom reward file, ``trainer.default_local_dir`` -- its default ``checkpoints/<project>/<experiment>`` is
relative) from its working directory; a config file's paths resolve beside the file here
(docs/running.md#paths-in-a-config). So ``megatron-rl migrate verl`` writes them resolved against the directory it
runs in (where the verl job ran); hub ids stay. Real input: verl's rollout-correction example
(``tests/data/verl/rollout_corr_rloo_qwen2_5_7b_fsdp.yaml``, ``data/train.parquet`` relative).

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_migrate_verl_paths.py -q``
"""
from __future__ import annotations

import os

import yaml

from megatron_rl.cli import main as cli_main
from megatron_rl.config.load import read_config_file

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "verl")


def test_relative_verl_paths_resolve_where_verl_ran(tmp_path, monkeypatch, capsys):
    verl = yaml.safe_load(open(os.path.join(DATA, "rollout_corr_rloo_qwen2_5_7b_fsdp.yaml")))
    verl["custom_reward_function"] = {"path": "recipe/my_reward.py", "name": "compute_score"}
    src = tmp_path / "verl_job.yaml"
    src.write_text(yaml.safe_dump(verl))
    work = tmp_path / "verl_checkout"   # where the verl job runs (its working directory)
    (work / "recipe").mkdir(parents=True)
    (work / "recipe" / "my_reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, "
                                                 "extra_info=None):\n    return 0.0\n")
    out = tmp_path / "configs" / "job.yaml"
    out.parent.mkdir()
    monkeypatch.chdir(work)
    assert cli_main(["migrate", "verl", str(src), "-o", str(out), "--allow-changes"]) == 0
    said = capsys.readouterr().out
    cfg = read_config_file(str(out))   # as `megatron-rl check` / train read the written file, from anywhere
    monkeypatch.chdir(tmp_path)
    assert cfg["data"]["path"] == str(work / "data" / "train.parquet")
    assert cfg["data"]["val_files"] == str(work / "data" / "test.parquet")
    assert cfg["data"]["reward_fn"] == f"{work / 'recipe' / 'my_reward.py'}:compute_score"
    assert cfg["trainer"]["run_dir"] == str(work / "checkpoints" / "rollout_corr_rloo_example" / "rloo_seq_is_pure")
    assert cfg["actor"]["load_hf"] == "Qwen/Qwen2.5-7B"   # a hub id: left alone
    assert "data.path" in said and str(work) in said   # the report says which paths were anchored
