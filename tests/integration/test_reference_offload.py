"""``actor.ref_param_offload``: the KL reference's weights parked in host memory between its log-prob passes
(``actor.offload.ParkedParams`` through ``trainer.job.KLReference``).

On this CPU run the device is the CPU, so a park is a copy into new host storage and an unpark a copy back into new
storage: what is checked is what a GPU run relies on -- every parameter really moves each time (a new storage, never
an alias of the old one), the Parameter objects stay those the modules hold, the log-probs are bit-identical to the
never-parked reference, the weights are parked again after the pass (also when it raises) into the host copy made at
the first park (the weights are frozen: nothing is copied back), and a DDP-wrapped model (whose parameters are views
of its buffers: parking would free nothing) or a parameter that requires grad is refused.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_reference_offload.py -q``
"""
import multiprocessing

import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor import MegatronActor
from megatron_rl.plan import actor_spec
from megatron_rl.actor.offload import ParkedParams
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.testing.actor_reference import checkpoint_batch
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import knobs, layout, named_job
from megatron_rl.trainer.job import KLReference


def _parked_reference(rank, world, job):
    try:
        initialize_model_parallel(job.parallel, seed=7, model=job.model)
        batch, _ = checkpoint_batch(5, rows=4)
        ref = MegatronActor(actor_spec(job), frozen=True)
        want = KLReference(ref).log_probs(batch, 1.0)
        params = [p for c in ref.model for p in c.parameters()]
        before = [p.data_ptr() for p in params]
        kl = KLReference(ref, offload=True)
        out = {"same_objects": [id(p) for p in kl.parked.params] == [id(p) for p in params],
               "moved_at_park": all(p.data_ptr() != b for p, b in zip(params, before)),
               "parked": kl.parked.parked, "bytes": kl.parked.host_bytes(),
               "expected_bytes": sum(p.numel() * 2 for p in params)}
        during = []
        original = ref.compute_log_probs

        def spy(*a, **k):
            during.append([p.data_ptr() for p in params])
            return original(*a, **k)

        ref.compute_log_probs = spy
        parked_ptrs = [p.data_ptr() for p in params]
        got = kl.log_probs(batch, 1.0)
        out["moved_at_unpark"] = all(d != q for d, q in zip(during[0], parked_ptrs))
        out["parked_after"] = kl.parked.parked and all(p.data_ptr() != d for p, d in zip(params, during[0]))
        # frozen weights: parked again into the host copy kept from the first park (nothing copied back)
        out["host_copy_kept"] = [p.data_ptr() for p in params] == parked_ptrs
        ref.compute_log_probs = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("pass failed"))
        try:
            kl.log_probs(batch, 1.0)
        except RuntimeError:
            out["parked_after_error"] = kl.parked.parked
        try:
            ParkedParams(MegatronActor(actor_spec(job)).model, torch.device("cpu"))
        except ValueError as e:
            out["ddp_refused"] = str(e)
        ref.model[0].requires_grad_(True)
        try:
            ParkedParams(ref.model, torch.device("cpu"))
        except ValueError as e:
            out["trainable_refused"] = str(e)
        return want, got, out
    finally:
        for child in multiprocessing.active_children():
            child.terminate()
            child.join(5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lay", [{}, dict(pp=2)], ids=["dp1", "pp2"])
def test_parked_reference_gives_the_same_log_probs(tiny_hf_model, lay):
    job = named_job("actor", *layout(**lay), *knobs(bf16=True), hf=tiny_hf_model("qwen2", seed=21))
    for want, got, out in run_ranks(_parked_reference, 2 if lay else 1, job, timeout=250):
        assert want.abs().sum() > 0 and torch.equal(got, want)
        assert out["same_objects"] and out["moved_at_park"] and out["moved_at_unpark"], out
        assert out["parked"] and out["parked_after"] and out["parked_after_error"], out
        assert out["bytes"] == out["expected_bytes"], out   # bf16 weights: 2 bytes per element
        assert "DDP-wrapped" in out.get("ddp_refused", ""), out
        assert out["host_copy_kept"] and "requires grad" in out.get("trainable_refused", ""), out
