"""CPU compatibility patches: scope (megatron only), idempotence, and each patch's behaviour against
an independent reference (torch's own generator / clip_grad_norm_, megatron's documented seeds).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_cpu_compat.py -q``
"""
import pytest
import torch

from megatron_rl.platform import cpu_compat
from megatron_rl.platform.cpu_compat import PATCHES, cpu_patches_applied
from megatron_rl.platform.select import apply_cpu_patches

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches are inactive with CUDA")

apply_cpu_patches()

from megatron_rl.parallel import ParallelConfig, destroy_model_parallel, initialize_model_parallel  # noqa: E402
from megatron_rl.testing.distributed import run_ranks  # noqa: E402


def test_idempotent_and_reported():
    before = dict(PATCHES)
    assert apply_cpu_patches() is True
    assert apply_cpu_patches() is True
    assert cpu_patches_applied()
    assert PATCHES == before
    for symbol in ("megatron.core.tensor_parallel.random._get_cuda_rng_state",
                   "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32",
                   "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__",
                   "megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu"):
        assert symbol in PATCHES and PATCHES[symbol]


def test_noop_when_cuda_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert apply_cpu_patches() is False


def test_torch_view_only_inside_megatron():
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.transformer.utils as tutils

    # megatron's `torch` maps CUDA to CPU ...
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert schedules.torch.cuda.current_device() == torch.device("cpu")
    assert tutils.get_default_causal_mask(3).tolist() == torch.triu(torch.ones(3, 3), 1).bool().tolist()
    # ... the real torch is untouched, and tensors/classes are the real objects
    assert torch.cuda.current_device is not schedules.torch.cuda.current_device
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")
    assert schedules.torch.Tensor is torch.Tensor and schedules.torch.float32 is torch.float32


def test_lazily_imported_megatron_module_gets_view_on_next_call():
    import sys

    name = "megatron.core.transformer.moe.shared_experts"
    import importlib

    mod = importlib.import_module(name)
    apply_cpu_patches()
    assert name in sys.modules and mod.torch is not torch


def test_streams_and_events_are_synchronous_stand_ins():
    import megatron.core.transformer.moe.token_dispatcher as td

    s = td.torch.cuda.Stream()
    assert s == td.torch.cuda.current_stream()
    ev = s.record_event()
    ev.synchronize()
    with td.torch.cuda.stream(s):
        pass


def test_maybe_move_tensor_to_cpu_gives_numpy_splits():
    import numpy as np
    from megatron.core.transformer.moe import moe_utils

    out = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
    assert isinstance(out, np.ndarray) and out.tolist() == [1, 2]


def test_clip_grad_matches_torch_clip_grad_norm():
    from megatron.core.optimizer import clip_grads, optimizer as mopt

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(7))]
    ref = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    for p, r in zip(params, ref):
        p.grad = torch.randn(p.shape, generator=g)
        r.grad = p.grad.clone()
    total = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)))
    torch.nn.utils.clip_grad_norm_(ref, max_norm=0.5)
    assert mopt.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=0.5, total_norm=total)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-7)
    p64 = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    p64.grad = torch.ones(2, dtype=torch.float64)
    with pytest.raises(TypeError, match="fp32"):
        clip_grads.clip_grad_by_total_norm_fp32([p64], max_norm=0.5, total_norm=total)


def _rng_body(rank, world, seed):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=world), seed=seed)
    default_after_seed = torch.rand(3)
    tracker = get_cuda_rng_tracker()
    state_before = torch.get_rng_state()
    with tracker.fork():
        mp_draw = torch.rand(3)
    restored = torch.equal(torch.get_rng_state(), state_before)
    with tracker.fork():
        mp_draw2 = torch.rand(3)
    destroy_model_parallel()
    return default_after_seed, mp_draw, mp_draw2, restored


@pytest.mark.timeout(60)
def test_rng_tracker_uses_megatron_seeds_on_the_cpu_generator():
    seed = 11
    out = run_ranks(_rng_body, 2, seed, timeout=45)
    for tp_rank, (default, mp1, mp2, restored) in enumerate(out):
        # megatron: default ("data-parallel") state = seed; model-parallel state = seed + 2718 + tp_rank
        torch.testing.assert_close(default, torch.rand(3, generator=torch.Generator().manual_seed(seed)))
        ref = torch.Generator().manual_seed(seed + 2718 + tp_rank)
        torch.testing.assert_close(mp1, torch.rand(3, generator=ref))
        torch.testing.assert_close(mp2, torch.rand(3, generator=ref))  # the tracked state advanced
        assert restored
    assert not torch.equal(out[0][1], out[1][1])


def _sp_norm_body(rank, world):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True))
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                            tensor_model_parallel_size=2, sequence_parallel=True, use_cpu_initialization=True)
    norm = WrappedTorchNorm(cfg, 8, eps=1e-6)
    destroy_model_parallel()
    return type(norm).__name__, [getattr(p, "sequence_parallel", None) for p in norm.parameters()]


@pytest.mark.timeout(60)
def test_local_norm_allows_sequence_parallel_and_tags_params():
    for name, tags in run_ranks(_sp_norm_body, 2, timeout=45):
        assert name == "RMSNorm" and tags == [True]


def test_module_docstring_lists_usage():
    assert "apply_cpu_patches" in cpu_compat.__doc__


def test_megatron_modules_imported_after_the_one_call_are_patched_as_they_load():
    """One ``apply_cpu_patches()`` covers megatron modules imported later (its import hook): in a fresh
    interpreter, dist_checkpointing's writer module (not imported by the call) sees the CPU view of torch, and
    megatron's jit-fused functions are left undecorated (no torch.compile; no inductor import where megatron does
    not call torch.compile itself: 0.19's router decorates with it directly)."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from megatron_rl.platform.select import apply_cpu_patches\n"
        "apply_cpu_patches()\n"
        "name = 'megatron.core.dist_checkpointing.strategies.filesystem_async'\n"
        "assert name not in sys.modules, 'imported too early: the test would prove nothing'\n"
        "import megatron.core.dist_checkpointing.strategies.filesystem_async as fa\n"
        "assert fa.torch is not torch, 'not patched'\n"
        "assert fa.torch.cuda.current_device() == torch.device('cpu')\n"
        "fa.torch.cuda.synchronize()\n"
        # megatron's jit_fuser (torch.compile) is a no-op: fused functions are the plain ones, no inductor loaded
        "import megatron.core.fusions.fused_bias_geglu as g\n"
        "assert not hasattr(g.geglu, '__wrapped__'), 'geglu is wrapped by torch.compile'\n"
        # ... and imports no inductor, unless megatron itself decorates with torch.compile (0.19's router does)
        "import inspect, megatron.core.transformer.moe.router as router\n"
        "direct = '@torch.compile' in inspect.getsource(router)\n"
        "assert direct or 'torch._inductor.compile_fx' not in sys.modules, 'inductor imported'\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
