"""Adapter-only LoRA sync into SGLang servers (``rollout.lora_sync: adapter``): a PEFT directory per version,
loaded by every server under the version's name.

Rule: a version's adapter is loaded on EVERY server before the previous one is unloaded (generate requests name
the adapter, so a request never runs without one), and the servers' weight version is the adapter's tag. The
directory must be readable by the servers at the same path (same host or a shared file system).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Callable, Mapping, Optional

import torch
from safetensors.torch import save_file

from megatron_rl.weight_sync.endpoint import WeightSyncError

__all__ = ["adapter_config", "write_adapter_dir", "SGLangAdapters"]

_A, _B = ".lora_A.weight", ".lora_B.weight"
_LOG = logging.getLogger(__name__)


def adapter_config(tensors: Mapping[str, torch.Tensor], scale: float) -> dict:
    """PEFT's ``adapter_config.json`` of adapter ``tensors`` (PEFT names, one rank) with scaling ``scale`` =
    alpha / rank: ``r`` from A's rows, ``lora_alpha`` = scale * r, ``target_modules`` the HF module leaf names."""
    ranks = {t.shape[0] for k, t in tensors.items() if k.endswith(_A)}
    if len(ranks) != 1:
        raise WeightSyncError(f"adapter-only sync to SGLang: the adapter's lora_A tensors have ranks {sorted(ranks)} "
                              f"(one rank expected)")
    rank = ranks.pop()
    targets = sorted({k[: -len(_A)].rsplit(".", 1)[-1] for k in tensors if k.endswith(_A)})
    if "experts" in targets or "base_layer" in targets:
        raise WeightSyncError("adapter-only sync to SGLang: routed-expert adapters are not built for SGLang servers "
                              "(use rollout.lora_sync: merged)")
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank), "lora_alpha": float(scale) * rank,
            "lora_dropout": 0.0, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "inference_mode": True}


def _dir_name(version: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", version) or "_"


def write_adapter_dir(root: str, tensors: Mapping[str, torch.Tensor], scale: float, version: str) -> str:
    """Write ``<root>/<version>/`` (``adapter_config.json`` + ``adapter_model.safetensors``); returns its path."""
    cfg = adapter_config(tensors, scale)
    path = os.path.abspath(os.path.join(root, _dir_name(version)))
    os.makedirs(path, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
              os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    return path


#: ``post(url, path, payload)``: one bounded POST that raises ``WeightSyncError`` unless the server succeeded
Post = Callable[[str, str, dict], dict]


class SGLangAdapters:
    """The adapter the servers serve: ``name`` (= its version tag, the ``lora_path`` of generate requests)."""

    def __init__(self, root: str):
        self.root = root
        """Where each version's directory is written (``<rollout.weight_sync_dir>/lora_adapters``)."""
        self.name: Optional[str] = None
        self._dir: Optional[str] = None

    def load(self, urls, post: Post, tensors: Mapping[str, torch.Tensor], scale: float, version: str) -> None:
        """Write the version's directory, load it on every server as ``version``, then unload the previous one
        and delete its directory. On a failure the servers that loaded it unload it again and the previous
        adapter stays the one served; ``WeightSyncError`` names the server. Before this engine's first load (and
        when ``version`` is the one served: a retried sync) a server's adapter of that name -- left by an earlier
        run of the job -- is unloaded first, so the name is free."""
        name = str(version)
        if self.name is None or name == self.name:
            self._unload(urls, post, name, self._dir)
            self.name = self._dir = None
        path = write_adapter_dir(self.root, tensors, scale, name)
        loaded = []
        try:
            for url in urls:
                post(url, "/load_lora_adapter", {"lora_name": name, "lora_path": path})
                loaded.append(url)
        except BaseException:
            self._unload(loaded, post, name, path)
            raise
        old, old_dir = self.name, self._dir
        self.name, self._dir = name, path
        if old is not None:
            missed = self._unload(urls, post, old, old_dir)
            if missed:  # the new adapter is served; the old one only holds server memory (e.g. a restarted server)
                _LOG.warning("adapter-only sync to %r: unloading the previous adapter %r failed: %s", name, old,
                             "; ".join(missed))

    @staticmethod
    def _unload(urls, post: Post, name: str, path: Optional[str]) -> list:
        """Unload ``name`` from ``urls`` and delete ``path``; returns the failures (a server that has no such
        adapter answers with one)."""
        errors = []
        for url in urls:
            try:
                post(url, "/unload_lora_adapter", {"lora_name": name})
            except WeightSyncError as exc:
                errors.append(str(exc))
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
        return errors
