"""Actor checkpoints: megatron ``dist_checkpointing`` (torch_dist) for model + optimizer, plus RNG and
loop state — resumable exactly, loadable at a different TP / PP / EP layout (resharding).

``save_checkpoint(root, step, ...)`` writes ``root/iter_NNNNNNN/`` (``dist/``, ``megatron_rl.json``,
``extra_state.pt``, ``rng/``) and ``root/latest`` LAST: a checkpoint without it is incomplete, and a write that
fails on any rank raises ``CheckpointWriteError`` on every rank with ``latest`` left unwritten.
``load_checkpoint`` refuses another model config, reshards another layout and converts another optimizer kind
exactly (``optimizer_state``); RNG states come back only at the same layout. The layout, the resume rules and the
CPU notes: docs/actor.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import warnings
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_rl.actor.chained import torch_optimizers
from megatron_rl.actor.optimizer_chain import chain_problem, requested_keys
from megatron_rl.actor.optimizer_state import (convert_loaded_state, group_changes, group_settings,
                                               impose_group_settings, optimizer_kind, redirect_main_params,
                                               saved_kind)
from megatron_rl.lora.checkpoint import is_adapter_key, lora_meta_problem
from megatron_rl.parallel.groups import ActorGroups
from megatron_rl.platform import checkpoint_writer
from megatron_rl.platform.mcore_version import write_legacy_common_state

__all__ = ["save_checkpoint", "load_checkpoint", "load_model_state", "CheckpointLayoutError", "CheckpointWriteError",
           "resolve_checkpoint_dir", "ensure_adam_state", "LATEST_FILE"]

LATEST_FILE = "latest"
#: How megatron's distributed optimizer lays out its sharded state (ignored by the other optimizers):
#: per parameter, in model space, so it loads at any DP / TP / PP / EP layout (megatron's default
#: ``fully_sharded_model_space`` needs flattened tensors that dist_checkpointing no longer takes). Host memory
#: (``ops.memory.checkpoint_host_bytes``, printed by ``check``): saving gathers the shards on DP rank 0 over the
#: gloo DP group (12 bytes per parameter of its model-parallel shard + the gather's buffers); loading allocates
#: the same 12 bytes per parameter on EVERY rank (each reads every parameter's state and keeps its shard).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                      "distrib_optim_fully_reshardable_mem_efficient": True}
META_FILE = "megatron_rl.json"
FORMAT_VERSION = 1


class CheckpointLayoutError(RuntimeError):
    """A checkpoint that cannot be loaded into this actor (model or layout mismatch)."""


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed on at least one rank (raised on every rank, naming each failure)."""


def _import_dist_checkpointing():
    from megatron.core import dist_checkpointing
    import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401

    checkpoint_writer.install()  # (on CPU, cpu_compat's import hook patched these modules as they loaded)
    return dist_checkpointing


def _layout(parallel_cfg) -> Dict[str, Any]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    d = dict(parallel_cfg.to_dict())
    d["expert_tensor_parallel_size"] = parallel_cfg.etp
    d["world_size"] = world
    return d


def _model_sharded_state_dict(model: Sequence[torch.nn.Module], adapters_only: bool = False) -> Dict[str, Any]:
    """Each chunk's megatron sharded state dict; ``adapters_only`` (a LoRA actor): the adapters' entries alone (the
    frozen base is named and fingerprinted in the metadata instead)."""
    def one(chunk):
        sd = chunk.module.sharded_state_dict()
        return {k: v for k, v in sd.items() if is_adapter_key(k)} if adapters_only else sd

    if len(model) == 1:
        return {"model": one(model[0])}
    return {f"model{i}": one(chunk) for i, chunk in enumerate(model)}


