"""Run a ``megatron-rl`` subcommand inside the calling process, for tests of what the command prints and returns.

``python -m megatron_rl.cli check ...`` in a new interpreter spends ~10 s of CPU importing torch, transformers and
megatron-core before it reads its config, and the planning itself takes well under a second; the test process
has imported them already. ``run_cli`` calls the console script's own ``main`` (the same parser, the same
subcommand) with the working directory and environment a subprocess would get, and returns what ``subprocess.run``
would: exit code, stdout, stderr. A ``SystemExit`` becomes the exit code, as the interpreter makes it. Tests of the
console script itself (the entry point, interpreter start-up, a broken environment) still start a process.
"""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
from typing import Callable, Mapping, Optional, Sequence

from megatron_rl import cli


def _exit_code(exc: SystemExit, err: io.StringIO) -> int:
    """The status the interpreter exits with for ``exc`` (a message goes to stderr and exits 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    err.write(f"{exc.code}\n")
    return 1


def run_main(main: Callable[[Sequence[str]], Optional[int]], args: Sequence[str], *, cwd: Optional[str] = None,
             env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:
    """``main(args)`` in ``cwd`` with ``env`` as ``os.environ`` (both restored after), stdout and stderr captured."""
    out, err = io.StringIO(), io.StringIO()
    old_cwd, old_env = os.getcwd(), dict(os.environ)
    try:
        if cwd is not None:
            os.chdir(cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = int(main(list(args)) or 0)
            except SystemExit as exc:
                code = _exit_code(exc, err)
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def run_cli(*args: str, cwd: Optional[str] = None,
            env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:
    """``megatron-rl ARGS...`` (e.g. ``run_cli("check", "configs/tiny_cpu.yaml")``), in this process."""
    return run_main(cli.main, args, cwd=cwd, env=env)
