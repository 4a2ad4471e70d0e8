"""The SGLang server flags of an adapter-only LoRA job (``rollout.sglang_lora_flags``, ``cli.server_flags``,
``launch/sglang_server.sh``): SGLang's own target-module names (its ``SUPPORTED_LORA_TARGET_MODULES`` when
installed), ``all-linear`` -> ``all``, the rank as ``--max-lora-rank``, torch_native on CPU; nothing for merged
sync or another engine."""
from __future__ import annotations

import os
import subprocess

import pytest

from megatron_rl.cli.server_flags import server_options
from megatron_rl.config import job_config_from_dict
from megatron_rl.lora.config import LoraConfig
from megatron_rl.rollout.sglang_lora_flags import SGLANG_LORA_NAMES, sglang_lora_args, sglang_lora_targets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_targets_map_to_sglang_names():
    assert sglang_lora_targets(LoraConfig(rank=4)) == ["all"]
    lora = LoraConfig(rank=4, target_modules=["q_proj", "k_proj", "v_proj", "linear_fc2"])
    assert sglang_lora_targets(lora) == ["q_proj", "k_proj", "v_proj", "down_proj"]
    assert sglang_lora_args(lora, "cpu") == ["--enable-lora", "--max-lora-rank", "4", "--lora-target-modules",
                                             "q_proj", "k_proj", "v_proj", "down_proj",
                                             "--lora-backend", "torch_native"]
    assert "--lora-backend" not in sglang_lora_args(lora, "cuda")


def test_names_are_sglangs():
    common = pytest.importorskip("sglang.srt.utils.common")
    names = {n for group in SGLANG_LORA_NAMES.values() for n in group}
    assert names <= set(common.SUPPORTED_LORA_TARGET_MODULES), names - set(common.SUPPORTED_LORA_TARGET_MODULES)


def _job(**rollout):
    return job_config_from_dict({"actor": {"lora": {"rank": 8, "target_modules": ["linear_qkv", "linear_proj"]}},
                                 "rollout": {"engine": "sglang", "sglang_urls": ["http://x:1"], **rollout}})


def test_server_flags_of_an_adapter_job_start_a_lora_server():
    opts = server_options(_job(lora_sync="adapter"))
    assert opts == ["--lora-rank", "8", "--lora-targets", "q_proj,k_proj,v_proj,o_proj"]
    assert server_options(_job(lora_sync="merged")) == []
    cmd = subprocess.run([os.path.join(REPO, "launch", "sglang_server.sh"), "--model", "/nonexistent", "--device",
                          "cpu", *opts], env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True,
                         check=True).stdout
    assert ("--enable-lora --max-lora-rank 8 --lora-target-modules q_proj k_proj v_proj o_proj "
            "--lora-backend torch_native") in cmd


def test_a_launched_server_gets_the_flags_and_the_engine_its_adapter_dir(monkeypatch, tmp_path):
    from megatron_rl.rollout import factory

    seen = {}

    class _Handle:
        url = "http://127.0.0.1:1"

        def terminate(self):
            pass

    def launch(model_dir, **kw):
        seen.update(kw)
        return _Handle()

    monkeypatch.setattr(factory, "launch_sglang_server", launch)
    cfg = job_config_from_dict({"actor": {"lora": {"rank": 8, "target_modules": ["all-linear"]}},
                                "rollout": {"engine": "sglang", "sglang_launch": True, "lora_sync": "adapter"}})
    engine, server = factory.build_engine(cfg.rollout, "/hf", 0, str(tmp_path), lora=cfg.actor.lora)
    device = "cuda" if factory.torch.cuda.is_available() else "cpu"
    assert list(seen["extra_args"]) == sglang_lora_args(cfg.actor.lora, device)
    assert engine._adapters.root == os.path.join(str(tmp_path), "weight_sync", "lora_adapters")
    merged = job_config_from_dict({"actor": {"lora": {"rank": 8}}, "rollout": {"engine": "sglang",
                                                                                "sglang_launch": True}})
    engine, _ = factory.build_engine(merged.rollout, "/hf", 0, str(tmp_path), lora=merged.actor.lora)
    assert list(seen["extra_args"]) == [] and engine._adapters is None


def test_server_flags_cli_refuses_a_target_sglang_cannot_serve(tmp_path, capsys):
    from megatron_rl.cli.server_flags import main

    cfg = tmp_path / "job.yaml"
    cfg.write_text("actor:\n  lora:\n    rank: 4\n    target_modules: [linear_qkv, linear_kv_down_proj]\n"
                   "rollout:\n  engine: sglang\n  sglang_urls: ['http://x:1']\n  lora_sync: adapter\n")
    assert main([str(cfg)]) == 2
    assert "actor.lora.target_modules: 'linear_kv_down_proj'" in capsys.readouterr().err
