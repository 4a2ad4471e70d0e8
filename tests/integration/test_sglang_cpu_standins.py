"""The CPU-only import stand-ins (megatron_rl/platform/sglang_cpu) and the lean install script.

* the stand-in ``sgl_kernel`` provides every ``*_cpu`` name the INSTALLED sglang imports from ``sgl_kernel``
  (found by parsing sglang's source with ``ast``, so an sglang upgrade that needs a new name fails here);
  each raises NotImplementedError naming itself when called;
* the text-only ``torchvision`` imports the names sglang/transformers import at load (incl. ``torchvision.io``)
  and any use raises ImportError;
* the stand-ins are NOT on the path of normal processes (only the server subprocess gets them);
* tools/install_sglang_cpu.sh is idempotent and fast when sglang is installed, and left torch/numpy/
  transformers at the project's versions.

Run: OMP_NUM_THREADS=1 pytest tests/integration/test_sglang_cpu_standins.py
"""
import ast
import importlib.metadata as md
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.rollout.sglang_server import CPU_STANDIN_DIR, sglang_available

ROOT = Path(__file__).resolve().parent.parent.parent


def run_with_standins(code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([CPU_STANDIN_DIR, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def sglang_cpu_imports(pkg_dir):
    """Names ending in _cpu imported with ``from sgl_kernel import ...`` anywhere in sglang's source."""
    names = set()
    for f in Path(pkg_dir).rglob("*.py"):
        src = f.read_text(errors="ignore")
        if "from sgl_kernel import" not in src:
            continue
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "sgl_kernel":
                names |= {a.name for a in node.names if a.name.endswith("_cpu")}
    return names


def test_standin_dir_is_the_package_directory():
    assert Path(CPU_STANDIN_DIR) == ROOT / "megatron_rl" / "platform" / "sglang_cpu"
    assert (Path(CPU_STANDIN_DIR) / "sgl_kernel" / "__init__.py").is_file()
    assert (Path(CPU_STANDIN_DIR) / "torchvision" / "io" / "__init__.py").is_file()
    assert (Path(CPU_STANDIN_DIR) / "README.md").is_file()


def test_standins_are_not_on_the_normal_path():
    for name in ("sgl_kernel", "torchvision"):
        spec = importlib.util.find_spec(name)
        assert spec is None or CPU_STANDIN_DIR not in str(spec.origin), name


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed in this interpreter")
def test_sgl_kernel_standin_covers_every_cpu_op_installed_sglang_imports():
    needed = sglang_cpu_imports(Path(importlib.util.find_spec("sglang").origin).parent)
    assert len(needed) >= 9, needed  # sanity: the scan finds the imports
    res = run_with_standins(
        "import sgl_kernel, json; print(json.dumps(sorted(sgl_kernel.CPU_OP_NAMES)))")
    assert res.returncode == 0, res.stderr
    provided = set(__import__("json").loads(res.stdout))
    assert needed <= provided, f"stand-in sgl_kernel lacks {sorted(needed - provided)}"


def _assert_each_refuses(prelude, each, call, error, check, module):
    """Run ``prelude`` beside the stand-ins, then ``call`` for every ``n`` in ``each``: each must raise ``error``
    (``e``) for which ``check`` holds; the script's ``module`` must come from the stand-in directory."""
    res = run_with_standins(
        f"{prelude}\n"
        f"for n in {each}:\n"
        "    try:\n"
        f"        {call}\n"
        f"    except {error} as e:\n"
        f"        assert {check}\n"
        "    else:\n"
        "        raise SystemExit('no error from ' + str(n))\n"
        f"print({module}.__file__)")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().startswith(CPU_STANDIN_DIR)


def test_sgl_kernel_standins_import_and_raise_when_called():
    _assert_each_refuses("import sgl_kernel\n"
                         "from sgl_kernel import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu",
                         "sgl_kernel.CPU_OP_NAMES", "getattr(sgl_kernel, n)(1, 2)", "NotImplementedError",
                         "n in str(e) and 'stand-in' in str(e)", "sgl_kernel")


def test_torchvision_placeholder_imports_and_refuses_use():
    _assert_each_refuses("import torchvision, torchvision.io, torchvision.transforms as T\n"
                         "from torchvision.transforms import InterpolationMode\n"
                         "from torchvision.transforms.functional import InterpolationMode as IM2, to_tensor\n"
                         "import torchvision.transforms.v2.functional as tvF\n"
                         "from torchvision.io import decode_jpeg\n"
                         "assert InterpolationMode.BICUBIC.value == 'bicubic' and IM2 is InterpolationMode",
                         "(decode_jpeg, to_tensor, T.Normalize, tvF.resize)", "n(1)", "ImportError",
                         "'text-only' in str(e)", "torchvision")


def test_sglang_available_reports_a_reason():
    ok, reason = sglang_available(python="/nonexistent/python3")
    assert not ok and "/nonexistent/python3" in reason


def test_free_ports_come_from_below_the_ephemeral_range():
    """A port picked now and bound seconds later by a server must not be one the kernel hands to another
    process's ``bind(port 0)`` or ``connect()`` meanwhile (test workers side by side): below the ephemeral range."""
    import socket

    from megatron_rl.parallel.ports import _ephemeral_low, find_free_port

    for _ in range(20):
        port = find_free_port()
        assert 1024 <= port and port + 3 < _ephemeral_low(), port
        for d in range(4):  # SGLang's few ports above it are free too
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + d))


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="sglang is not installed in this interpreter's venv (the script would install it)")
def test_install_script_is_idempotent_fast_and_keeps_shared_versions():
    before = {p: md.version(p) for p in ("torch", "numpy", "transformers", "tokenizers", "megatron-core")}
    t0 = time.monotonic()
    res = subprocess.run(["bash", str(ROOT / "tools" / "install_sglang_cpu.sh"), sys.prefix],
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout + res.stderr
    if "already present" in res.stdout:
        assert time.monotonic() - t0 < 5
    res = subprocess.run([sys.executable, "-c", "import importlib.metadata as md, json; print(json.dumps("
                          "{p: md.version(p) for p in ('torch','numpy','transformers','tokenizers','megatron-core')}))"],
                         capture_output=True, text=True, timeout=60)
    assert __import__("json").loads(res.stdout) == before
    assert before["torch"].startswith("2.13.0")


def _load_cpu_hooks(monkeypatch):
    """The CPU server's sitecustomize loaded here, its import hook kept out of this process's ``sys.meta_path``."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    spec = importlib.util.spec_from_file_location("_cpu_sitecustomize", os.path.join(CPU_STANDIN_DIR,
                                                                                     "sitecustomize.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fork_hook_forks_after_sglangs_spawn_and_leaves_other_sglang_versions_alone(monkeypatch):
    import multiprocessing
    import types

    import torch

    hooks = _load_cpu_hooks(monkeypatch)
    before = multiprocessing.get_start_method(allow_none=True)
    try:
        calls = []
        engine = types.SimpleNamespace(
            _set_envs_and_config=lambda a: calls.append(a) or multiprocessing.set_start_method("spawn", force=True))
        hooks._fork_children(engine)
        engine._set_envs_and_config("args")
        assert calls == ["args"] and multiprocessing.get_start_method() == "fork"
        # CUDA initialised in the server: sglang's spawn stays
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        engine = types.SimpleNamespace(
            _set_envs_and_config=lambda a: multiprocessing.set_start_method("spawn", force=True))
        hooks._fork_children(engine)
        engine._set_envs_and_config("args")
        assert multiprocessing.get_start_method() == "spawn"
        # an sglang whose engine module has no _set_envs_and_config: loaded unchanged, no error
        other = types.SimpleNamespace()
        hooks._fork_children(other)
        assert vars(other) == {}
    finally:
        multiprocessing.set_start_method(before, force=True)
