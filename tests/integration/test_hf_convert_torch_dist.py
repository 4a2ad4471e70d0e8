"""Export a megatron torch_dist (dist_checkpointing) checkpoint to HF: checkpoints are saved by real
``torchrun`` ranks (TP2 dense with padded vocab; MoE with EP2) after loading a HF model and doubling
every weight, then read back in one process without a process group: the HF export must equal 2x the
source tensors bit for bit.

Run: ``pytest tests/integration/test_hf_convert_torch_dist.py`` (marked slow: ~30-40 s, fresh torchrun processes —
megatron's async checkpoint writer spawns a multiprocessing Manager, which the forked daemonic ranks
of ``run_ranks`` cannot do).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_rl.convert import CheckpointFormatError, convert_mcore_to_hf, storage
from megatron_rl.convert.torch_dist import is_torch_dist_checkpoint

pytestmark = pytest.mark.mcore  # megatron saves the checkpoints (torchrun ranks): runs on the 0.19 leg too

pytest.importorskip("transformers")

_SAVE_SCRIPT = textwrap.dedent('''
    import os, sys
    import torch

    def main():
        import torch.distributed as dist
        dist.init_process_group("gloo")
        from megatron.core import dist_checkpointing
        import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
        import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401
        from megatron_rl.platform.cpu_compat import apply_cpu_patches
        from megatron_rl.models import build_gpt_model
        from megatron_rl.parallel import ParallelConfig, initialize_model_parallel

        apply_cpu_patches()  # covers the dist_checkpointing modules imported above (torch.cuda.synchronize)
        for job in sys.argv[1:]:
            hf, out, tp, ep, div = job.split(",")
            save(hf, out, int(tp), int(ep), int(div))
        dist.barrier()
        dist.destroy_process_group()

    def save(hf, out, tp, ep, div):
        from megatron.core import dist_checkpointing
        from megatron_rl.parallel.groups import ActorGroups
        from megatron_rl.models import build_gpt_model
        from megatron_rl.parallel import ParallelConfig, initialize_model_parallel
        from megatron_rl.convert import model_config_for_checkpoint, load_checkpoint_into_model

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

    if __name__ == "__main__":
        main()
''')


@pytest.fixture(scope="module")
def hf_models(tiny_hf_model):
    return {"qwen2": tiny_hf_model("qwen2", seed=21, num_hidden_layers=4),
            "qwen3_moe": tiny_hf_model("qwen3_moe", seed=22)}


CASES = [("qwen2", 2, 1, 100),    # dense: layers stacked on a leading axis, TP2, padded vocab 384 -> 400
         ("qwen3_moe", 1, 2, 1)]   # MoE: per-layer keys, experts stacked, EP2


@pytest.mark.slow
def test_torch_dist_checkpoint_exports_to_hf(hf_models, tmp_path):
    script = tmp_path / "save.py"
    script.write_text(_SAVE_SCRIPT)
    jobs = []
    for key, tp, ep, div in CASES:
        (tmp_path / key).mkdir()
        jobs.append(f"{hf_models[key]},{tmp_path / key},{tp},{ep},{div}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script), *jobs], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
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
