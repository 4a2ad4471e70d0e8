"""verl 0.9.1's ``core_algos`` module, run from the unchanged files vendored under ``tests/data/verl/core_algos/``
(README there: the wheel, the licence, the shim). ``load()`` returns the module; ``AlgoCfg`` stands in for verl's
``AlgoConfig`` (attribute and ``.get`` access, as core_algos reads it)."""
from __future__ import annotations

import ast
import importlib.util
import sys
import types
from contextlib import contextmanager
from pathlib import Path

VENDORED = Path(__file__).resolve().parent / "data" / "verl" / "core_algos"
_TF_FUNCS = ("masked_sum", "masked_mean", "masked_var", "masked_whiten", "clip_by_value")


class AlgoCfg(dict):
    """verl's ``AlgoConfig`` as core_algos reads it: ``cfg.gamma`` and ``cfg.get("norm_adv_by_std_in_grpo")``."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(name) from e


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def _torch_functional() -> types.ModuleType:
    """The masked-statistics functions and clip_by_value of the vendored ``torch_functional.py``, their source unchanged."""
    import torch
    src = (VENDORED / "torch_functional.py").read_text()
    tree = ast.parse(src)
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in _TF_FUNCS]
    assert len(keep) == len(_TF_FUNCS), "the vendored torch_functional.py lost one of " + ", ".join(_TF_FUNCS)
    mod = _module("verl.utils.torch_functional", torch=torch)
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(VENDORED / "torch_functional.py"), "exec"), mod.__dict__)
    return mod


def _load_file(name: str, fname: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, VENDORED / fname)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@contextmanager
def verl_core_algos():
    """Context: verl's ``core_algos`` module (and the shim modules in ``sys.modules``, removed afterwards)."""
    names = ["omegaconf", "verl", "verl.utils", "verl.utils.device", "verl.utils.import_utils",
             "verl.utils.groupwise", "verl.utils.torch_functional", "verl.trainer", "verl.trainer.config",
             "verl.trainer.ppo", "verl.trainer.ppo.core_algos", "verl.workers", "verl.workers.config"]
    saved = {n: sys.modules.get(n) for n in names}
    try:
        sys.modules["omegaconf"] = _module("omegaconf", DictConfig=dict)
        for n in ("verl", "verl.trainer", "verl.trainer.ppo", "verl.workers"):
            sys.modules[n] = _module(n)
        sys.modules["verl.utils.device"] = _module("verl.utils.device", get_device_name=lambda: "cpu")
        sys.modules["verl.utils.import_utils"] = _module("verl.utils.import_utils",
                                                         deprecated=lambda *a, **k: (lambda fn: fn))
        sys.modules["verl.trainer.config"] = _module("verl.trainer.config", AlgoConfig=AlgoCfg)
        sys.modules["verl.workers.config"] = _module("verl.workers.config", ActorConfig=AlgoCfg)
        utils = _module("verl.utils")
        sys.modules["verl.utils"] = utils
        gw = _load_file("verl.utils.groupwise", "groupwise.py")
        utils.as_torch_index, utils.group_mean_std = gw.as_torch_index, gw.group_mean_std
        tf = _torch_functional()
        sys.modules["verl.utils.torch_functional"] = tf
        utils.torch_functional = tf
        yield _load_file("verl.trainer.ppo.core_algos", "core_algos.py")
    finally:
        for n in names:
            if saved[n] is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = saved[n]
