"""HF <-> Megatron conversion without a model: bit-exact round trips, tensor layout against independent
loop-built references, resharding, the CLI, and the error messages for bad input.

Run: ``pytest tests/integration/test_hf_convert.py`` (single process, a few seconds).
"""
from __future__ import annotations

import filecmp
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_rl.cli import main as cli_main
from megatron_rl.convert import (CheckpointFormatError, CheckpointMismatchError, HFGeometry, LayoutError,
                                 ShardLayout, UnsupportedCheckpointError, convert_hf_to_mcore, convert_mcore_to_hf,
                                 hf_to_mcore, load_rank_state_dict, mcore_to_hf, rank_state_dict, unshard)
from megatron_rl.convert import storage
from megatron_rl.convert.random_model import write_random_hf_model
from megatron_rl.convert.shard_files import dense_keys, dense_shard, expert_keys, expert_shard

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_hf_model):
    from transformers import Qwen2MoeConfig, Qwen3Config

    root = tmp_path_factory.mktemp("tiny_conv")
    out = {
        "qwen2": tiny_hf_model("qwen2", seed=0, num_hidden_layers=4),
        "llama": tiny_hf_model("llama", seed=1),
        "qwen2_tied": tiny_hf_model("qwen2", seed=2, tie_word_embeddings=True),
        "qwen3_moe": tiny_hf_model("qwen3_moe", seed=3, num_hidden_layers=4),
    }
    c = Qwen3Config(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
    out["qwen3"] = write_random_hf_model(c, root / "qwen3", 4)
    c = Qwen2MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])
    out["qwen2_moe"] = write_random_hf_model(c, root / "qwen2_moe", 5, dtype="bfloat16")
    return out


def _assert_same_hf(a_dir, b_dir):
    a, b = storage.read_hf_state_dict(a_dir), storage.read_hf_state_dict(b_dir)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        # bit for bit (compare raw bytes, so NaN payloads or -0.0 would also count)
        assert a[k].contiguous().view(torch.uint8).equal(b[k].contiguous().view(torch.uint8)), k


LAYOUTS = {
    "qwen2": [(1, 1, 1, None, 1), (2, 1, 1, None, 1), (1, 2, 1, None, 1), (2, 2, 1, None, 1), (2, 4, 1, None, 128)],
    "llama": [(2, 2, 1, None, 1), (1, 1, 1, None, 128)],
    "qwen2_tied": [(1, 2, 1, None, 1), (2, 2, 1, None, 7)],
    "qwen3": [(2, 2, 1, None, 1)],
    "qwen3_moe": [(1, 1, 1, None, 1), (1, 1, 4, None, 1), (2, 2, 2, 1, 1), (2, 1, 2, 2, 1), (1, 4, 2, None, 64)],
    "qwen2_moe": [(2, 1, 2, 1, 1), (1, 2, 4, None, 1)],
}


@pytest.mark.parametrize("key,lay", [(k, l) for k, ls in LAYOUTS.items() for l in ls],
                         ids=[f"{k}-tp{l[0]}pp{l[1]}ep{l[2]}etp{l[3]}div{l[4]}" for k, ls in LAYOUTS.items() for l in ls])
def test_export_of_import_is_bit_exact(models, tmp_path, key, lay):
    tp, pp, ep, etp, div = lay
    layout = ShardLayout(tp, pp, ep, etp, div)
    src = models[key]
    meta = convert_hf_to_mcore(src, str(tmp_path / "mc"), layout)
    assert meta["padded_vocab_size"] % (tp * div) == 0
    # every expected shard file exists, nothing else
    g = HFGeometry.from_dict(meta["geometry"])
    shard_dirs = sorted(d for d in os.listdir(tmp_path / "mc") if d.startswith(("mp_rank", "expert_rank")))
    assert len(shard_dirs) == len(dense_keys(layout)) + len(expert_keys(g, layout))
    convert_mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "hf"))
    _assert_same_hf(src, tmp_path / "hf")
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            assert filecmp.cmp(os.path.join(src, name), tmp_path / "hf" / name, shallow=False), name


