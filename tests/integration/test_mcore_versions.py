"""megatron-core release handling (``platform/mcore_version``) and the 0.19 differences patched on CPU.

* the version is read from the distribution (``megatron.core.__version__`` appends a git hash) and releases
  outside 0.16.1 <= v < 0.20 are refused with a message naming both;
* the DeepSeek-V3 MLA local spec builds (0.19 refused its replicated down-projection: "Unsupported
  linear_q_down_proj") and keeps the replicated ``Linear`` the project's RoPE-key gradient handling needs;
* a checkpoint directory holds ``common.pt`` (0.19 writes none; 0.16 cannot load without it).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_mcore_versions.py -q``
"""
import os
from importlib.metadata import version

import pytest

import megatron.core  # noqa: F401
from megatron_rl.platform.mcore_version import (MCORE, McoreRelease, UnsupportedMegatronCore,
                                                check_supported_mcore, parse_release)
from megatron_rl.testing.distributed import run_ranks


def test_installed_release_is_the_distribution_version_and_supported():
    assert MCORE.text == version("megatron-core").split("+")[0]
    assert check_supported_mcore() is MCORE


@pytest.mark.parametrize("text,expected", [("0.16.1", (0, 16, 1)), ("0.19.2+79b1ed7", (0, 19, 2)),
                                           ("0.20.0rc1", (0, 20, 0)), ("1.0", (1, 0, 0))])
def test_parse_release(text, expected):
    assert parse_release(text) == expected


@pytest.mark.parametrize("release", [(0, 16, 0), (0, 15, 3), (0, 20, 0)])
def test_unsupported_release_is_refused_naming_both(release):
    with pytest.raises(UnsupportedMegatronCore, match=r"megatron-core .* is installed; megatron-rl supports "
                                                      r"0\.16\.1 <= megatron-core < 0\.20\.0"):
        check_supported_mcore(McoreRelease(release))


def _rank_build_mla(rank, world):
    from megatron.core.post_training.modelopt.layers import Linear

    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.parallel import ParallelConfig, initialize_model_parallel

    model = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=128,
                        ffn_hidden_size=96, max_position_embeddings=64, multi_latent_attention=True,
                        q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12)
    parallel = ParallelConfig()
    initialize_model_parallel(parallel, seed=1, model=model)
    chunk = build_gpt_model(model, parallel)[0]
    attn = chunk.decoder.layers[0].self_attention
    return [type(attn.linear_q_down_proj) is Linear, type(attn.linear_kv_down_proj) is Linear]


def test_mla_local_spec_builds_with_replicated_down_projections():
    assert run_ranks(_rank_build_mla, 1, timeout=120) == [[True, True]]


def _rank_save(rank, world, root):
    import multiprocessing

    from megatron_rl.actor import MegatronActor
    from megatron_rl.plan import actor_spec
    from megatron_rl.config import job_config_from_dict
    from megatron_rl.parallel import initialize_model_parallel

    job = job_config_from_dict({"model": dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64,
                                              ffn_hidden_size=48, max_position_embeddings=32),
                                "actor": {"micro_batch_size": 1}})
    try:
        initialize_model_parallel(job.parallel, seed=1, model=job.model)
        return MegatronActor(actor_spec(job)).save_checkpoint(root, 1)
    finally:
        for child in multiprocessing.active_children():
            child.terminate()
            child.join(5)


def test_checkpoint_has_common_pt_for_older_releases(tmp_path):
    d = run_ranks(_rank_save, 1, str(tmp_path / "ck"), timeout=120)[0]
    assert os.path.isfile(os.path.join(d, "dist", "common.pt")), sorted(os.listdir(os.path.join(d, "dist")))
