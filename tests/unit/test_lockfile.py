"""tools/lock/ and tools/lockfile.py: what CI tested is what installs.

The locks must be installable together and honest: every pin satisfies setup.py's ranges (install_requires, and the
dev extra for the test venvs), the venvs that share a package agree on its version, each names the Python it was
made with. The checker is compared with pip's own view of the venv (``pip list``), and must report a changed or
missing distribution; ``select`` maps each set-up of tools/setup_env.sh / tools/run_tests.sh to its lock.
"""
import json
import os
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import lockfile  # noqa: E402

LOCKS = {name: os.path.join(ROOT, "tools", "lock", f"{name}.txt") for name in ("main", "tests", "tests-mcore019")}


def _setup_requirements():
    """setup.py's install_requires and extras, as setuptools reads them (the installed metadata is not used: a
    stale editable install would hide a change)."""
    code = ("import json, setuptools, sys\n"
            "got = {}\n"
            "setuptools.setup = lambda **kw: got.update(kw)\n"
            "sys.argv = ['setup.py']\n"
            "exec(open('setup.py').read())\n"
            "print(json.dumps([got['install_requires'], got['extras_require']]))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=60).stdout
    return json.loads(out)


@pytest.mark.parametrize("name", sorted(LOCKS))
def test_every_pin_satisfies_setup_py_and_names_its_python(name):
    pins, tag = lockfile.read_lock(LOCKS[name])
    assert tag.startswith("python 3."), f"{LOCKS[name]}: no '# python X.Y platform machine' line"
    install, extras = _setup_requirements()
    wanted = install + (extras["dev"] if name.startswith("tests") else [])
    bad = []
    for line in wanted:
        req = Requirement(line)
        key = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate():
            continue
        if key not in pins:
            bad.append(f"{req}: not in the lock")
        elif not req.specifier.contains(pins[key], prereleases=True):
            bad.append(f"{req}: locked {pins[key]}")
    assert not bad, f"{LOCKS[name]} vs setup.py: {bad}"
    assert pins.get("torch", "").split("+")[0] == "2.13.0"    # the CPU build the set-ups install first


def test_the_venvs_agree_on_every_package_they_share():
    """.venv serves both the quickstart (main) and leg 1 (tests): one version each; leg 2 is set up under tests.txt
    (less megatron-core) by tools/latest.sh --write-lock, so it agrees too (a megatron-core 0.19 that needed another
    version of a shared package would stop that set-up, not slip into the lock)."""
    main, _ = lockfile.read_lock(LOCKS["main"])
    tests, _ = lockfile.read_lock(LOCKS["tests"])
    new, _ = lockfile.read_lock(LOCKS["tests-mcore019"])
    assert set(main) <= set(tests), sorted(set(main) - set(tests))
    assert {k: v for k, v in main.items() if tests[k] != v} == {}
    assert tests["megatron-core"] == "0.16.1" and new["megatron-core"] == "0.19.2"
    assert {k: (v, tests[k]) for k, v in new.items() if k != "megatron-core" and k in tests and tests[k] != v} == {}


def test_select_maps_each_set_up_to_its_lock():
    here = lockfile.python_tag()
    for (mode, mcore), (name, complete) in lockfile.SELECT.items():
        path, got_complete = lockfile.select(mode, mcore)
        _, tag = lockfile.read_lock(LOCKS[name])
        if tag == here:
            assert (path, got_complete) == (LOCKS[name], complete), (mode, mcore)
        else:   # another Python than the lock's: unlocked, never a lock made for another interpreter
            assert path == ""
    assert lockfile.select("--tests", "0.18.0") == ("", False)
    assert lockfile.select("", "0.19.2") == ("", False)   # the lean venv at 0.19 was never tested


def test_check_agrees_with_pip_and_names_what_differs(tmp_path):
    listed = json.loads(subprocess.run([sys.executable, "-m", "pip", "list", "--format=json"], capture_output=True,
                                       text=True, check=True, timeout=120).stdout)
    pip_view = {canonicalize_name(d["name"]): d["version"] for d in listed}
    pip_view.pop("megatron-rl", None)
    ours = lockfile.installed()
    assert ours == pip_view
    lock = tmp_path / "lock.txt"
    lockfile.main(["write", str(lock), "--name", "this venv"])
    pins, tag = lockfile.read_lock(str(lock))
    assert pins == {k: v.split("+")[0] for k, v in pip_view.items()} and tag == lockfile.python_tag()
    assert lockfile.main(["check", str(lock), "--complete"]) == 0
    pins["torch"] = "0.0.1"
    pins["no-such-dist"] = "1.0"
    lock.write_text("".join(f"{k}=={v}\n" for k, v in pins.items()))
    rows = lockfile.differences(*[lockfile.read_lock(str(lock))[0], lockfile.installed()], complete=True)
    assert f"torch: locked 0.0.1, installed {pip_view['torch']}" in rows
    assert "no-such-dist: locked 1.0, not installed" in rows and len(rows) == 2
    assert lockfile.main(["check", str(lock)]) == 1                 # the version, even without --complete
    bad = tmp_path / "bad.txt"
    bad.write_text("torch>=2\n")
    with pytest.raises(ValueError, match=r"bad.txt:1: expected 'name==version'"):
        lockfile.read_lock(str(bad))


def test_uv_is_optional_and_local_labels_are_the_builds_not_the_version():
    pins = {"uv": "0.13.9", "torch": "2.13.0", "numpy": "2.4.6"}
    # pip mode (MEGATRON_RL_INSTALLER=pip) has no uv; a CPU build of the locked torch is that torch
    assert lockfile.differences(pins, {"torch": "2.13.0+cpu", "numpy": "2.4.6"}, complete=True) == []
    assert lockfile.differences(pins, {"uv": "0.14.0", "torch": "2.13.1+cpu", "numpy": "2.4.6"}, complete=True) == [
        "torch: locked 2.13.0, installed 2.13.1+cpu", "uv: locked 0.13.9, installed 0.14.0"]
    assert lockfile.differences({"numpy": "2.4.6+x"}, {"numpy": "2.4.6"}, complete=True) == [
        "numpy: locked 2.4.6+x, installed 2.4.6"]


def test_a_distribution_installed_twice_is_an_error(tmp_path):
    for version in ("1.0", "2.0"):
        info = tmp_path / f"dup_pkg-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: dup-pkg\nVersion: {version}\n")
    with pytest.raises(RuntimeError, match=r"installed twice.*dup-pkg.*1\.0.*2\.0"):
        lockfile.installed([str(tmp_path)])
    (tmp_path / "dup_pkg-2.0.dist-info" / "METADATA").unlink()
    (tmp_path / "dup_pkg-2.0.dist-info").rmdir()
    assert lockfile.installed([str(tmp_path)]) == {"dup-pkg": "1.0"}