def _load_model_chunks(model: Sequence[torch.nn.Module], loaded: Dict[str, Any], adapters_only: bool, d: str) -> None:
    """Each chunk's part of ``loaded`` (keyed as ``_model_sharded_state_dict``), strictly; ``adapters_only``: the
    frozen base stays as loaded and a missing adapter or unexpected key raises, naming the checkpoint ``d``."""
    for i, chunk in enumerate(model):
        key = "model" if len(model) == 1 else f"model{i}"
        res = chunk.module.load_state_dict(loaded[key], strict=not adapters_only)
        lost = [k for k in res.missing_keys if is_adapter_key(k)] + list(res.unexpected_keys)
        if adapters_only and lost:
            raise CheckpointLayoutError(f"checkpoint {d}: adapters not loaded: {lost[:5]}")


def _rng_state() -> Dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "tracker": get_cuda_rng_tracker().get_states()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a megatron dependency
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _load_dist(dcp, sd: dict, path: str, to_weights: bool) -> dict:
    """megatron's ``dist_checkpointing.load`` of ``sd``; ``to_weights``: the same saved tensors as bf16 model weights
    and as fp32 main parameters, one load per dtype."""
    if not to_weights:
        return dcp.load(sd, path)
    loaded = dcp.load({k: v for k, v in sd.items() if k != "optimizer"}, path)
    loaded.update(dcp.load({"optimizer": sd["optimizer"]}, path))
    return loaded


def _optimizer_classes(optimizer) -> list:
    """The optimizer classes megatron's HybridDeviceOptimizer (``actor.optimizer_cpu_offload``) writes into its param
    groups, hence into the checkpoint's common state: torch's weights-only loader must be allowed them, whether or
    not this run offloads (megatron's choices: torch's AdamW / SGD on the CPU, its ``Adam`` / ``SGD`` on the
    device; and those of this run's optimizer)."""
    import megatron.core.optimizer as mcore_optimizer

    out = [torch.optim.AdamW, torch.optim.SGD, mcore_optimizer.Adam, mcore_optimizer.SGD]
    for opt in filter(None, torch_optimizers(optimizer)):
        for key in ("cpu_optimizer_cls", "gpu_optimizer_cls"):
            cls = getattr(opt, "defaults", {}).get(key)
            if isinstance(cls, type) and cls not in out:
                out.append(cls)
    return out


