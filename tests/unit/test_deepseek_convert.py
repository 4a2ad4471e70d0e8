"""DeepSeek-V3 conversion without a model, and uneven pipeline stages.

* HF -> Megatron shards -> HF is bit-exact at several TP / PP (uneven) / EP / ETP layouts; a checkpoint
  converted for one layout reshards to another equal to cutting the HF checkpoint directly;
* MTP layers (``num_nextn_predict_layers``) are dropped on import, anything beyond them is refused by name;
* ``chunk_layer_range`` == megatron-core's own ``get_transformer_layer_offset`` / ``get_num_layers_to_build``
  for even and uneven stages, with and without VPP;
* ``ParallelConfig`` uneven-stage / MLA errors name the dotted keys; ``config.json`` options megatron
  cannot reproduce are refused naming the key; ``megatron_to_hf_config`` reads back to the same ModelConfig.

Run: ``pytest tests/unit/test_deepseek_convert.py`` (single process, seconds).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_rl.convert import (CheckpointMismatchError, HFGeometry, LayoutError, ShardLayout,
                                 UnsupportedCheckpointError, convert_hf_to_mcore, convert_mcore_to_hf,
                                 hf_to_mcore, load_rank_state_dict, rank_state_dict)
from megatron_rl.convert import storage
from megatron_rl.convert.hf_config import megatron_to_hf_config, model_config_from_hf
from megatron_rl.convert.partition import chunk_layer_range
from megatron_rl.parallel import ParallelConfig, ParallelConfigError, validate_parallel_config

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_model):
    return tiny_hf_model("deepseek_v3", seed=5, num_hidden_layers=4)


def _hf_config(hf_dir):
    with open(os.path.join(hf_dir, "config.json")) as fh:
        return json.load(fh)


LAYOUTS = [  # TP, PP, EP, ETP, first, last  (4 layers: layer 0 dense, 1-3 MoE)
    (1, 1, 1, None, None, None),
    (2, 1, 2, 1, None, None),
    (2, 2, 1, None, None, None),
    (1, 2, 4, None, 1, None),     # 1 + 3
    (2, 3, 2, 2, None, 2),        # 1 + 1 + 2
    (1, 3, 8, 1, 2, None),        # 2 + 1 + 1
]


@pytest.mark.parametrize("tp,pp,ep,etp,first,last", LAYOUTS)
def test_round_trip_is_bit_exact(hf_dir, tmp_path, tp, pp, ep, etp, first, last):
    layout = ShardLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                         num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    convert_hf_to_mcore(hf_dir, str(tmp_path / "mc"), layout)
    convert_mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "hf"))
    src, out = storage.read_hf_state_dict(hf_dir), storage.read_hf_state_dict(str(tmp_path / "hf"))
    assert sorted(src) == sorted(out)
    for k in src:
        assert out[k].dtype == src[k].dtype and torch.equal(out[k], src[k]), k
    # the stage holding layer 0 has the dense MLP; every stage's shard holds exactly its layers
    for p in range(pp):
        lo, hi = chunk_layer_range(4, p, pp, 0, 1, first, last)
        sd = load_rank_state_dict(str(tmp_path / "mc"), layout, pp_rank=p)
        layers = {int(k.split(".")[2]) for k in sd if k.startswith("decoder.layers.")}
        assert layers == set(range(hi - lo)), (p, layers)


def test_reshard_between_layouts(hf_dir, tmp_path):
    a = ShardLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                    expert_tensor_parallel_size=1, num_layers_in_last_pipeline_stage=1)
    b = ShardLayout(tensor_model_parallel_size=1, pipeline_model_parallel_size=3, expert_model_parallel_size=4,
                    num_layers_in_first_pipeline_stage=2)
    convert_hf_to_mcore(hf_dir, str(tmp_path / "a"), a)
    geom = HFGeometry.from_hf_config(_hf_config(hf_dir))
    full = hf_to_mcore(storage.read_hf_state_dict(hf_dir), geom)
    for pp in range(3):
        for ep in range(4):
            got = load_rank_state_dict(str(tmp_path / "a"), b, pp_rank=pp, ep_rank=ep)
            want = rank_state_dict(full, geom, b, pp_rank=pp, ep_rank=ep)
            assert sorted(got) == sorted(want)
            assert all(torch.equal(got[k], want[k]) for k in want)


def test_mtp_layers_dropped_and_strays_refused(hf_dir, tmp_path):
    cfg = _hf_config(hf_dir)
    assert cfg["num_nextn_predict_layers"] == 1
    geom = HFGeometry.from_hf_config(cfg)
    sd = storage.read_hf_state_dict(hf_dir)
    mtp = {"model.layers.4.eh_proj.weight": torch.ones(64, 128), "model.layers.4.enorm.weight": torch.ones(64),
           "model.layers.4.mlp.experts.0.up_proj.weight": torch.ones(16, 64)}
    full = hf_to_mcore({**sd, **mtp}, geom)
    assert full.keys() == hf_to_mcore(sd, geom).keys()
    assert not any(k.startswith("decoder.layers.4.") for k in full)
    with pytest.raises(CheckpointMismatchError, match="model.layers.5.enorm.weight"):
        hf_to_mcore({**sd, **mtp, "model.layers.5.enorm.weight": torch.ones(64)}, geom)


@pytest.mark.parametrize("L,pp,vpp,first,last", [
    (8, 4, None, None, None), (8, 2, 2, None, None), (61, 8, None, 7, 6), (61, 8, None, 5, None),
    (61, 8, None, None, 5), (5, 2, None, 2, None), (5, 2, None, None, 3), (14, 4, 2, 4, 2), (10, 3, 2, 2, None)])
def test_chunk_layer_range_matches_megatron(L, pp, vpp, first, last):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    tc = TransformerConfig(num_layers=L, hidden_size=8, num_attention_heads=1, pipeline_model_parallel_size=pp,
                           virtual_pipeline_model_parallel_size=vpp, num_layers_in_first_pipeline_stage=first,
                           num_layers_in_last_pipeline_stage=last, pipeline_dtype=torch.float32,
                           use_cpu_initialization=True)
    seen = []
    for p in range(pp):
        for v in range(vpp or 1):
            vs = v if vpp else None
            lo, hi = chunk_layer_range(L, p, pp, v, vpp or 1, first, last)
            assert lo == get_transformer_layer_offset(tc, vp_stage=vs, pp_rank=p), (p, v)
            assert hi - lo == get_num_layers_to_build(tc, vp_stage=vs, pp_rank=p), (p, v)
            seen += range(lo, hi)
    assert sorted(seen) == list(range(L))
    counts = ParallelConfig(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                            num_layers_in_first_pipeline_stage=first,
                            num_layers_in_last_pipeline_stage=last).stage_layer_counts(L)
    assert counts == [sum(get_num_layers_to_build(tc, vp_stage=v if vpp else None, pp_rank=p)
                          for v in range(vpp or 1)) for p in range(pp)]


@pytest.mark.parametrize("kw,world,model,needle", [
    (dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=0), 2, dict(num_layers=5),
     "parallel.num_layers_in_first_pipeline_stage=0 must be an integer >= 1"),
    (dict(num_layers_in_last_pipeline_stage=3), 1, dict(num_layers=5),
     "parallel.num_layers_in_last_pipeline_stage=3 needs parallel.pipeline_model_parallel_size > 1"),
    (dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2,
          num_layers_in_first_pipeline_stage=3), 4, dict(num_layers=15),
     "parallel.num_layers_in_first_pipeline_stage=3 is not divisible by parallel.virtual_pipeline"),
    (dict(pipeline_model_parallel_size=8, num_layers_in_first_pipeline_stage=4), 8, dict(num_layers=61),
     "model.num_layers=61 minus parallel.num_layers_in_first_pipeline_stage leaves 57 layers"),
    (dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=4,
          num_layers_in_last_pipeline_stage=2), 2, dict(num_layers=5), "does not fit model.num_layers=5"),
    (dict(tensor_model_parallel_size=2), 2, dict(num_layers=2, multi_latent_attention=True),
     "multi_latent_attention with tensor_model_parallel_size=2 requires sequence_parallel=True"),
])
def test_parallel_config_errors_name_keys(kw, world, model, needle):
    m = dict(num_attention_heads=4, hidden_size=64, vocab_size=128, **model)
    with pytest.raises(ParallelConfigError) as err:
        validate_parallel_config(ParallelConfig(**kw), world, m)
    assert needle in str(err.value)


def test_uneven_61_layers_at_pp8_validates():
    validate_parallel_config(ParallelConfig(pipeline_model_parallel_size=8, num_layers_in_first_pipeline_stage=7,
                                            num_layers_in_last_pipeline_stage=6), 8,
                             dict(num_layers=61, num_attention_heads=128, hidden_size=7168, vocab_size=129280))


@pytest.mark.parametrize("change,needle", [
    (dict(norm_topk_prob=False), "norm_topk_prob=false"),
    (dict(num_experts_per_tok=4), "topk_group=1 != 2"),
    (dict(rope_interleave=False), "rope_interleave=false"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                           "mscale": 1.0, "rope_theta": 10000.0}), "mscale_all_dim=None"),
    (dict(architectures=["DeepseekV3ForCausalLM"], model_type="qwen2"), "does not match model_type"),
])
def test_unsupported_config_keys_are_named(hf_dir, change, needle):
    cfg = {**_hf_config(hf_dir), **change}
    with pytest.raises(UnsupportedCheckpointError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        model_config_from_hf(cfg)


def test_config_round_trip_and_kimi_alias(hf_dir):
    cfg = _hf_config(hf_dir)
    mc = model_config_from_hf(cfg)
    assert (mc.multi_latent_attention, mc.rope_type, mc.moe_router_num_groups, mc.moe_router_group_topk,
            mc.first_k_dense_replace, mc.moe_router_topk_scaling_factor, mc.moe_router_bias_update_rate) == \
        (True, "yarn", 2, 1, 1, 2.5, 0.0)
    assert model_config_from_hf(megatron_to_hf_config(mc, "deepseek_v3", vocab_size=cfg["vocab_size"])) == mc
    assert model_config_from_hf({**cfg, "model_type": "kimi_k2"}) == mc


def test_layout_errors_name_the_sizes(hf_dir, tmp_path):
    with pytest.raises(LayoutError, match="num_hidden_layers"):
        convert_hf_to_mcore(hf_dir, str(tmp_path / "x"), ShardLayout(pipeline_model_parallel_size=3,
                                                                     num_layers_in_first_pipeline_stage=3))