def _loop_qkv_reference(q, k, v, ng, hpg, d):
    """Megatron's linear_qkv rows built one head at a time: group g = q heads of g, k head g, v head g."""
    rows = []
    for grp in range(ng):
        for h in range(grp * hpg, (grp + 1) * hpg):
            rows.append(q[h * d:(h + 1) * d])
        rows.append(k[grp * d:(grp + 1) * d])
        rows.append(v[grp * d:(grp + 1) * d])
    return torch.cat(rows)


def test_layout_matches_loop_reference(models):
    """QKV grouping, [gate; up] fc1, row/column TP splits, PP renumbering, EP expert ownership and vocab
    padding, each checked against tensors indexed by hand from the HF checkpoint."""
    g, _, hf = __import__("megatron_rl.convert", fromlist=["read_hf_checkpoint"]).read_hf_checkpoint(models["qwen3_moe"])
    full = hf_to_mcore(hf, g)
    tp, pp, ep, etp = 2, 2, 2, 2
    layout = ShardLayout(tp, pp, ep, etp, make_vocab_size_divisible_by=100)  # 384 -> 400 rows
    ng, hpg, d, H = g.num_query_groups, g.num_heads_per_group, g.kv_channels, g.hidden_size
    per_stage, per_ep = g.num_layers // pp, g.num_moe_experts // ep
    for t, p, e in itertools.product(range(tp), range(pp), range(ep)):
        # cut from the full load, and read slice by slice from the HF files: both against the same loops
        for sd in (rank_state_dict(full, g, layout, t, p, e, t),
                   load_rank_state_dict(models["qwen3_moe"], layout, t, p, e, t)):
                for local in range(per_stage):
                    L = p * per_stage + local
                    pre = f"model.layers.{L}."
                    q, k, v = (hf[pre + f"self_attn.{x}_proj.weight"] for x in "qkv")
                    ref = _loop_qkv_reference(q, k, v, ng, hpg, d)
                    rows = ref.shape[0] // tp
                    assert torch.equal(sd[f"decoder.layers.{local}.self_attention.linear_qkv.weight"],
                                       ref[t * rows:(t + 1) * rows])
                    o = hf[pre + "self_attn.o_proj.weight"]
                    cols = o.shape[1] // tp
                    assert torch.equal(sd[f"decoder.layers.{local}.self_attention.linear_proj.weight"],
                                       o[:, t * cols:(t + 1) * cols])
                    assert torch.equal(sd[f"decoder.layers.{local}.self_attention.q_layernorm.weight"],
                                       hf[pre + "self_attn.q_norm.weight"])
                    assert torch.equal(sd[f"decoder.layers.{local}.mlp.router.weight"], hf[pre + "mlp.gate.weight"])
                    for j in range(per_ep):
                        ge = e * per_ep + j
                        gate, up, down = (hf[pre + f"mlp.experts.{ge}.{x}_proj.weight"] for x in ("gate", "up", "down"))
                        F = gate.shape[0] // etp
                        fc1 = sd[f"decoder.layers.{local}.mlp.experts.local_experts.{j}.linear_fc1.weight"]
                        assert torch.equal(fc1, torch.cat([gate[t * F:(t + 1) * F], up[t * F:(t + 1) * F]]))
                        fc2 = sd[f"decoder.layers.{local}.mlp.experts.local_experts.{j}.linear_fc2.weight"]
                        assert torch.equal(fc2, down[:, t * F:(t + 1) * F])
                emb = hf["model.embed_tokens.weight"]
                padded = torch.cat([emb, emb.new_zeros(400 - emb.shape[0], H)])
                if p == 0:
                    assert torch.equal(sd["embedding.word_embeddings.weight"], padded[t * 200:(t + 1) * 200])
                else:
                    assert "embedding.word_embeddings.weight" not in sd
                    head = hf["lm_head.weight"]
                    padded = torch.cat([head, head.new_zeros(400 - head.shape[0], H)])
                    assert torch.equal(sd["output_layer.weight"], padded[t * 200:(t + 1) * 200])
                    assert torch.equal(sd["decoder.final_layernorm.weight"], hf["model.norm.weight"])
                assert len([n for n in sd if ".local_experts." in n]) == per_stage * per_ep * 2


