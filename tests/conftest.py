"""Shared pytest setup: one thread per process, GPU tests skipped without CUDA."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


#: test files that touch megatron-core: marked ``mcore``, run again on the newest megatron-core by
#: tools/run_tests.sh (its second leg, ``-m mcore``; budget ~8 min on 2 cores)
MCORE_TEST_FILES = frozenset({
    "test_cpu_compat.py", "test_mcore_versions.py", "test_moe_grad_norm.py", "test_models.py",
    "test_parallel.py", "test_actor_forward.py", "test_actor_train.py",
    "test_actor_checkpoint.py", "test_routing_replay.py", "test_deepseek_v3.py", "test_deepseek_convert.py",
    "test_hf_convert_torch_dist.py", "test_hf_convert_logprobs.py", "test_train_loop.py",
})


def pytest_collection_modifyitems(config, items):
    mcore = pytest.mark.mcore
    for item in items:
        if item.path.name in MCORE_TEST_FILES:
            item.add_marker(mcore)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
