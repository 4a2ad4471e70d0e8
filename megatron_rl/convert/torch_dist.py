"""Read the model weights of a megatron ``dist_checkpointing`` (``torch_dist``) checkpoint in one process.

A torch_dist checkpoint stores *global* tensors (independent of the TP/PP/EP layout it was saved
with) through ``torch.distributed.checkpoint``; this module reads only the model tensors (optimizer
state and ``_extra_state`` are skipped) without a process group and turns megatron's sharded-state-
dict keys into the full local-spec state dict the rest of the converter uses. Key forms handled
(observed with megatron-core 0.16.1, local and TE specs):

  * ``decoder.layers.<param>`` with a leading layer axis [num_layers, ...] (homogeneous dense
    blocks) or ``decoder.layers.<L>.<param>`` per layer (MoE blocks);
  * ``...mlp.experts.experts.linear_fc{1,2}.weight`` with a leading expert axis [num_experts, ...]
    (SequentialMLP) -> ``mlp.experts.local_experts.<e>.linear_fc{1,2}.weight``;
  * TE-style fused norm names (``self_attention.linear_qkv.layer_norm_weight``,
    ``mlp.linear_fc1.layer_norm_weight``) -> ``input_layernorm`` / ``pre_mlp_layernorm``;
  * an optional key prefix (e.g. ``model.``) in front of every model key, detected automatically;
  * padded vocab rows beyond the HF ``vocab_size`` are dropped.

Usage::

    full = read_torch_dist_model_state_dict("ckpt/iter_0000010", geometry)
    export_hf_from_full(full, geometry, "hf_out", assets_dir="original_hf_dir")
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, Optional

import torch

from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.checks import CheckpointMismatchError
from megatron_rl.convert.model_state import canonical_state_dict

Tensor = torch.Tensor

_EMBED = "embedding.word_embeddings.weight"
_STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts\.)experts\.(linear_fc[12]\.(?:lora_[AB]\.)?weight)$")


def is_torch_dist_checkpoint(path: str) -> bool:
    """True when ``path`` holds a megatron dist_checkpointing checkpoint with the torch_dist backend."""
    meta = os.path.join(path, "metadata.json")
    if not os.path.isfile(meta):
        return False
    try:
        with open(meta) as f:
            return json.load(f).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError):
        return False


def _find_prefix(keys, prefix: Optional[str]) -> str:
    if prefix is not None:
        return prefix
    cands = sorted({k[: -len(_EMBED)] for k in keys if k.endswith(_EMBED)}, key=len)
    if not cands:
        raise CheckpointMismatchError(f"torch_dist checkpoint: no '{_EMBED}' tensor (under any prefix) — "
                                      f"is this a model checkpoint? first keys: {sorted(keys)[:8]}")
    return cands[0]


def read_torch_dist_model_state_dict(path: str, geom: HFGeometry, prefix: Optional[str] = None
                                     ) -> Dict[str, Tensor]:
    """Full Megatron state dict (local-spec names, global indices, HF vocab rows) from a torch_dist
    checkpoint directory, read in this process without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not is_torch_dist_checkpoint(path):
        raise CheckpointMismatchError(f"{path}: not a megatron torch_dist checkpoint (metadata.json with "
                                      f"sharded_backend='torch_dist' missing)")
    reader = FileSystemReader(path)
    md = reader.read_metadata().state_dict_metadata
    tensor_keys = [k for k, v in md.items() if isinstance(v, TensorStorageMetadata)]
    pre = _find_prefix(tensor_keys, prefix)
    want = [k for k in tensor_keys if k.startswith(pre) and k[len(pre):].startswith(("embedding.", "decoder.",
                                                                                      "output_layer."))
            and "_extra_state" not in k]
    buf = {k: torch.empty(md[k].size, dtype=md[k].properties.dtype) for k in want}
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(buf, storage_reader=reader, no_dist=not torch.distributed.is_initialized())
    out: Dict[str, Tensor] = {}
    for key, t in buf.items():
        name = key[len(pre):]
        if name.startswith("decoder.layers.") and not name[len("decoder.layers."):][:1].isdigit():
            rest = name[len("decoder.layers."):]
            if t.shape[0] != geom.num_layers:
                raise CheckpointMismatchError(f"torch_dist tensor {key!r}: stacked layer axis {t.shape[0]} != "
                                              f"num_hidden_layers {geom.num_layers}")
            items = {f"decoder.layers.{i}.{rest}": t[i] for i in range(t.shape[0])}
        else:
            items = {name: t}
        for n, v in items.items():
            m = _STACKED_EXPERTS.match(n)
            if m:
                for e in range(v.shape[0]):
                    out[f"{m.group(1)}local_experts.{e}.{m.group(2)}"] = v[e].contiguous()
            else:
                out[n] = v.contiguous()
    full = canonical_state_dict(out)
    for name in (_EMBED, "output_layer.weight"):
        if name in full and full[name].shape[0] > geom.vocab_size:
            full[name] = full[name][: geom.vocab_size].contiguous()
    if geom.tie_word_embeddings and "output_layer.weight" in full:
        # megatron may save the last stage's copy of a tied embedding; HF has none. It must be identical.
        if _EMBED in full and not torch.equal(full[_EMBED], full["output_layer.weight"]):
            raise CheckpointMismatchError("torch_dist checkpoint: tied embeddings but output_layer.weight "
                                          "differs from embedding.word_embeddings.weight")
        del full["output_layer.weight"]
    return full
