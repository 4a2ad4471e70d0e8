"""Running from the checkout root never hides an installed distribution behind a top-level folder of the repository.

Python puts the current directory (``python -c``, ``python -m``) or the script's folder first on ``sys.path``, so a
regular package at the checkout's root would win over an installed one of the same name. transformers >= 5.25
imports Hugging Face's ``kernels`` distribution when it loads its models, and the repository has a top-level
``kernels/`` folder: until it stopped being a package (the Triton kernels are ``kernels/megatron_rl_kernels/``,
imported as ``megatron_rl_kernels``), every README command failed with ``cannot import name 'CUDAProperties' from
'kernels' (<checkout>/kernels/__init__.py)``.

Two proofs: (1) the rule, for every top-level name of the checkout: seen from the root, each resolves to nothing or
to a namespace portion (which loses to any installed regular package), except ``megatron_rl`` itself; (2) the real
case, with Hugging Face's ``kernels`` installed in this venv (the ``dev`` extra asks for it): from the root,
transformers' model classes import, ``python -m megatron_rl.tasks`` builds a model, ``megatron-rl check
configs/tiny_cpu.yaml`` plans the job, and the 2-rank torchrun job of launch/torchrun.sh (the run's shared tiny
reference job, started from the root) trains 2 steps. Each failed on the tree before the fix.

Run: OMP_NUM_THREADS=1 pytest tests/integration/test_no_shadowing.py
"""
import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution

import pytest

from tests.integration.test_slurm_real import tiny_reference  # noqa: F401  (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Top-level names meant to import from the checkout: the project's own package, and setup.py (the build script
#: setuptools reads at the root; no distribution provides a top-level module named ``setup``).
OWN = {"megatron_rl", "setup"}


def _top_level_names():
    names = set()
    for entry in os.listdir(ROOT):
        path = os.path.join(ROOT, entry)
        if entry.startswith(".") or "-" in entry:
            continue
        if os.path.isdir(path) and entry.isidentifier():
            names.add(entry)
        elif entry.endswith(".py") and entry[:-3].isidentifier():
            names.add(entry[:-3])
    return sorted(names - OWN)


def _from_root(code, timeout=120):
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, f"from the checkout root: {code}\n{r.stderr[-3000:]}"
    return r.stdout


def test_no_top_level_name_of_the_checkout_is_a_regular_package_seen_from_its_root():
    names = _top_level_names()
    assert {"kernels", "configs", "launch", "tools", "tests", "examples"} <= set(names), names
    code = ("import importlib.util, json, sys\n"
            f"names = {names!r}\n"
            "out = {}\n"
            "for n in names:\n"
            "    spec = importlib.util.find_spec(n)\n"
            "    out[n] = None if spec is None else [spec.origin, list(spec.submodule_search_locations or [])]\n"
            "print(json.dumps(out))\n")
    found = json.loads(_from_root(code).strip().splitlines()[-1])
    root = os.path.realpath(ROOT)
    shadowing = {}
    for name, spec in found.items():
        if spec is None:
            continue
        origin, locations = spec
        # a namespace portion has no origin file (None or 'namespace'); a module or regular package has one. It
        # shadows when that file is the checkout's own folder or module of the name (a venv inside the checkout,
        # .venv/..., is where installed distributions live)
        own = (os.path.join(root, name) + os.sep, os.path.join(root, name + ".py"))
        if origin not in (None, "namespace") and os.path.realpath(origin).startswith(own):
            shadowing[name] = origin
    assert not shadowing, (f"these top-level names of the checkout import from it and would hide an installed "
                           f"distribution of the same name when Python runs from the root: {shadowing}")


def test_hf_kernels_is_what_the_root_imports_and_the_readme_paths_work(tmp_path, tiny_reference):
    try:
        dist = distribution("kernels")
    except PackageNotFoundError:
        pytest.fail("Hugging Face's `kernels` is not installed in this venv (the dev extra asks for it): the test "
                    "would prove nothing")
    where = os.path.realpath(str(dist.locate_file("kernels/__init__.py")))
    # the installed one, not the checkout's folder, is `kernels` from the root; and transformers' models load
    got = _from_root("import kernels, os; print(os.path.realpath(kernels.__file__))").strip()
    assert got == where, f"from the root, `import kernels` gave {got}, not the installed {where}"
    _from_root("import transformers\nfrom transformers import AutoModelForCausalLM, Qwen2ForCausalLM  # noqa\n")
    _from_root("import megatron_rl_kernels.logprob_kernels")

    model = tmp_path / "model"
    r = subprocess.run([sys.executable, "-m", "megatron_rl.tasks", str(model), "--task", "copy", "--hidden-size", "64",
                        "--num-layers", "2", "--seed", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (model / "config.json").exists()

    cli = os.path.join(os.path.dirname(sys.executable), "megatron-rl")
    r = subprocess.run([cli, "check", "configs/tiny_cpu.yaml", f"actor.load_hf={model}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "peak:" in r.stdout

    # launch/torchrun.sh from the root: torchrun's ranks run `python -m megatron_rl.train` with the root first on
    # their path (tests/integration/test_slurm_real.py torchrun_reference: cwd is the checkout)
    assert [m["step"] for m in tiny_reference.metrics()] == [1, 2]