def test_load_rank_state_dict_reshards(models, tmp_path):
    """Shards saved at TP2xPP2 read back at TP1 / TP1xPP2 / TP2 equal direct HF -> rank slicing."""
    src = models["qwen2"]
    convert_hf_to_mcore(src, str(tmp_path / "mc"), ShardLayout(2, 2))
    for layout, coords in [(ShardLayout(1, 1), (0, 0)), (ShardLayout(1, 2), (0, 1)), (ShardLayout(2, 1), (1, 0)),
                           (ShardLayout(2, 2), (1, 1)), (ShardLayout(2, 1, make_vocab_size_divisible_by=128), (1, 0))]:
        a = load_rank_state_dict(str(tmp_path / "mc"), layout, *coords)
        b = load_rank_state_dict(src, layout, *coords)
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # and the full state dict survives a shard -> unshard trip at an odd layout
    g, _, hf = __import__("megatron_rl.convert", fromlist=["x"]).read_hf_checkpoint(src)
    full = hf_to_mcore(hf, g)
    lay = ShardLayout(2, 4, make_vocab_size_divisible_by=3)
    dense = {k: dense_shard(full, g, lay, *k) for k in dense_keys(lay)}
    back = unshard(dense, {}, g, lay)
    assert sorted(back) == sorted(full) and all(torch.equal(back[k], full[k]) for k in full)
    assert mcore_to_hf(back, g).keys() == hf.keys()


SLICE_CASES = [
    # model, (TP, PP, EP, ETP), VPP, uneven (first, last) stage layers, make_vocab_size_divisible_by,
    # read from: None = the HF directory, else a conversion with these ShardLayout arguments
    ("qwen2", (2, 2, 1, 2), 1, (1, None), 7, None),
    ("qwen2", (1, 2, 1, 1), 2, None, 1, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
                                             make_vocab_size_divisible_by=3)),
    ("qwen2_tied", (2, 2, 1, 2), 1, None, 5, None),
    ("qwen2_tied", (1, 1, 1, 1), 1, None, 1, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    ("qwen3_moe", (2, 2, 2, 1), 1, (1, 3), 1, None),
    ("qwen3_moe", (2, 2, 2, 1), 1, (1, 3), 1, dict(expert_model_parallel_size=4, pipeline_model_parallel_size=4)),
    ("qwen2_moe", (2, 1, 2, 2), 1, None, 1, None),
    ("qwen2_moe", (2, 1, 2, 2), 1, None, 1, dict(pipeline_model_parallel_size=2, expert_model_parallel_size=4)),
    ("deepseek_v3", (2, 3, 2, 1), 1, None, 1, None),
    ("deepseek_v3", (1, 1, 1, 1), 1, None, 1, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=3,
                                                   expert_model_parallel_size=2, expert_tensor_parallel_size=1)),
]


@pytest.mark.parametrize("key,sizes,vpp,uneven,divisible,saved", SLICE_CASES,
                         ids=[f"{c[0]}-{'conv' if c[5] else 'hf'}" for c in SLICE_CASES])
def test_rank_slices_equal_the_full_load_and_read_only_the_shard(models, tiny_hf_model, tmp_path, key, sizes, vpp,
                                                                 uneven, divisible, saved):
    """Each chunk read slice by slice, from the HF files or from a conversion saved for another layout, equals
    the chunk cut from the full load (bitwise, for TP / PP / VPP / uneven stages / EP / ETP / vocab padding /
    tied / shared experts / MLA), and the bytes read for it are at most its shard's bytes."""
    from megatron_rl.convert.partition import RankCoords, cut_state_dict
    from megatron_rl.convert.slices import read_chunk_from_converted, read_chunk_shard

    src = tiny_hf_model("deepseek_v3", seed=6) if key == "deepseek_v3" else models[key]
    g = HFGeometry.from_hf_config(storage.read_hf_config(src))
    full_count = storage.ReadCount()
    full = hf_to_mcore(storage.read_hf_state_dict(src, full_count), g)
    if saved:
        convert_hf_to_mcore(src, str(tmp_path / "mc"), ShardLayout(**saved))
    tp, pp, ep, etp = sizes
    first, last = uneven or (None, None)
    padded = ShardLayout(tp, make_vocab_size_divisible_by=divisible).padded_vocab(g.vocab_size)
    E = g.num_moe_experts or 0
    for t, p, e, et, v in itertools.product(range(tp), range(pp), range(ep), range(etp), range(vpp)):
        c = RankCoords(t, tp, p, pp, e, ep, et, etp, v, vpp, first, last)
        want = cut_state_dict(full, c, g.num_layers, g.tie_word_embeddings, E, padded_vocab_size=padded)
        count = storage.ReadCount()
        if saved:
            got = read_chunk_from_converted(str(tmp_path / "mc"), g, ShardLayout(**saved), c, padded, count)
        else:
            got = read_chunk_shard(storage.SafetensorsReader.for_hf_dir(src, count), g, c, padded)
        assert sorted(got) == sorted(want), c
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (c, k)
        shard = sum(x.numel() * x.element_size() for x in want.values())
        assert 0 < count.bytes_read <= shard, (c, count, shard)
        assert shard < full_count.bytes_read or (tp, pp, ep, vpp) == (1, 1, 1, 1), (c, shard)


