"""``megatron-rl convert mcore-to-hf`` of a LoRA run: the checkpoint of a TP2 actor with ``actor.lora`` (the adapters
alone, its base named and fingerprinted) is written as a PEFT adapter whose tensors are the layout-free adapters
the run holds (qkv / fc1 split per HF module; ``convert.lora_export``, itself checked against PEFT in
test_lora_export_peft.py), and with ``--merge`` as its base with the adapters merged; ``--merge`` on another base
(fingerprint) or on a checkpoint without adapters is refused naming what is wrong."""
from __future__ import annotations

import json

import pytest
import torch

import megatron.core  # noqa: F401  (import once in the parent: forked ranks start fast)
from megatron_rl.cli import main as cli_main
from megatron_rl.convert import storage
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.lora_export import merged_hf_state_dict, peft_adapter_tensors
from megatron_rl.convert.mapping import hf_to_mcore
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.lora_sync_reference import ALPHA, RANK, full_adapters

pytest.importorskip("transformers")


def _save(rank, world, hf_dir, out, lora, tp=1):
    from megatron_rl.actor import MegatronActor
    from megatron_rl.lora.config import LoraConfig
    from megatron_rl.convert.lora_layout import set_full_adapters
    from megatron_rl.lora.names import find_targets
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.plan import actor_spec
    from megatron_rl.testing.actor_reference import actor_job

    section = {"rank": RANK, "alpha": ALPHA, "target_modules": ["all-linear"]} if lora else {}
    job = actor_job(hf_dir, {"bf16": False, "lora": section}, parallel={"tensor_model_parallel_size": tp})
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    actor = MegatronActor(actor_spec(job))
    if lora:
        chunks = [m.module for m in actor.model]
        geom = HFGeometry.from_hf_config(storage.read_hf_config(hf_dir))
        set_full_adapters(find_targets(chunks, LoraConfig(**section)), full_adapters(geom, seed=5))
    actor.save_checkpoint(out, 1)


@pytest.fixture(scope="module")
def run(tiny_hf_model, tmp_path_factory):
    hf_dir = tiny_hf_model("qwen2", seed=37)
    ckpt = str(tmp_path_factory.mktemp("lora_ckpt") / "ckpt")
    run_ranks(_save, 2, hf_dir, ckpt, True, 2, timeout=240)  # TP2: the export is layout-free
    return hf_dir, ckpt


def _convert(capsys, *args):
    code = cli_main(["convert", "mcore-to-hf", *args])
    return code, capsys.readouterr().err


def _check_exports(hf_dir, ckpt, tmp_path, capsys):
    from safetensors.torch import load_file

    geom = HFGeometry.from_hf_config(storage.read_hf_config(hf_dir))
    adapters = full_adapters(geom, seed=5)
    code, err = _convert(capsys, "--mcore-dir", ckpt, "--out", str(tmp_path / "peft"))
    assert code == 0, err
    got = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    want = peft_adapter_tensors(adapters, geom)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    cfg = json.load(open(tmp_path / "peft" / "adapter_config.json"))
    assert cfg["r"] == RANK and cfg["lora_alpha"] == ALPHA and cfg["peft_type"] == "LORA"

    code, err = _convert(capsys, "--mcore-dir", ckpt, "--out", str(tmp_path / "merged"), "--merge")
    assert code == 0, err
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    base = hf_to_mcore(storage.read_hf_state_dict(hf_dir), geom)
    ref = merged_hf_state_dict({**base, **adapters}, geom, {"rank": RANK, "alpha": ALPHA})
    assert set(merged) == set(ref) and all(torch.equal(merged[k], ref[k]) for k in ref)


def test_lora_checkpoint_exports_peft_adapter_and_merged_model(run, tmp_path, capsys):
    hf_dir, ckpt = run
    _check_exports(hf_dir, ckpt, tmp_path, capsys)


def test_refusals_name_what_is_wrong(run, tiny_hf_model, tmp_path, capsys):
    hf_dir, ckpt = run
    other = tiny_hf_model("qwen2", seed=38)
    code, err = _convert(capsys, "--mcore-dir", ckpt, "--out", str(tmp_path / "a"), "--merge", "--hf-assets-dir", other)
    assert code == 2 and "is not the base the adapters were trained on" in err
    full = str(tmp_path / "full")
    run_ranks(_save, 1, hf_dir, full, False, timeout=240)
    code, err = _convert(capsys, "--mcore-dir", full, "--out", str(tmp_path / "b"), "--merge")
    assert code == 2 and "not a LoRA run's checkpoint" in err
