"""Worker of ``tests/integration/test_mcore_cross_checkpoint.py``, run by one megatron-core venv's python per call.

    python tests/integration/mcore_ckpt_worker.py save CKPT_DIR OUT.pt   # init (seed 7), 1 step, save, snapshot, 1 step
    python tests/integration/mcore_ckpt_worker.py load CKPT_DIR OUT.pt   # init (seed 99), load, snapshot, 1 step
    python tests/integration/mcore_ckpt_worker.py load A A.pt save B B.pt  # several calls, in order, one interpreter

Each call forks its own ranks (a fresh process group and model); calls in one interpreter share only its imports.

Layout: MoE at TP2 + SP x EP2 (ETP1) on 2 forked gloo ranks (dense, TP-sharded and expert-sharded tensors,
Adam state of both optimizers). OUT.pt (rank 0): megatron-core version, the HF state dict and log-probs of a
fixed batch right after save / load, and the HF state dict after one more step (which uses Adam's state).
"""
import sys

import torch

import megatron.core  # noqa: F401  (imported once in the parent: forked ranks start fast)
from megatron_rl.actor import MegatronActor
from megatron_rl.plan import actor_spec
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.platform.mcore_version import MCORE
from megatron_rl.testing.actor_reference import checkpoint_batch
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import layout, named_job, setting
from test_actor_checkpoint import MOE, SCHEDULE_KEYS, _step


def _rank(rank, world, mode, ckpt_dir):
    job = named_job("checkpoint_actor", *SCHEDULE_KEYS, setting("model", MOE), *layout(tp=2, ep=2))
    job.parallel.expert_tensor_parallel_size = 1
    job.parallel.sequence_parallel = True
    initialize_model_parallel(job.parallel, seed=7 if mode == "save" else 99, model=job.model)
    actor = MegatronActor(actor_spec(job))
    if mode == "save":
        _step(actor, 100)
        actor.save_checkpoint(ckpt_dir, 1, {"written_by": MCORE.text})
        extra = None
    else:
        _, extra = actor.load_checkpoint(ckpt_dir)
    batch, _ = checkpoint_batch(200, rows=4)
    logprobs, _ = actor.compute_log_probs(batch, 1.0)
    weights = actor.full_state_dict_hf()
    _step(actor, 101)
    return {"mcore": MCORE.text, "weights": weights, "logprobs": logprobs, "extra": extra,
            "weights_after_step": actor.full_state_dict_hf()}


if __name__ == "__main__":
    calls = sys.argv[1:]
    if not calls or len(calls) % 3 or any(mode not in ("save", "load") for mode in calls[::3]):
        raise SystemExit(f"mcore_ckpt_worker: expected (save|load) CKPT_DIR OUT.pt, repeated; got {calls}")
    for i in range(0, len(calls), 3):
        mode, ckpt, out = calls[i:i + 3]
        results = run_ranks(_rank, 2, mode, ckpt, timeout=240)
        torch.save(results[0], out)
