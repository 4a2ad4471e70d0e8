"""Decode SGLang's routed experts (R3 capture) into ``Rollout.routed_experts``.

What SGLang 0.5.23 returns (verified on a CPU server with a tiny Qwen3-MoE, ``tests/integration/test_routing_sglang.py``):
a server started with ``--enable-return-routed-experts`` answers a ``/generate`` request carrying
``"return_routed_experts": true`` with ``meta_info.routed_experts`` = base64 of little-endian int32 expert ids
(``srt/state_capturer/routed_experts.py``, ``extract_routed_experts_from_meta_info``), flattened from
``[prompt + response - 1, num_hidden_layers, topk]``: every token the server fed through the model (the
prompt, then each sampled token but the last: ``req_to_token[0 : seqlen - 1]``), for EVERY decoder layer
(rows of dense layers are never written). This module keeps the MoE layers only (``RoutingSpec.moe_layers``)
and stores them in the compact dtype (uint8 when experts <= 256, else int16) — the layout the embedded engine
produces and ``RolloutBatch.routing`` replays (``megatron_rl.actor.routing``).

Usage::

    layout = SGLangRoutingLayout.from_hf_dir("/ckpt")      # None for dense models
    ids = decode_routed_experts(meta["routed_experts"], n_tokens, layout, where, "response[0].meta_info")
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from megatron_rl.actor.routing import RoutingSpec, routing_dtype
from megatron_rl.convert.hf_config import model_config_from_hf
from megatron_rl.convert.storage import read_hf_config
from megatron_rl.rollout.base import MalformedResponseError

__all__ = ["ROUTED_EXPERTS_FLAG", "SGLangRoutingLayout", "hf_config_is_moe", "decode_routed_experts"]

#: The ``sglang.launch_server`` flag that makes a server capture routed experts.
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"


def hf_config_is_moe(cfg: dict) -> bool:
    """Whether an HF ``config.json`` dict describes an MoE model (routed experts > 0)."""
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        v = cfg.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return True
    return False


@dataclass(frozen=True)
class SGLangRoutingLayout:
    """How one model's routed experts come back from SGLang and which part of them is kept."""

    #: The MoE layers kept (``moe_layers`` index the server's layer axis), experts and top-k.
    spec: RoutingSpec
    #: Decoder layers the server reports per token (``num_hidden_layers``, dense layers included).
    num_layers: int

    @classmethod
    def from_hf_config(cls, cfg: dict) -> Optional["SGLangRoutingLayout"]:
        """The layout of an HF ``config.json`` dict; None for dense models."""
        if not hf_config_is_moe(cfg):
            return None
        model = model_config_from_hf(cfg)
        spec = RoutingSpec.from_model_config(model)
        return None if spec is None else cls(spec=spec, num_layers=int(model.num_layers))

    @classmethod
    def from_hf_dir(cls, path: str) -> Optional["SGLangRoutingLayout"]:
        """The layout of the checkpoint in ``path`` (its ``config.json``); None for dense models."""
        return cls.from_hf_config(read_hf_config(path))

    @property
    def dtype(self) -> torch.dtype:
        """The compact dtype of ``Rollout.routed_experts``."""
        return routing_dtype(self.spec.num_experts)


def decode_routed_experts(value: Any, n_tokens: int, layout: SGLangRoutingLayout, where: str,
                          path: str) -> torch.Tensor:
    """``meta_info.routed_experts`` (base64 int32) -> ``[n_tokens, moe_layers, topk]`` in the compact dtype.

    Args:
        value: the field's value from the reply.
        n_tokens: tokens the server fed through the model (``len(prompt) + len(response) - 1``).
        layout: the model's layout.
        where: names the server in errors.
        path: the JSON path of the reply's ``meta_info`` (errors name ``{path}.routed_experts``).

    Raises:
        MalformedResponseError: the field is missing / not base64 of int32 / of the wrong size for
            ``[n_tokens, num_layers, topk]`` / holds an expert id outside ``[0, num_experts)`` in an MoE layer.
    """
    field = f"{path}.routed_experts"
    spec = layout.spec
    if value is None:
        raise MalformedResponseError(f"{where}: {field} is missing (routing was requested: is the server started "
                                     f"with {ROUTED_EXPERTS_FLAG}?)")
    if not isinstance(value, str):
        raise MalformedResponseError(f"{where}: {field} is {type(value).__name__}, expected a base64 string of "
                                     "int32 expert ids")
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as e:
        raise MalformedResponseError(f"{where}: {field} is not base64 ({e})") from None
    want = (n_tokens, layout.num_layers, spec.topk)
    numel = int(np.prod(want))
    if len(raw) != 4 * numel:
        raise MalformedResponseError(
            f"{where}: {field} holds {len(raw)} bytes = {len(raw) / 4:g} int32 ids, expected {numel} = "
            f"[{n_tokens} tokens (prompt + response - 1), {layout.num_layers} layers, top-{spec.topk}]")
    ids = torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int64).reshape(want))
    ids = ids[:, list(spec.moe_layers)]
    bad = (ids < 0) | (ids >= spec.num_experts)
    if bool(bad.any()):
        t, j, k = (int(x) for x in bad.nonzero()[0])
        raise MalformedResponseError(
            f"{where}: {field}[token {t}, layer {spec.moe_layers[j]}, k {k}] = {int(ids[t, j, k])} is not an "
            f"expert id in [0, {spec.num_experts})")
    return ids.to(layout.dtype)