# ----------------------------------------------------------------------------------------- errors

def _copy_hf(src, dst, edit_sd=None, edit_cfg=None):
    os.makedirs(dst, exist_ok=True)
    cfg = storage.read_hf_config(src)
    if edit_cfg:
        edit_cfg(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    sd = storage.read_hf_state_dict(src)
    if edit_sd:
        edit_sd(sd)
    storage.write_hf_state_dict(dst, sd)
    return str(dst)


def test_unsupported_architecture_names_field(models, tmp_path):
    bad = _copy_hf(models["llama"], tmp_path / "bad",
                   edit_cfg=lambda c: c.update(architectures=["MistralForCausalLM"]))
    with pytest.raises(UnsupportedCheckpointError, match=r"architectures=\['MistralForCausalLM'\]"):
        convert_hf_to_mcore(bad, str(tmp_path / "out"), ShardLayout())
    assert not os.path.exists(tmp_path / "out" / storage.METADATA_FILE)


def test_missing_unexpected_and_misshaped_tensors_are_listed(models, tmp_path):
    def edit(sd):
        del sd["model.layers.1.self_attn.k_proj.weight"]
        del sd["model.layers.0.mlp.up_proj.weight"]
        sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
        sd["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(64, 63)
    bad = _copy_hf(models["llama"], tmp_path / "bad", edit_sd=edit)
    with pytest.raises(CheckpointMismatchError) as e:
        convert_hf_to_mcore(bad, str(tmp_path / "out"), ShardLayout())
    msg = str(e.value)
    for frag in ("2 missing", "model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight",
                 "unexpected", "rotary_emb.inv_freq", "model.layers.1.self_attn.o_proj.weight: got (64, 63), "
                 "expected (64, 64)"):
        assert frag in msg


def test_layout_that_does_not_divide_is_refused(models, tmp_path):
    with pytest.raises(LayoutError, match=r"num_key_value_heads \(num_query_groups\)=2 is not divisible by "
                                          r"tensor_model_parallel_size=4"):
        convert_hf_to_mcore(models["qwen2"], str(tmp_path / "a"), ShardLayout(tensor_model_parallel_size=4))
    with pytest.raises(LayoutError, match=r"num_hidden_layers=2 is not divisible by pipeline_model_parallel_size=3"):
        convert_hf_to_mcore(models["llama"], str(tmp_path / "b"), ShardLayout(pipeline_model_parallel_size=3))
    with pytest.raises(LayoutError, match=r"num_experts=4 is not divisible by expert_model_parallel_size=3"):
        convert_hf_to_mcore(models["qwen3_moe"], str(tmp_path / "c"), ShardLayout(expert_model_parallel_size=3))
    with pytest.raises(LayoutError, match="dense model"):
        convert_hf_to_mcore(models["qwen2"], str(tmp_path / "d"), ShardLayout(expert_model_parallel_size=2))
    with pytest.raises(LayoutError, match="padded_vocab_size=383"):
        rank_state_dict({}, HFGeometry.from_hf_config(storage.read_hf_config(models["qwen2"])),
                        ShardLayout(padded_vocab_size=383))


def test_output_dir_and_shard_problems(models, tmp_path):
    out = str(tmp_path / "mc")
    convert_hf_to_mcore(models["qwen3_moe"], out, ShardLayout(1, 2, 2))
    with pytest.raises(CheckpointFormatError, match="not empty"):
        convert_hf_to_mcore(models["qwen3_moe"], out, ShardLayout(2, 1, 1))
    convert_hf_to_mcore(models["qwen3_moe"], out, ShardLayout(2, 1, 1), overwrite=True)  # stale shards removed
    assert sorted(d for d in os.listdir(out) if "rank" in d) == [
        "expert_rank_00_000_000", "expert_rank_01_000_000", "mp_rank_00_000", "mp_rank_01_000"]
    with open(tmp_path / "mine.txt", "w") as f:
        f.write("user file")
    with pytest.raises(CheckpointFormatError, match="mine.txt"):
        convert_hf_to_mcore(models["qwen2"], str(tmp_path), ShardLayout(), overwrite=True)
    # a tampered shard: wrong shape, named with its shard coordinates
    path = storage.expert_file(out, 0, 1, 0)
    sd = storage.read_shard(path, "x")
    sd["decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight"] = torch.zeros(64, 17)
    storage.write_safetensors(path, sd)
    with pytest.raises(CheckpointMismatchError, match=r"expert shard ep=0 etp=1 pp=0: 1 shape mismatch\(es\): "
                                                      r"\['decoder.layers.0.mlp.experts.local_experts.2.linear_fc2"):
        convert_mcore_to_hf(out, str(tmp_path / "hf"))
    os.remove(storage.dense_file(out, 1, 0))
    with pytest.raises(CheckpointFormatError, match="mp_rank_01_000"):
        convert_mcore_to_hf(out, str(tmp_path / "hf"))


def test_cli_round_trip_and_errors(models, tmp_path, capsys):
    src = models["qwen3_moe"]
    rc = cli_main(["convert", "hf-to-mcore", "--hf-dir", src, "--out", str(tmp_path / "mc"),
                   "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                   "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"])
    assert rc == 0 and "Qwen3MoeForCausalLM" in capsys.readouterr().out
    assert cli_main(["convert", "mcore-to-hf", "--mcore-dir", str(tmp_path / "mc"), "--out", str(tmp_path / "hf")]) == 0
    _assert_same_hf(src, tmp_path / "hf")
    rc = cli_main(["convert", "hf-to-mcore", "--hf-dir", src, "--out", str(tmp_path / "mc2"),
                   "--tensor-model-parallel-size", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "tensor_model_parallel_size=3" in err
    assert not os.path.exists(tmp_path / "mc2" / storage.METADATA_FILE)


def test_console_script_entry_point(models, tmp_path):
    """``python -m megatron_rl.cli`` (what the ``megatron-rl`` script runs) converts in a fresh process."""
    r = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "convert", "hf-to-mcore", "--hf-dir",
                        models["llama"], "--out", str(tmp_path / "mc"), "--pipeline-model-parallel-size", "2"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    assert os.path.isfile(storage.dense_file(str(tmp_path / "mc"), 0, 1))


def test_sharded_hf_directories(models, tmp_path):
    """Export split into several files + index (as large HF checkpoints are); importing that directory
    gives back the same tensors, and transformers loads it."""
    import transformers

    src = models["qwen3_moe"]
    convert_hf_to_mcore(src, str(tmp_path / "mc"), ShardLayout(1, 2, 2))
    files = convert_mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "sharded"), max_shard_bytes=40_000)
    assert len(files) > 3 and os.path.isfile(tmp_path / "sharded" / storage.SAFE_INDEX)
    convert_hf_to_mcore(str(tmp_path / "sharded"), str(tmp_path / "mc2"), ShardLayout(1, 1, 4))
    convert_mcore_to_hf(str(tmp_path / "mc2"), str(tmp_path / "single"))
    _assert_same_hf(src, tmp_path / "single")
    m = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "sharded"), dtype=torch.float32)
    ref = storage.read_hf_state_dict(src)["model.layers.1.self_attn.q_norm.weight"]
    assert torch.equal(m.state_dict()["model.layers.1.self_attn.q_norm.weight"], ref)


class _FakeModel(torch.nn.Module):
    """Stands in for a Transformer-Engine-spec GPTModel: only its state_dict() key set matters."""

    def __init__(self, sd):
        super().__init__()
        self._sd = sd

    def state_dict(self, *args, keep_vars=False, **kwargs):
        return self._sd


def test_transformer_engine_names():
    """Local-spec shard names are renamed to the TE spec's fused names (taken by hand from megatron-core
    0.16.1 gpt_layer_specs / TEGroupedMLP), ``_extra_state`` is never required, and export maps back."""
    from megatron_rl.convert import canonical_state_dict, load_state_dict_into_model

    local = {
        "decoder.layers.0.input_layernorm.weight": torch.full((4,), 1.0),
        "decoder.layers.0.pre_mlp_layernorm.weight": torch.full((4,), 2.0),        # dense layer: fused into fc1
        "decoder.layers.0.mlp.linear_fc1.weight": torch.full((8, 4), 3.0),
        "decoder.layers.1.input_layernorm.weight": torch.full((4,), 4.0),
        "decoder.layers.1.pre_mlp_layernorm.weight": torch.full((4,), 5.0),        # MoE layer: stays separate
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight": torch.full((8, 4), 6.0),
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight": torch.full((4, 4), 7.0),
    }
    te = {
        "module.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": torch.zeros(4),
        "module.decoder.layers.0.self_attention.linear_qkv._extra_state": None,
        "module.decoder.layers.0.mlp.linear_fc1.layer_norm_weight": torch.zeros(4),
        "module.decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(8, 4),
        "module.decoder.layers.1.self_attention.linear_qkv.layer_norm_weight": torch.zeros(4),
        "module.decoder.layers.1.pre_mlp_layernorm.weight": torch.zeros(4),
        "module.decoder.layers.1.mlp.experts.linear_fc1.weight1": torch.zeros(8, 4),
        "module.decoder.layers.1.mlp.experts.linear_fc2.weight1": torch.zeros(4, 4),
        "module.decoder.layers.1.mlp.experts.linear_fc1._extra_state": None,
    }
    load_state_dict_into_model(_FakeModel(te), local)
    assert te["module.decoder.layers.0.mlp.linear_fc1.layer_norm_weight"].eq(2.0).all()
    assert te["module.decoder.layers.1.pre_mlp_layernorm.weight"].eq(5.0).all()
    assert te["module.decoder.layers.1.mlp.experts.linear_fc2.weight1"].eq(7.0).all()
    back = canonical_state_dict(te)
    assert sorted(back) == sorted(local) and all(torch.equal(back[k], local[k]) for k in local)
    te["module.decoder.layers.2.self_attention.linear_proj.weight"] = torch.zeros(4, 4)
    with pytest.raises(CheckpointMismatchError, match=r"loading into model \(tp=0 pp=0\): 1 missing tensor\(s\): "
                                                      r"\['module.decoder.layers.2.self_attention.linear_proj"):
        load_state_dict_into_model(_FakeModel(te), local, where="tp=0 pp=0")


def test_unshard_rejects_diverged_replicas(models):
    """A replicated tensor (norm) that differs between TP ranks is an error, not silently rank 0's copy."""
    g, _, hf = __import__("megatron_rl.convert", fromlist=["x"]).read_hf_checkpoint(models["llama"])
    full = hf_to_mcore(hf, g)
    lay = ShardLayout(2, 1)
    dense = {k: dense_shard(full, g, lay, *k) for k in dense_keys(lay)}
    dense[(1, 0)]["decoder.layers.1.pre_mlp_layernorm.weight"] = dense[(1, 0)][
        "decoder.layers.1.pre_mlp_layernorm.weight"] + 1e-3
    with pytest.raises(CheckpointMismatchError, match=r"replicated tensor 'decoder.layers.1.pre_mlp_layernorm"
                                                      r".weight' differs between shard 0 and shard 1"):
        unshard(dense, {}, g, lay)


def test_forward_pass_options_the_model_cannot_reproduce_are_refused(models, tmp_path):
    """RoPE scaling is refused before anything is written, naming the option."""
    bad = _copy_hf(models["llama"], tmp_path / "rope",
                   edit_cfg=lambda c: c.update(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}))
    with pytest.raises(UnsupportedCheckpointError, match="llama3"):
        convert_hf_to_mcore(bad, str(tmp_path / "out"), ShardLayout())
    assert not os.path.exists(tmp_path / "out" / storage.METADATA_FILE)
