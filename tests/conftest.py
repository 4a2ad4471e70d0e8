"""Shared pytest setup: one thread per process, GPU tests skipped without CUDA, the ``mcore`` marker on every
test file that imports megatron (``imports_megatron``), a check that no test leaves a process of its job running,
and the fixtures every test tree shares (tiny models, the HF reference, a job builder).

Fixtures (session-scoped models are built once per session per arguments, under pytest's tmp dir; a test
must leave a shared model directory as it found it):

* ``tiny_hf_model(arch="qwen2", seed=0, **overrides) -> str``: a tiny random HF model + tokenizer
  (``megatron_rl.testing.tiny_hf.build_tiny_hf_model``; ``arch`` qwen2 | llama | qwen3_moe | deepseek_v3);
* ``task_model(task="copy", seed=0, hidden_size=128, num_layers=2, **config) -> str``: a tiny model over the
  char vocabulary of ``megatron_rl.tasks`` (``build_task_model``);
* ``dense_model``, ``copy_model``: the most used of those (qwen2 seed 0; copy task, hidden 32, 1 layer);
* ``copy_sglang_server -> SharedServer``: a CPU SGLang server (``--random-seed 0``) of the copy-task model with
  hidden 64 and 2 layers (``.model_dir``), shared by the tests of one pytest process (an xdist worker) that use it:
  ``.get()`` starts it on first use (again if a test killed it); a test loads the weights it needs first (a loop
  publishes its own at step 0), so weights a test left behind do not matter;
* ``hf_reference(path) -> HFReference``: a fresh fp32 HF model (eval mode) and tokenizer loaded from a
  directory — the independent reference of the actor/engine tests (a fresh one per call: tests train it);
* ``tiny_job(*overrides, model=None, world_size=1) -> JobConfig``: the jobs table's ``tiny_cpu`` row
  (``configs/tiny_cpu.yaml``) with ``actor.load_hf`` at ``model`` (default ``copy_model``) and ``trainer.run_dir``
  in the test's tmp dir.

Forked ranks (``megatron_rl.testing.distributed.run_ranks``) do not see fixtures: the actor-vs-HF pieces they
need are functions in ``megatron_rl.testing.actor_reference``.
"""
import ast
import dataclasses
import functools
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_rl.testing import processes  # noqa: E402

torch.set_num_threads(1)

#: the repository root (configs/, launch/, tools/ live there)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

