"""The one place ``rollout.engine`` (a config string) becomes an engine class, and a job's engine is built.

``engine_class(kind)`` works before anything is built: config validation and the trainer's start-up read an
engine's declared capabilities from it (``sync_capabilities``: a ``weight_sync.endpoint.SyncCapabilities``;
``seeded_sampling``; ``base.RolloutEngine``) instead of comparing strings.

Usage::

    cls = engine_class(cfg.rollout.engine)               # ValueError naming rollout.engine if unknown
    mode = cls.sync_capabilities.default(async_rollouts=cfg.rollout.mode == "async")
    engine, server = plan.build_engine()                  # rank 0 (the job plan passes the sections); + server
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_rl.rollout.base import RolloutEngine
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.rollout.sglang_engine import RetryPolicy, SGLangEngine
from megatron_rl.rollout.sglang_lora_flags import adapter_lora, sglang_lora_args
from megatron_rl.rollout.sglang_routing import SGLangRoutingLayout
from megatron_rl.rollout.sglang_server import COLOCATED_CUDA_MEM_FRACTION, launch_sglang_server

#: ``rollout.engine`` value -> engine class.
_ENGINES: dict[str, type[RolloutEngine]] = {"embedded": EmbeddedEngine, "sglang": SGLangEngine}

#: The values ``rollout.engine`` may take.
ENGINE_KINDS = tuple(_ENGINES)


def engine_class(kind: str) -> type[RolloutEngine]:
    """The engine class of ``rollout.engine`` value ``kind``; ``ValueError`` naming ``rollout.engine`` otherwise."""
    try:
        return _ENGINES[kind]
    except (KeyError, TypeError):
        raise ValueError(f"rollout.engine: {kind!r} is not one of {', '.join(ENGINE_KINDS)}") from None


def build_engine(rollout, load_hf: Optional[str], seed: int, run_dir: str, capture_routing: bool = False,
                 lora=None):
    """Rank 0's rollout engine for the ``rollout:`` section and the handle of the SGLang server it started
    (``rollout.sglang_launch``; None otherwise) — the caller terminates it when training ends. ``load_hf``: the
    checkpoint it serves (``actor.load_hf``); ``seed``: ``trainer.seed``; ``run_dir``: where a launched server logs;
    ``capture_routing``: every rollout must carry the engine's MoE routing (the job's replay mode says so: r3);
    ``lora``: the job's ``actor.lora`` (adapter-only sync to SGLang: a launched server gets its LoRA flags, and
    each version's adapter is written under ``<weight_sync dir>/lora_adapters``)."""
    if engine_class(rollout.engine) is EmbeddedEngine:
        return EmbeddedEngine(load_hf, dtype=rollout.dtype, seed=seed), None
    urls = list(rollout.sglang_urls)
    server = None
    adapter = adapter_lora(lora, rollout)
    # the disk exports' directory (WeightSyncSettings.export_dir), which the servers read too
    adapter_dir = None if adapter is None else os.path.join(
        rollout.weight_sync_dir or os.path.join(run_dir, "weight_sync"), "lora_adapters")
    if rollout.sglang_launch:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        os.makedirs(run_dir, exist_ok=True)
        server = launch_sglang_server(load_hf, port=rollout.sglang_port, device=device,
                                      mem_fraction_static=COLOCATED_CUDA_MEM_FRACTION if device == "cuda" else None,
                                      log_path=os.path.join(run_dir, "sglang_server.log"),
                                      delta_loader=rollout.weight_sync_delta,
                                      extra_args=() if adapter is None else sglang_lora_args(adapter, device))
        urls.append(server.url)
    try:
        layout = SGLangRoutingLayout.from_hf_dir(load_hf) if capture_routing and load_hf else None
        engine = SGLangEngine(urls, request_timeout=rollout.request_timeout_s,
                              weight_sync_timeout=rollout.weight_sync_timeout_s,
                              retry=RetryPolicy(max_attempts=rollout.max_retries + 1), weight_version="step-0",
                              capture_routing=True if capture_routing else None, routing_layout=layout,
                              lora_adapter_dir=adapter_dir)
    except BaseException:
        if server is not None:
            server.terminate()
        raise
    return engine, server