def test_this_venv_is_the_lock_ci_installed():
    """The suite's own venv holds its lock's versions (leg 1: tests.txt; leg 2: tests-mcore019.txt): an install
    that bypassed the lock cannot pass unnoticed. tools/latest.sh runs its smoke with MEGATRON_RL_LOCK=none."""
    if os.environ.get("MEGATRON_RL_LOCK") == "none":
        pytest.skip("MEGATRON_RL_LOCK=none: this venv is the newest set, not the lock (tools/latest.sh)")
    from importlib.metadata import version
    name = {"0.16.1": "tests", "0.19.2": "tests-mcore019"}.get(version("megatron-core").split("+")[0])
    if name is None or lockfile.read_lock(LOCKS[name])[1] != lockfile.python_tag():
        pytest.skip(f"no lock for megatron-core {version('megatron-core')} on {lockfile.python_tag()}")
    pins, _ = lockfile.read_lock(LOCKS[name])
    assert lockfile.differences(pins, lockfile.installed(), complete=False) == []


@pytest.mark.parametrize("mode, mcore, name, kind", [("", "", "main", "complete"), ("--tests", "0.16.1", "tests", "complete"),
                                                      ("--dev", "0.19.2", "tests-mcore019", "complete"),
                                                      ("--dev", "", "tests", "subset")])
def test_select_from_the_command_line_as_the_set_ups_call_it(mode, mcore, name, kind):
    """tools/setup_env.sh calls `select -- MODE MCORE` with MODE a flag (--tests): argparse must take it as a value
    (without `--` it refused it and the set-up silently installed unlocked)."""
    for script, needle in (("setup_env.sh", 'tools/lockfile.py select -- "$MODE" "$MCORE"'),
                           ("install_sglang_cpu.sh", 'tools/lockfile.py" select -- --tests 0.16.1')):
        assert needle in open(os.path.join(ROOT, "tools", script)).read(), script
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "lockfile.py"), "select", "--", mode, mcore],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    if lockfile.read_lock(LOCKS[name])[1] == lockfile.python_tag():
        assert r.stdout.strip() == f"{kind} {LOCKS[name]}"
    else:
        assert r.stdout.strip() == ""