@functools.lru_cache(maxsize=None)
def _imported_names(path: str) -> frozenset:
    """Every module name an ``import`` in ``path`` names (anywhere in the file), ``from a import b`` as
    ``a`` and ``a.b``."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return frozenset(names)


def _source_of(module: str):
    """The file of a project module (``megatron_rl.x.y`` or ``tests.x``), or None."""
    base = os.path.join(ROOT, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _is_megatron(name: str) -> bool:
    return name == "megatron" or name.startswith("megatron.")


@functools.lru_cache(maxsize=None)
def imports_megatron(path: str) -> bool:
    """Whether a test file imports megatron: itself, or through a project module it imports whose own code
    imports megatron (at any depth of that module's file: a function importing megatron when called counts)."""
    names = _imported_names(path)
    if any(map(_is_megatron, names)):
        return True
    for name in names:
        if name.split(".")[0] in ("megatron_rl", "tests"):
            src = _source_of(name)
            if src is not None and any(map(_is_megatron, _imported_names(src))):
                return True
    return False


#: Tests whose claim is a wall-clock bound (a deadline, "ends within N s", a stop that must arrive while ranks are
#: busy): they get the ``serial`` marker, and tools/run_tests.sh runs them before the parallel pass, one at a time,
#: so that a test running beside them on the same cores cannot stretch their clock. File paths or node ids.
WALL_CLOCK_BOUND = (
    "tests/integration/test_launcher_commands.py",
    "tests/integration/test_preemption.py",
    "tests/integration/test_sglang_server_failures.py",
    "tests/integration/test_weight_sync_bounds.py",
    "tests/unit/test_rollout_sglang_faults.py",
    "tests/integration/test_failures.py::test_stop_timeout_ends_a_blocked_rank_after_one_sigterm",
    "tests/integration/test_rewards_pool.py::test_slow_checker_times_out_and_the_batch_finishes",
    "tests/integration/test_rewards_pool.py::test_pathological_math_answer_does_not_stall_the_step",
    "tests/integration/test_async_drain.py::test_last_checkpoint_does_not_wait_for_rollouts_no_step_trains_on",
    "tests/integration/test_sglang_cpu_standins.py::test_install_script_is_idempotent_fast_and_keeps_shared_versions",
    "tests/integration/test_envs.py::test_pool_env_hangs_past_timeout",
    "tests/integration/test_attention_backend.py::test_launcher_refuses_in_seconds",
)


def _wall_clock_bound(nodeid: str) -> bool:
    return any(nodeid == k or nodeid.startswith(k + ("::" if k.endswith(".py") else "[")) for k in WALL_CLOCK_BOUND)


#: The longest test file (the 200-step quickstart in its own venv, ~8 min of the ~28 of the parallel pass)
LONGEST_FILE = "tests/integration/test_quickstart_fresh.py"


def _longest_files_first(items) -> None:
    """Order whole files longest first, as a scheduler of jobs on two machines does (LPT): the quickstart, then the
    files with the most ``slow`` tests, then the rest by number of tests; stable within a class, tests stay in
    file order. tools/run_tests.sh hands files to its xdist workers in this order (``--no-loadscope-reorder``:
    xdist's own order, by number of tests alone, started the one-test quickstart last, ~8 min beside an idle
    worker)."""
    slow: dict[str, int] = {}
    count: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        count[path] = count.get(path, 0) + 1
        slow[path] = slow.get(path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: (lambda p: (p != LONGEST_FILE, -slow[p], -count[p]))(item.nodeid.split("::")[0]))


def pytest_collection_modifyitems(config, items):
    mcore = pytest.mark.mcore  # tools/run_tests.sh runs these again on the newest megatron-core (-m mcore)
    serial = pytest.mark.serial
    # the mark serves selection only: parsing every test file and the project modules it imports is skipped
    # (seconds of each collection) when the -m expression does not name it
    select_mcore = "mcore" in (config.option.markexpr or "")
    for item in items:
        if select_mcore and imports_megatron(str(item.path)):
            item.add_marker(mcore)
        if _wall_clock_bound(item.nodeid):
            item.add_marker(serial)
    files = {item.nodeid.split("::")[0] for item in items}
    for key in WALL_CLOCK_BOUND:  # a renamed test must not silently leave the serial pass
        if key.split("::")[0] in files and not any(_wall_clock_bound(i.nodeid) and i.nodeid.startswith(key)
                                                   for i in items):
            raise pytest.UsageError(f"tests/conftest.py WALL_CLOCK_BOUND: {key!r} matches no collected test")
    _longest_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionstart(session):
    processes.become_subreaper()  # a job whose launcher died is re-parented to pytest: the fixture below still sees it


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """Fail a test that leaves a process it started running (a job's launcher, torchrun agent, ranks, servers):
    after the test, every process started during it (not by a server shared across tests) must end within
    15 s; what is left is killed and named in the failure."""
    before = processes.process_ids()
    yield
    left = processes.leftovers(before)
    if left:
        text = "; ".join(line.strip() for line in processes.describe(left).splitlines())
        processes.kill_processes(left)
        # one line: pytest's short summary (and the CI recap) shows a failure's first line only
        pytest.fail(f"the test left {len(left)} process(es) of its job running (killed now): {text}", pytrace=False)


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
def copy_model(task_model):
    """The smallest copy-task model (hidden 32, 1 layer, seed 0): what the loop/launcher tests train."""
    return task_model(task="copy", seed=0, hidden_size=32, num_layers=1)


@pytest.fixture(scope="session")
def copy_sglang_server(task_model, tmp_path_factory):
    """The session's SGLang server of the copy-task model (hidden 64, 2 layers), started on first use."""
    from megatron_rl.testing.sglang_script import SharedServer

    model = task_model(task="copy", seed=0, hidden_size=64, num_layers=2)
    with SharedServer(model, tmp_path_factory.mktemp("copy_sglang"), extra_args=["--random-seed", "0"],
                      ready_timeout=600) as shared:
        yield shared


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
    from megatron_rl.testing.jobs import named_job

    def build(*overrides, model=None, world_size=1):
        return named_job("tiny_cpu", *overrides, hf=model or copy_model, run_dir=tmp_path / "run",
                         world_size=world_size)

    return build
