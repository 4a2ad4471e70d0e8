"""The one place ``rollout.engine`` (a config string) becomes an engine class, and a job's engine is built.

``engine_class(kind)`` works before anything is built: config validation and the trainer's start-up read an
engine's declared capabilities from it (``weight_sync_modes``, ``deferred_weight_sync_modes``,
``default_weight_sync_mode``, ``seeded_sampling``; ``base.RolloutEngine``) instead of comparing strings.

Usage::

    cls = engine_class(cfg.rollout.engine)               # ValueError naming rollout.engine if unknown
    mode = cls.default_weight_sync_mode(async_rollouts=cfg.rollout.mode == "async")
    engine, server = build_engine(cfg)                    # rank 0; server: the SGLang server it launched, or None
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from megatron_rl.actor.replay_modes import replay_mode
from megatron_rl.rollout.base import RolloutEngine
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.rollout.sglang_engine import RetryPolicy, SGLangEngine
from megatron_rl.rollout.sglang_routing import SGLangRoutingLayout
from megatron_rl.rollout.sglang_server import COLOCATED_CUDA_MEM_FRACTION, launch_sglang_server

if TYPE_CHECKING:  # config.validate imports this module: a run-time import of the config package would cycle
    from megatron_rl.config.job import JobConfig

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


def build_engine(cfg: JobConfig):
    """Rank 0's rollout engine for ``rollout.engine`` and the handle of the SGLang server it started
    (``rollout.sglang_launch``; None otherwise) — the caller terminates it when training ends."""
    if engine_class(cfg.rollout.engine) is EmbeddedEngine:
        return EmbeddedEngine(cfg.actor.load_hf, dtype=cfg.rollout.dtype, seed=cfg.trainer.seed), None
    urls = list(cfg.rollout.sglang_urls)
    server = None
    if cfg.rollout.sglang_launch:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        os.makedirs(cfg.trainer.run_dir, exist_ok=True)
        server = launch_sglang_server(cfg.actor.load_hf, port=cfg.rollout.sglang_port, device=device,
                                      mem_fraction_static=COLOCATED_CUDA_MEM_FRACTION if device == "cuda" else None,
                                      log_path=os.path.join(cfg.trainer.run_dir, "sglang_server.log"),
                                      delta_loader=cfg.rollout.weight_sync_delta)
        urls.append(server.url)
    try:
        r3 = replay_mode(cfg.actor.routing_replay).needs_rollout_routing  # every server must capture routing
        layout = SGLangRoutingLayout.from_hf_dir(cfg.actor.load_hf) if r3 and cfg.actor.load_hf else None
        engine = SGLangEngine(urls, request_timeout=cfg.rollout.request_timeout_s,
                              weight_sync_timeout=cfg.rollout.weight_sync_timeout_s,
                              retry=RetryPolicy(max_attempts=cfg.rollout.max_retries + 1), weight_version="step-0",
                              capture_routing=True if r3 else None, routing_layout=layout)
    except BaseException:
        if server is not None:
            server.terminate()
        raise
    return engine, server
