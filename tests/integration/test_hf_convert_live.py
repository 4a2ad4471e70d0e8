"""Loading checkpoints into a live parallel Megatron model and exporting it back to HF (the trainer's path
for SGLang weight sync): bit-exact at TP2xPP2 (resharded from a TP1 conversion), TP2 x uneven PP2 (from a
conversion of that layout), DP2, PP4xVPP2, MoE TP2xEP2 (ETP1, SP), MoE TP2xPP2xEP2, uneven PP2 from HF —
and the export reads the live weights (doubling every parameter doubles the export). From HF or from a
conversion of any layout, each rank reads at most its shard's bytes.

Run: ``pytest tests/integration/test_hf_convert_live.py``.
"""
from __future__ import annotations

import os

import pytest
import torch

import megatron.core  # noqa: F401  (import once in the parent: forked ranks start fast)
from megatron_rl.convert import CheckpointMismatchError, ShardLayout, convert_hf_to_mcore
from megatron_rl.convert import storage
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.hf_config import model_config_from_hf
from megatron_rl.convert.live import (check_model_config_matches, export_model_to_hf, hf_target,
                                      load_checkpoint_into_model)
from megatron_rl.testing.actor_reference import hf_model_config
from megatron_rl.testing.distributed import run_ranks

pytest.importorskip("transformers")


def _load_export(rank, world, ckpt, assets, out, pcfg_kw, padded_vocab, scale):
    from megatron_rl.parallel.groups import ActorGroups
    from megatron_rl.models import build_gpt_model
    from megatron_rl.parallel import ParallelConfig, initialize_model_parallel

    pcfg = ParallelConfig(**pcfg_kw)
    mcfg = hf_model_config(assets, padded_vocab_size=padded_vocab)
    initialize_model_parallel(pcfg, seed=3, model=mcfg)
    chunks = build_gpt_model(mcfg, pcfg)
    groups = ActorGroups.from_parallel_state(sequence_parallel=pcfg.sequence_parallel)
    count = load_checkpoint_into_model(chunks, ckpt, mcfg, groups)
    shard = sum(t.numel() * t.element_size() for c in chunks for n, t in c.state_dict().items()
                if not n.endswith("_extra_state"))
    if scale != 1:
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    p.mul_(scale)
    files = export_model_to_hf(chunks, mcfg, hf_target(mcfg, assets), out, groups)
    return files, count.bytes_read, shard


@pytest.fixture(scope="module")
def hf_models(tiny_hf_model):
    return {
        "qwen2": tiny_hf_model("qwen2", seed=11, num_hidden_layers=4),
        "llama8": tiny_hf_model("llama", seed=12, num_hidden_layers=8, tie_word_embeddings=True),
        "qwen3_moe": tiny_hf_model("qwen3_moe", seed=13),
    }


CASES = [
    # key, source ("hf" or a conversion layout (tp, pp)), parallel config, world, scale
    ("qwen2", (1, 1), dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 4, 1),
    ("qwen2", dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers_in_last_pipeline_stage=1),
     dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers_in_last_pipeline_stage=1), 4, 2),
    ("qwen2", "hf", dict(), 2, 1),  # DP2: only the first replica sends
    ("llama8", "hf", dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2), 4, 1),
    ("qwen3_moe", "hf", dict(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                             expert_tensor_parallel_size=1, sequence_parallel=True), 2, 2),
    ("qwen3_moe", (1, 1), dict(expert_model_parallel_size=2), 2, 1),
    ("qwen3_moe", "hf", dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                             expert_tensor_parallel_size=1, sequence_parallel=True), 4, 1),
    ("qwen2", "hf", dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1), 2, 1),
]


def _layout(spec) -> ShardLayout:
    """The ShardLayout of a conversion spec (positional tuple) or of a parallel config's keys."""
    if isinstance(spec, tuple):
        return ShardLayout(*spec)
    return ShardLayout(**{k: v for k, v in spec.items() if k in ShardLayout.__dataclass_fields__})


@pytest.mark.parametrize("key,src,pcfg,world,scale", CASES,
                         ids=[f"{c[0]}-from{'conv' if isinstance(c[1], dict) else c[1]}-"
                              f"{'-'.join(f'{k[:3]}{v}' for k, v in c[2].items())}-x{c[4]}" for c in CASES])
def test_load_then_export_round_trip(hf_models, tmp_path, key, src, pcfg, world, scale):
    hf_dir = hf_models[key]
    ckpt = hf_dir
    if src != "hf":
        ckpt = str(tmp_path / "mc")
        convert_hf_to_mcore(hf_dir, ckpt, _layout(src))
    geom = HFGeometry.from_hf_config(storage.read_hf_config(hf_dir))
    tp = pcfg.get("tensor_model_parallel_size", 1)
    padded = -(-geom.vocab_size // (tp * 64)) * tp * 64  # exercise vocab padding (384 -> 384 / 512)
    out = str(tmp_path / "export")
    results = run_ranks(_load_export, world, ckpt, hf_dir, out, pcfg, padded, scale, timeout=150)
    files = [r[0] for r in results]
    assert files[0] and all(f is None for f in files[1:])
    for rank, (_, nbytes, shard) in enumerate(results):  # each rank read only its shard
        assert 0 < nbytes <= shard, f"rank {rank} read {nbytes} bytes for a shard of {shard}"
    a, b = storage.read_hf_state_dict(hf_dir), storage.read_hf_state_dict(out)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k] * scale, b[k]), k
    assert storage.read_hf_config(out) == storage.read_hf_config(hf_dir)
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))


def test_model_config_mismatch_names_fields(hf_models):
    cfg = storage.read_hf_config(hf_models["qwen3_moe"])
    good = model_config_from_hf(cfg)
    check_model_config_matches(cfg, good)
    bad = model_config_from_hf(dict(cfg, num_hidden_layers=3, moe_intermediate_size=64))
    with pytest.raises(CheckpointMismatchError, match=r"num_layers: checkpoint 2 vs model 3.*moe_ffn_hidden_size"):
        check_model_config_matches(cfg, bad)
    from megatron_rl.convert import model_config_for_checkpoint

    assert model_config_for_checkpoint(hf_models["qwen3_moe"], 2, 100).vocab_size == 400  # 384 padded to 2*100
    assert model_config_for_checkpoint(hf_models["qwen3_moe"]) == good
    small = model_config_from_hf(dict(cfg, vocab_size=300))
    with pytest.raises(CheckpointMismatchError, match=r"vocab_size: checkpoint 384 > model 300"):
        check_model_config_matches(cfg, small)
