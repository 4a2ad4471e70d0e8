"""Shared pytest setup: one thread per process, GPU tests skipped without CUDA, the ``mcore`` marker, and the
fixtures every test tree shares (tiny models, the HF reference, a job builder).

Fixtures (session-scoped models are built once per session per arguments, under pytest's tmp dir; a test
must leave a shared model directory as it found it):

* ``tiny_hf_model(arch="qwen2", seed=0, **overrides) -> str``: a tiny random HF model + tokenizer
  (``megatron_rl.testing.tiny_hf.build_tiny_hf_model``; ``arch`` qwen2 | llama | qwen3_moe | deepseek_v3);
* ``task_model(task="copy", seed=0, hidden_size=128, num_layers=2, **config) -> str``: a tiny model over the
  char vocabulary of ``megatron_rl.tasks`` (``build_task_model``);
* ``dense_model``, ``moe_model``, ``copy_model``: the most used of those (qwen2 seed 0; qwen3_moe seed 0;
  copy task, hidden 32, 1 layer);
* ``hf_reference(path) -> HFReference``: a fresh fp32 HF model (eval mode) and tokenizer loaded from a
  directory — the independent reference of the actor/engine tests (a fresh one per call: tests train it);
* ``tiny_job(*overrides, model=None, world_size=1) -> JobConfig``: ``configs/tiny_cpu.yaml`` with
  ``actor.load_hf`` at ``model`` (default ``copy_model``) and ``trainer.run_dir`` in the test's tmp dir.

Forked ranks (``megatron_rl.testing.distributed.run_ranks``) do not see fixtures: the actor-vs-HF pieces they
need are functions in ``megatron_rl.testing.actor_reference``.
"""
import dataclasses
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

#: the repository root (configs/, launch/, tools/ live there)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: test files that touch megatron-core: marked ``mcore``, run again on the newest megatron-core by
#: tools/run_tests.sh (its second leg, ``-m mcore``; budget ~8 min on 2 cores)
MCORE_TEST_FILES = frozenset({
    "test_cpu_compat.py", "test_mcore_versions.py", "test_moe_grad_norm.py", "test_models.py",
    "test_parallel.py", "test_actor_forward.py", "test_actor_train.py",
    "test_actor_checkpoint.py", "test_routing_replay.py", "test_deepseek_v3.py", "test_deepseek_convert.py",
    "test_hf_convert_torch_dist.py", "test_hf_convert_logprobs.py", "test_train_loop.py",
    "test_packing_boundaries.py", "test_packed_attention.py",
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


def _cached_builder(root, build):
    """``make(*args, **kwargs) -> path``: ``build(dir, *args, **kwargs)`` once per distinct arguments."""
    built: dict = {}

    def make(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in built:
            built[key] = str(build(str(root / f"m{len(built)}"), *args, **kwargs))
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory):
    """Factory ``(arch="qwen2", seed=0, **overrides) -> path`` of a tiny HF model, built once per arguments."""
    from megatron_rl.testing.tiny_hf import build_tiny_hf_model

    return _cached_builder(tmp_path_factory.mktemp("tiny_hf"),
                           lambda out, arch="qwen2", seed=0, **kw: build_tiny_hf_model(out, arch=arch, seed=seed, **kw))


@pytest.fixture(scope="session")
def task_model(tmp_path_factory):
    """Factory ``(task="copy", seed=0, **kwargs) -> path`` of a char-vocabulary task model (``build_task_model``
    arguments), built once per arguments."""
    from megatron_rl.tasks.char_tokenizer import build_task_model

    return _cached_builder(tmp_path_factory.mktemp("task_model"), build_task_model)


@pytest.fixture(scope="session")
def dense_model(tiny_hf_model):
    """The tiny dense Qwen2 (2 layers, seed 0)."""
    return tiny_hf_model("qwen2", seed=0)


@pytest.fixture(scope="session")
def moe_model(tiny_hf_model):
    """The tiny Qwen3-MoE (2 layers, 4 experts, top-2, seed 0)."""
    return tiny_hf_model("qwen3_moe", seed=0)


@pytest.fixture(scope="session")
def copy_model(task_model):
    """The smallest copy-task model (hidden 32, 1 layer, seed 0): what the loop/launcher tests train."""
    return task_model(task="copy", seed=0, hidden_size=32, num_layers=1)


@dataclasses.dataclass
class HFReference:
    """An HF checkpoint loaded as the independent reference of a test."""

    #: the ``AutoModelForCausalLM`` in fp32, eval mode
    model: object
    #: its ``AutoTokenizer``
    tokenizer: object


@pytest.fixture
def hf_reference():
    """Factory ``(path) -> HFReference``: a fresh fp32 HF model (eval mode) and its tokenizer."""
    from transformers import AutoTokenizer

    from megatron_rl.testing.actor_reference import load_hf_reference

    return lambda path: HFReference(load_hf_reference(path).eval(), AutoTokenizer.from_pretrained(path))


@pytest.fixture
def tiny_job(copy_model, tmp_path):
    """Builder ``(*overrides, model=None, world_size=1) -> JobConfig`` of ``configs/tiny_cpu.yaml`` with
    ``actor.load_hf`` at ``model`` (default: ``copy_model``) and ``trainer.run_dir`` at ``tmp_path/run``."""
    from megatron_rl.config import load_job_config

    def build(*overrides, model=None, world_size=1):
        return load_job_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"),
                               [f"actor.load_hf={model or copy_model}", f"trainer.run_dir={tmp_path / 'run'}",
                                *overrides], world_size=world_size)

    return build
