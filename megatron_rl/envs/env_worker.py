"""``python -m megatron_rl.envs.env_worker``: one environment worker process of ``envs/pool.EnvPool``.

``EnvHost`` holds the environments of one process, one per trajectory key, and answers requests with plain
data, never raising for an environment's fault; ``main`` serves it over stdin / stdout (the pool's
``workers=0`` mode uses ``EnvHost`` in-process).

Protocol: length-prefixed pickles (``tasks/reward_pool.write_frame`` / ``read_frame``). The parent first writes
``(spec, env_kwargs)``; the worker loads the class and writes ``"ready"`` or ``("error", message)``. Then, one
request at a time, ``(op, key, payload)`` with op ``"reset"`` (payload: the sample), ``"step"`` (payload: the
action text) or ``"release"`` (key: a list of keys) is answered with ``("ok", EnvStep or None)`` or
``("fail", kind, message)``. Anything environments print goes to stderr (stdout carries only the protocol). The
worker exits when stdin closes.
"""
from __future__ import annotations

import traceback
from typing import Any, Dict, Hashable, Tuple

from megatron_rl.envs.base import Environment, check_env_step, load_env_class
from megatron_rl.worker_pipes import read_frame, worker_streams, write_frame


def _last_line(e: BaseException) -> str:
    """The last line of ``e``'s traceback (``"ValueError: boom"``)."""
    return traceback.format_exception_only(type(e), e)[-1].strip()


class EnvHost:
    """The environments of one process, keyed by trajectory (see the module docstring)."""

    def __init__(self, spec: str, env_kwargs: Dict[str, Any]):
        """Load ``spec``'s class (``ValueError`` naming ``multi_turn.env``); environments are made at reset."""
        self.spec = spec
        self.env_kwargs = dict(env_kwargs)
        self.cls = load_env_class(spec)
        self.envs: Dict[Hashable, Environment] = {}

    def handle(self, op: str, key: Any, payload: Any) -> Tuple:
        """Answer one request: ``("ok", value)`` or ``("fail", kind, message)``."""
        if op == "release":
            for k in key:
                self.envs.pop(k, None)
            return ("ok", None)
        where = f"{self.spec} (trajectory {key!r})"
        if op == "reset":
            self.envs.pop(key, None)
            try:
                env = self.cls(**self.env_kwargs)
                env.reset(payload)
            except Exception as e:  # noqa: BLE001 - an environment's fault is an answer, not a crash
                return ("fail", "env_exception", f"{where}: reset raised {_last_line(e)}")
            self.envs[key] = env
            return ("ok", None)
        if op == "step":
            env = self.envs.get(key)
            if env is None:
                return ("fail", "env_exception", f"{where}: step before reset (no environment for this key)")
            try:
                value = env.step(payload)
            except Exception as e:  # noqa: BLE001
                self.envs.pop(key, None)
                return ("fail", "env_exception", f"{where}: step raised {_last_line(e)}")
            try:
                result = check_env_step(value)
            except (TypeError, ValueError) as e:
                self.envs.pop(key, None)
                return ("fail", "env_garbage", f"{where}: {e}")
            if result.done:
                self.envs.pop(key, None)
            return ("ok", result)
        raise ValueError(f"unknown environment worker request {op!r}")


def main() -> None:
    """Load the environment class, then serve requests until stdin closes."""
    proto_in, proto_out = worker_streams()  # prints of user environments go to stderr
    try:
        spec, env_kwargs = read_frame(proto_in)
    except EOFError:
        return
    try:
        host = EnvHost(spec, env_kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        write_frame(proto_out, ("error", str(e) if isinstance(e, ValueError) else _last_line(e)))
        return
    write_frame(proto_out, "ready")
    while True:
        try:
            op, key, payload = read_frame(proto_in)
        except EOFError:
            return
        write_frame(proto_out, host.handle(op, key, payload))


if __name__ == "__main__":
    main()