def ensure_adam_state(optimizer) -> int:
    """Give every parameter without optimizer state the state a fresh Adam starts from (zero moments,
    step 0), so a checkpoint saved before the first step has a complete optimizer entry (megatron's
    loader otherwise fails on the missing keys). Resuming from it is identical to a fresh optimizer.
    Returns the number of parameters initialised."""
    n = 0
    for opt in filter(None, torch_optimizers(optimizer)):
        # megatron's HybridDeviceOptimizer (actor.optimizer_cpu_offload): the state is kept for its own fp32 copy of
        # each parameter (on the host when offloaded), which its state names "master_param"
        inner = getattr(opt, "param_to_inner_param", None)
        fresh = 0
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    main = p if inner is None else inner[p]
                    opt.state[p]["step"] = torch.tensor(0.0, dtype=torch.float32)
                    opt.state[p]["exp_avg"] = torch.zeros_like(main.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(main.data)
                    if inner is not None:
                        opt.state[p]["master_param"] = main
                    fresh += 1
        if inner is not None and fresh:
            opt._sync_hdo_state_to_sub_optimizers()  # its CPU / device optimizers hold the state it steps
        n += fresh
    return n


def _restore_zero_steps(obj) -> None:
    """megatron saves the Adam step as ``common_step`` only ``if step:`` — a step of 0 (checkpoint taken
    before the first update) is dropped and torch's Adam then refuses the state (KeyError 'step').
    Put ``common_step = 0`` back into every loaded torch-optimizer state dict that lacks it."""
    if isinstance(obj, dict):
        state = obj.get("state")
        if isinstance(state, dict) and "param_groups" in obj:
            per_param = [v for k, v in state.items() if k != "common_step" and isinstance(v, dict)]
            if "common_step" not in state and any("step" not in v for v in per_param):
                state["common_step"] = torch.tensor(0.0, dtype=torch.float32)
            return
        for v in obj.values():
            _restore_zero_steps(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _restore_zero_steps(v)


def _iter_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{int(step):07d}")


def resolve_checkpoint_dir(path: str) -> str:
    """``path`` itself if it is an ``iter_*`` checkpoint, else the one named by ``path/latest``."""
    if os.path.isfile(os.path.join(path, META_FILE)):
        return path
    latest = os.path.join(path, LATEST_FILE)
    if not os.path.isfile(latest):
        raise FileNotFoundError(f"no checkpoint at {path!r}: neither {META_FILE} nor a '{LATEST_FILE}' file "
                                f"(an interrupted save leaves no '{LATEST_FILE}')")
    with open(latest) as fh:
        step = int(fh.read().strip())
    d = _iter_dir(path, step)
    if not os.path.isfile(os.path.join(d, META_FILE)):
        raise FileNotFoundError(f"{latest} names step {step} but {d}/{META_FILE} is missing")
    return d


def save_checkpoint(root: str, step: int, model: Sequence[torch.nn.Module], optimizer, groups: ActorGroups,
                    model_cfg, parallel_cfg, extra_state: Dict[str, Any], lora: Optional[Dict[str, Any]] = None) -> str:
    """Collective: write model + optimizer (dist_checkpointing), RNG (per rank), metadata and
    ``extra_state`` (rank 0) for ``step`` under ``root``; ``root/latest`` is updated last. Returns the
    iteration directory. ``lora`` (a LoRA actor: its ``actor.lora`` and base record): only the adapters of the
    model are written, ``lora`` goes into the metadata."""
    dcp = _import_dist_checkpointing()
    rank = dist.get_rank()
    d = _iter_dir(root, step)
    if rank == 0:
        os.makedirs(os.path.join(d, "dist"), exist_ok=True)
        os.makedirs(os.path.join(d, "rng"), exist_ok=True)
    dist.barrier()
    ensure_adam_state(optimizer)
    sd = _model_sharded_state_dict(model, adapters_only=lora is not None)
    sd["optimizer"] = optimizer.sharded_state_dict(dict(sd), metadata=OPTIMIZER_METADATA)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException subclass

    try:
        dcp.save(sd, os.path.join(d, "dist"))
        error = None
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - gathered and raised on every rank
        # (this rank's own writer error, or what megatron raised here because another rank failed)
        error = (checkpoint_writer.last_write_error(), f"rank {rank}: {type(exc).__name__}: {exc}")
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e is not None]
    if failed:
        causes = [own for own, _ in failed if own] or [seen for _, seen in failed]
        raise CheckpointWriteError(f"checkpoint step {step} under {root} was not written ({len(causes)} of "
                                   f"{len(errors)} ranks failed to write): " + "; ".join(causes))
    torch.save(_rng_state(), os.path.join(d, "rng", f"rank_{rank:05d}.pt"))
    if rank == 0:
        write_legacy_common_state(os.path.join(d, "dist"))  # 0.19 writes no common.pt; 0.16 needs it
        torch.save(dict(extra_state), os.path.join(d, "extra_state.pt"))
        meta = {"format_version": FORMAT_VERSION, "step": int(step), "layout": _layout(parallel_cfg),
                "model": dataclasses.asdict(model_cfg), "bf16": _is_bf16(model)}
        if lora is not None:
            meta["lora"] = lora
        with open(os.path.join(d, META_FILE), "w") as fh:
            json.dump(meta, fh, indent=2, sort_keys=True, default=str)
    dist.barrier()
    if rank == 0:
        tmp = os.path.join(root, LATEST_FILE + ".tmp")
        with open(tmp, "w") as fh:
            fh.write(str(int(step)))
        os.replace(tmp, os.path.join(root, LATEST_FILE))
    dist.barrier()
    return d


def _is_bf16(model: Sequence[torch.nn.Module]) -> bool:
    """The actor's parameters are bf16 (``actor.bf16``; an fp32 output layer does not change that)."""
    return any(p.dtype == torch.bfloat16 for chunk in model for p in chunk.parameters())


def _check_precision(meta: Dict[str, Any], model: Sequence[torch.nn.Module], where: str) -> None:
    """A bf16 checkpoint (fp32 main parameters in its optimizer part) cannot load into an fp32 actor; checkpoints
    written before the ``bf16`` entry existed are fp32 ones."""
    if meta.get("bf16", False) and not _is_bf16(model):
        raise CheckpointLayoutError(
            f"checkpoint {where} was written by a bf16 actor (actor.bf16: true); loading it into an fp32 actor is not "
            f"supported: set actor.bf16: true, or export it (megatron-rl convert mcore-to-hf) and start from that")


def _check_model(saved: Dict[str, Any], model_cfg, where: str) -> None:
    current = json.loads(json.dumps(dataclasses.asdict(model_cfg), default=str))
    diff = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    if diff:
        raise CheckpointLayoutError(f"checkpoint {where}: model config differs from the actor's in "
                                    + ", ".join(f"{k} (saved {saved.get(k)!r}, now {current.get(k)!r})" for k in diff))


def _read_meta(path: str, model_cfg) -> Tuple[str, Dict[str, Any]]:
    """The checkpoint directory of ``path`` and its meta file, checked: this code's format, ``model_cfg``'s shapes."""
    d = resolve_checkpoint_dir(path)
    with open(os.path.join(d, META_FILE)) as fh:
        meta = json.load(fh)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointLayoutError(f"checkpoint {d}: format_version {meta.get('format_version')!r}, "
                                    f"this code reads {FORMAT_VERSION}")
    _check_model(meta["model"], model_cfg, d)
    return d, meta


def load_checkpoint(path: str, model: Sequence[torch.nn.Module], optimizer, groups: ActorGroups, model_cfg,
                    parallel_cfg, lora: Optional[Dict[str, Any]] = None
                    ) -> Tuple[int, Dict[str, Any], Dict[str, Tuple[Any, Any]]]:
    """Collective: restore model, optimizer and (same layout only) RNG from ``path`` (a root with
    ``latest`` or an ``iter_*`` directory). The optimizer may be of another kind than the one that saved
    (``actor.use_distributed_optimizer`` / ``actor.bf16`` switched: converted exactly, ``optimizer_state``); the
    param groups keep this run's settings. Returns (step, extra_state, {setting: (checkpoint's, this run's)} of the
    param-group settings that differed). ``lora``: as ``save_checkpoint``'s; the checkpoint must be a LoRA one of the
    same adapters on the same base (``lora.checkpoint.lora_meta_problem``), and only the adapters are loaded."""
    dcp = _import_dist_checkpointing()
    d, meta = _read_meta(path, model_cfg)
    _check_precision(meta, model, d)
    problem = lora_meta_problem(meta.get("lora"), lora)
    if problem:
        raise CheckpointLayoutError(f"checkpoint {d}: {problem}")
    saved_layout, now_layout = meta["layout"], _layout(parallel_cfg)
    sd = _model_sharded_state_dict(model, adapters_only=lora is not None)
    ensure_adam_state(optimizer)  # the distributed optimizer describes its state from existing Adam state
    settings = group_settings(optimizer)  # this run's config (torch's load_state_dict restores the checkpoint's)
    sd["optimizer"] = optimizer.sharded_state_dict(dict(sd), is_loading=True, metadata=OPTIMIZER_METADATA)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException subclass

    try:
        saved_keys = set(dcp.load_tensors_metadata(os.path.join(d, "dist")))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - re-raised with the checkpoint named
        raise CheckpointLayoutError(f"checkpoint {d}: reading its metadata failed: {type(exc).__name__}: "
                                    f"{exc}") from exc
    problem = chain_problem(requested_keys(sd["optimizer"]), saved_keys, saved_layout.get("expert_model_parallel_size"),
                            now_layout.get("expert_model_parallel_size"))
    problems = [None] * dist.get_world_size()  # agreed: a rank that sees none (a stage without experts) must not
    dist.all_gather_object(problems, problem)  # enter the collective load alone
    problem = next((p for p in problems if p), None)
    if problem:
        raise CheckpointLayoutError(f"checkpoint {d}: {problem}")
    saved, now = saved_kind(saved_keys), optimizer_kind(optimizer)
    to_weights, missing = redirect_main_params(sd["optimizer"], saved_keys, weights_are_fp32=not meta.get("bf16"))
    if missing:
        raise CheckpointLayoutError(
            f"checkpoint {d}: {len(missing)} fp32 main parameters are not in it (e.g. {missing[0]}; saved by a "
            f"{saved!r} optimizer, loading into a {now!r} one); their bf16 model weights are no substitute "
            f"(actor.use_distributed_optimizer / actor.bf16 as when it was saved load it as it is)")
    try:
        with torch.serialization.safe_globals(_optimizer_classes(optimizer)):
            loaded = _load_dist(dcp, sd, os.path.join(d, "dist"), to_weights)
        convert_loaded_state(loaded["optimizer"], saved, now)
        saved_settings = impose_group_settings(loaded["optimizer"], now, settings)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - re-raised with the layouts named
        raise CheckpointLayoutError(
            f"checkpoint {d}: loading failed (saved layout {saved_layout}, requested layout {now_layout}; "
            f"optimizer saved {saved!r}, loading {now!r}): {type(exc).__name__}: {exc}") from exc
    _load_model_chunks(model, loaded, lora is not None, d)
    _restore_zero_steps(loaded["optimizer"])
    optimizer.load_state_dict(loaded["optimizer"])
    changes = group_changes(saved_settings, settings)
    same = {k: v for k, v in saved_layout.items()} == now_layout
    rng_file = os.path.join(d, "rng", f"rank_{dist.get_rank():05d}.pt")
    if same and os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    elif not same:
        warnings.warn(f"checkpoint {d}: layout changed ({saved_layout} -> {now_layout}); model and optimizer "
                      f"resharded, RNG states not restored", stacklevel=2)
    extra = torch.load(os.path.join(d, "extra_state.pt"), weights_only=False)
    return int(meta["step"]), extra, changes


def load_model_state(path: str, model: Sequence[torch.nn.Module], model_cfg, lora: Optional[Dict[str, Any]] = None
                     ) -> int:
    """Collective: the model part alone of ``path`` (a LoRA checkpoint: its adapters, checked as by
    ``load_checkpoint``), at any TP / PP / EP layout -- also across expert_model_parallel_size 1 <-> > 1, whose
    optimizer layouts differ (``optimizer_chain``). The optimizer state, RNG and loop state are not read. fp32 only:
    a bf16 checkpoint's exact values are its optimizer's fp32 main parameters, and a bf16 actor's main parameters
    would keep their old values. Returns the checkpoint's step."""
    dcp = _import_dist_checkpointing()
    d, meta = _read_meta(path, model_cfg)
    if meta.get("bf16", False) or _is_bf16(model):
        raise CheckpointLayoutError(f"checkpoint {d}: a model-only load needs an fp32 checkpoint and actor "
                                    f"(actor.bf16 false; saved bf16={bool(meta.get('bf16', False))}, actor "
                                    f"bf16={_is_bf16(model)}): the exact bf16-run values are the optimizer's main "
                                    f"parameters")
    problem = lora_meta_problem(meta.get("lora"), lora)
    if problem:
        raise CheckpointLayoutError(f"checkpoint {d}: {problem}")
    sd = _model_sharded_state_dict(model, adapters_only=lora is not None)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException subclass

    try:
        loaded = dcp.load(sd, os.path.join(d, "dist"))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - re-raised with the layouts named
        raise CheckpointLayoutError(f"checkpoint {d}: loading its model state failed (saved layout {meta['layout']}): "
                                    f"{type(exc).__name__}: {exc}") from exc
    _load_model_chunks(model, loaded, lora is not None, d)
    return int(meta["step"])
