"""Export a megatron torch_dist (dist_checkpointing) checkpoint to HF: checkpoints are saved by 2 gloo ranks
(``run_ranks``: forked, not daemonic, so megatron's own checkpoint writer may start its processes) with
megatron's ``dist_checkpointing.save`` (TP2 dense with padded vocab; MoE with EP2) after loading a HF model and
doubling every weight, then read back in this process without a process group: the HF export must equal 2x the
source tensors bit for bit.

Run: ``pytest tests/integration/test_hf_convert_torch_dist.py`` (marked slow).
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.convert import CheckpointFormatError, convert_mcore_to_hf, storage
from megatron_rl.convert.torch_dist import is_torch_dist_checkpoint
from megatron_rl.testing.distributed import run_ranks

pytestmark = pytest.mark.mcore  # megatron saves the checkpoints (forked ranks): runs on the 0.19 leg too

pytest.importorskip("transformers")


def _save_rank(rank, world, jobs):
    """Each job ``(hf, out, tp, ep, div)`` on this rank: the HF model loaded at that layout, every weight doubled,
    saved with ``dist_checkpointing.save`` to ``out``."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401
    from megatron_rl.convert import load_checkpoint_into_model, model_config_for_checkpoint
    from megatron_rl.models import build_gpt_model
    from megatron_rl.parallel import ParallelConfig, initialize_model_parallel
    from megatron_rl.parallel.groups import ActorGroups
    from megatron_rl.platform.select import apply_cpu_patches

    apply_cpu_patches()  # covers the dist_checkpointing modules imported above (torch.cuda.synchronize)
    for hf, out, tp, ep, div in jobs:
        pc = ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                            expert_tensor_parallel_size=1 if ep > 1 else None, sequence_parallel=tp > 1 and ep > 1)
        mc = model_config_for_checkpoint(hf, tp, div)
        initialize_model_parallel(pc, seed=1, model=mc)
        chunks = build_gpt_model(mc, pc)
        load_checkpoint_into_model(chunks, hf, mc, ActorGroups.from_parallel_state())
        with torch.no_grad():
            for p in chunks[0].parameters():
                p.mul_(2)
        dist_checkpointing.save(chunks[0].sharded_state_dict(), out)
    dist.barrier()


@pytest.fixture(scope="module")
def hf_models(tiny_hf_model):
    return {"qwen2": tiny_hf_model("qwen2", seed=21, num_hidden_layers=4),
            "qwen3_moe": tiny_hf_model("qwen3_moe", seed=22)}


CASES = [("qwen2", 2, 1, 100),    # dense: layers stacked on a leading axis, TP2, padded vocab 384 -> 400
         ("qwen3_moe", 1, 2, 1)]   # MoE: per-layer keys, experts stacked, EP2


@pytest.mark.slow
def test_torch_dist_checkpoint_exports_to_hf(hf_models, tmp_path):
    jobs = []
    for key, tp, ep, div in CASES:
        (tmp_path / key).mkdir()
        jobs.append((hf_models[key], str(tmp_path / key), tp, ep, div))
    run_ranks(_save_rank, 2, jobs, timeout=300)
    for key, *_ in CASES:
        ckpt = str(tmp_path / key)
        assert is_torch_dist_checkpoint(ckpt)
        with pytest.raises(CheckpointFormatError, match="--hf-assets-dir"):
            convert_mcore_to_hf(ckpt, str(tmp_path / f"{key}_no_assets"))
        convert_mcore_to_hf(ckpt, str(tmp_path / f"{key}_hf"), assets_dir=hf_models[key])
        a, b = storage.read_hf_state_dict(hf_models[key]), storage.read_hf_state_dict(str(tmp_path / f"{key}_hf"))
        assert sorted(a) == sorted(b)
        for k in a:
            assert torch.equal(a[k] * 2, b[k]), (key, k)
