"""Runs inside each SGLang server process (one per TP rank): the custom weight loader of delta syncs.

SGLang calls a loader named on its command line (``--custom-weight-loader``; ``SERVER_FLAGS``) when an
``/update_weights_from_tensor`` request names it as ``load_format``: ``loader(model, named_tensors)``. Each of our
requests carries one ``delta.DeltaBucket``: its meta (JSON) as the name, its bytes as the tensor.

The loader keeps, in this process's host memory, the HF tensors of the version the server holds (the engine
dtype): a dense entry replaces a tensor, a sparse one is applied to it (``delta.apply_delta``), and every tensor
of the bucket -- changed or not -- is then handed WHOLE to the model's own ``load_weights``, exactly as a full
sync hands it. The server's weights are therefore those of a full sync bit for bit; only the bytes that
travel are fewer. A delta from a version other than the one this store holds is refused: the request fails, the
sync fails on every trainer rank (``WeightSyncError``; every server is tagged ``sync-failed``) and that ends the
job -- the loop retries nothing. (Rank 0 sends a delta only after every server said it serves the base version,
``DeltaSender.base_for``, so a refusal means a server changed in between.) Only a later sync of the same
``DeltaPublisher``, as the tests make, would be full.

Memory: the whole model's HF tensors (engine dtype) in this process's host memory -- one copy per server TP
process, since each TP process is handed whole tensors and slices them itself (``megatron-rl check`` prints it).
"""
from __future__ import annotations

import json
import threading
from typing import Dict, List, Optional, Tuple

import torch

from megatron_rl.weight_sync.delta import DeltaBucket, apply_delta

__all__ = ["LOADER", "SERVER_FLAGS", "load_weight_delta", "DeltaStore"]

#: The ``load_format`` our requests name (import path of ``load_weight_delta``).
LOADER = f"{__name__}.load_weight_delta"
#: The ``sglang.launch_server`` flags that register it.
SERVER_FLAGS = ("--custom-weight-loader", LOADER)


class DeltaStore:
    """The HF tensors of the version this server process holds, and that version."""

    def __init__(self):
        self.tensors: Dict[str, torch.Tensor] = {}
        self.version: Optional[str] = None
        """The version the tensors are at (or being brought to, until its last bucket)."""
        self.lock = threading.Lock()

    def apply(self, bucket: DeltaBucket) -> List[Tuple[str, torch.Tensor]]:
        """Bring the stored tensors of ``bucket`` to its version; return them (whole) in bucket order."""
        if bucket.version != self.version:
            if bucket.base is not None and bucket.base != self.version:
                raise ValueError(f"delta to {bucket.version!r} is from {bucket.base!r}, but this server's loader "
                                 f"holds {self.version!r}: a full sync is needed")
            self.version = bucket.version
        out = []
        for d in bucket.deltas():
            held = self.tensors.get(d.name)
            if d.kind == "dense":
                if held is None or tuple(held.shape) != tuple(d.shape) or held.dtype != d.dtype:
                    held = self.tensors[d.name] = torch.empty(d.shape, dtype=d.dtype)
                held.copy_(d.values)
            elif held is None:
                raise ValueError(f"delta to {bucket.version!r}: this server's loader holds no {d.name!r} "
                                 f"(a full sync is needed)")
            else:
                apply_delta(held, d)
            out.append((d.name, held))
        return out


_STORE = DeltaStore()


def load_weight_delta(model, named_tensors) -> None:
    """SGLang's custom-loader entry point: ``named_tensors`` = ``[(bucket meta JSON, bucket bytes)]``."""
    with _STORE.lock:
        for meta_json, flat in named_tensors:
            bucket = DeltaBucket.from_meta(json.loads(meta_json), flat.cpu())
            model.load_weights(_STORE.apply(bucket))
