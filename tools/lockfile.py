"""The dependency locks of tools/lock/: which one a set-up uses, whether a venv holds it, and writing one.

A lock is the exact version of every distribution in a venv whose set-up passed the suite (pip's requirements
format, ``name==version``, names normalised); tools/setup_env.sh installs under it as a constraint file and then
runs ``check``, so a venv never silently differs from what CI ran. Stdlib only: it runs in any venv's Python.
Usage (docs/dependencies.md):
    python tools/lockfile.py select -- MODE MCORE         # "KIND PATH" of the lock a set-up uses (nothing: none)
    python tools/lockfile.py check LOCK [--complete]      # this Python's venv against LOCK (exit 1: differs)
    python tools/lockfile.py write LOCK --name NAME       # this venv's distributions -> LOCK
    python tools/lockfile.py diff LOCK                    # what this venv has that differs from LOCK
"""
import argparse
import os
import platform
import re
import sys
import sysconfig
from importlib.metadata import distributions

LOCK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lock")
#: Distributions never locked: the project itself (installed editable from the checkout).
UNLOCKED = {"megatron-rl"}
#: Locked where installed, never required: uv is the installer (absent with MEGATRON_RL_INSTALLER=pip).
OPTIONAL = {"uv"}
#: (set-up mode, megatron-core) -> (lock name, whether the mode installs all of it). '' = setup.py's default
#: megatron-core, which is 0.16.1 on Python 3.11 (the newest whose wheel admits it).
SELECT = {
    ("", ""): ("main", True), ("", "0.16.1"): ("main", True),
    ("--tests", ""): ("tests", True), ("--tests", "0.16.1"): ("tests", True),
    ("--dev", ""): ("tests", False), ("--dev", "0.16.1"): ("tests", False),
    ("--dev", "0.19.2"): ("tests-mcore019", True),
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def python_tag() -> str:
    return f"python {sys.version_info.major}.{sys.version_info.minor} {sys.platform} {platform.machine()}"


def installed(paths=None) -> dict:
    """{normalised name: version} of the distributions installed in this Python's environment: its site-packages
    only, not whatever else is on sys.path (setuptools >= 71 appends its vendored packages to it when imported)."""
    if paths is None:
        paths = list(dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib")))
    out, seen = {}, {}
    for dist in distributions(path=paths):
        name = dist.metadata["Name"]
        if name and norm(name) not in UNLOCKED:
            key = norm(name)
            seen.setdefault(key, []).append(dist.version)
            out[key] = dist.version
    twice = {key: versions for key, versions in seen.items() if len(versions) > 1}
    if twice:
        raise RuntimeError(f"{sys.prefix}: distributions installed twice (two dist-info folders; remove the venv and "
                           f"set it up again): {twice}")
    return out


def public(version: str) -> str:
    """The version without its local label: 2.13.0+cpu -> 2.13.0 (a lock pins public versions, so a CPU and a
    CUDA build of one release both satisfy it; which build installs is tools/setup_env.sh's torch step)."""
    return version.split("+", 1)[0]


def read_lock(path: str) -> tuple:
    """(pins, python tag) of a lock file; raises ValueError naming the line of a malformed entry."""
    pins, tag = {}, ""
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if line.startswith("# python "):
                tag = line[2:]
            if not line or line.startswith("#"):
                continue
            name, sep, version = line.partition("==")
            if not sep or not name.strip() or not version.strip():
                raise ValueError(f"{path}:{n}: expected 'name==version', got {line!r}")
            pins[norm(name)] = version.strip()
    return pins, tag


def select(mode: str, mcore: str) -> tuple:
    """(path, complete) of the lock for a set-up, or ('', False) where none fits (mode, megatron-core, Python)."""
    name, complete = SELECT.get((mode, mcore), ("", False))
    if not name:
        return "", False
    path = os.path.join(LOCK_DIR, f"{name}.txt")
    if not os.path.exists(path):
        return "", False
    _, tag = read_lock(path)
    if tag != python_tag():
        return "", False
    return path, complete


def differences(pins: dict, have: dict, complete: bool) -> list:
    """Lines naming each locked distribution whose installed version differs (or, complete, that is missing)."""
    out = []
    for name, want in sorted(pins.items()):
        got = have.get(name)
        if got is None:
            if complete and name not in OPTIONAL:
                out.append(f"{name}: locked {want}, not installed")
        elif got != want and public(got) != want:
            out.append(f"{name}: locked {want}, installed {got}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("select")
    s.add_argument("mode", nargs="?", default="")
    s.add_argument("mcore", nargs="?", default="")
    c = sub.add_parser("check")
    c.add_argument("lock")
    c.add_argument("--complete", action="store_true", help="every locked distribution must be installed")
    w = sub.add_parser("write")
    w.add_argument("lock")
    w.add_argument("--name", required=True, help="the set-up it locks (written into the header)")
    d = sub.add_parser("diff")
    d.add_argument("lock")
    a = ap.parse_args(argv)
    if a.cmd == "select":
        path, complete = select(a.mode, a.mcore)
        print(f"{'complete' if complete else 'subset'} {path}" if path else "")
        return 0
    if a.cmd == "write":
        have = installed()
        os.makedirs(os.path.dirname(os.path.abspath(a.lock)), exist_ok=True)
        with open(a.lock, "w") as fh:
            fh.write(f"# The {a.name} venv's exact distributions, written by tools/lockfile.py write\n"
                     f"# (tools/latest.sh --write-lock; docs/dependencies.md). Do not edit by hand.\n"
                     f"# {python_tag()}\n")
            fh.writelines(f"{name}=={public(version)}\n" for name, version in sorted(have.items()))
        print(f"wrote {a.lock}: {len(have)} distributions")
        return 0
    pins, _ = read_lock(a.lock)
    have = installed()
    if a.cmd == "diff":
        rows = differences(pins, have, complete=True)
        rows += [f"{name}: not in the lock, installed {have[name]}" for name in sorted(set(have) - set(pins))]
        print("\n".join(rows) if rows else f"every distribution as in {a.lock}")
        return 0
    rows = differences(pins, have, a.complete)
    if rows:
        print(f"ERROR: {sys.prefix} differs from the lock {a.lock} (what CI tested):", file=sys.stderr)
        for row in rows:
            print(f"  {row}", file=sys.stderr)
        print("Start the venv over (remove it and rerun the set-up), or MEGATRON_RL_LOCK=none for the newest "
              "versions setup.py admits (untested; docs/dependencies.md).", file=sys.stderr)
        return 1
    print(f"venv matches the lock {os.path.relpath(a.lock)} ({len(pins)} distributions"
          f"{'' if a.complete else ', the ones this set-up installs'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
