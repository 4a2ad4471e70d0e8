"""Reference pieces of the LoRA merge / sync / export tests: random full adapters, the single-process fp32 merge, and
one rank of an adapted live model (``run_ranks``)."""
from __future__ import annotations

import torch

from megatron_rl.convert import storage
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.live import iter_hf_tensors, load_full_state_dict_into_model
from megatron_rl.convert.mapping import param_rules
from megatron_rl.lora.layers import COLUMN, ROW, lora_class
from megatron_rl.models import build_gpt_model
from megatron_rl.parallel import ParallelConfig, initialize_model_parallel
from megatron_rl.parallel.groups import ActorGroups
from megatron_rl.testing.actor_reference import hf_model_config
from megatron_rl.weight_sync.lora_sync import LoraSync

__all__ = ["TARGETS", "RANK", "ALPHA", "full_adapters", "reference_merge", "adapted_model_outputs"]

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
RANK, ALPHA = 4, 8.0


def full_adapters(geom: HFGeometry, seed: int) -> dict:
    """Random full (TP1 / EP1) A and B of every targeted module of ``geom`` (B non-zero)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for r in param_rules(geom):
        name = r.mcore_name
        if name.endswith(".weight") and name[:-len(".weight")].rsplit(".", 1)[-1] in TARGETS:
            o, i = r.mcore_shape
            out[name[:-len(".weight")] + ".lora_A.weight"] = torch.randn(RANK, i, generator=g) / i ** 0.5
            out[name[:-len(".weight")] + ".lora_B.weight"] = torch.randn(o, RANK, generator=g) * 0.2
    return out


def reference_merge(full: dict, adapters: dict, scale: float) -> dict:
    """Single process, fp32: W + scale * sum_k B[:, k] A[k, :] in k order for every adapted W."""
    out = dict(full)
    for name, a in adapters.items():
        if name.endswith(".lora_A.weight"):
            p = name[:-len(".lora_A.weight")]
            b = adapters[p + ".lora_B.weight"]
            delta = torch.zeros(b.shape[0], a.shape[1])
            for k in range(a.shape[0]):
                delta = delta + torch.outer(b[:, k], a[k])
            out[p + ".weight"] = full[p + ".weight"].float() + scale * delta
    return out


def adapted_model_outputs(rank, world, hf_dir, full, pcfg_kw, tokens):
    """One rank (``run_ranks``): build the model of ``hf_dir`` at ``pcfg_kw``, adapt every ``TARGETS`` module
    (``lora.layers``), load ``full`` (base + adapters, cut by ``convert.partition``) and return (the HF tensors
    this rank owns in a sync, bf16 via the merged view; the whole merged fp32 HF state dict on rank 0; the
    logits ``[B, S, vocab]`` of ``tokens``)."""
    pcfg = ParallelConfig(**pcfg_kw)
    mcfg = hf_model_config(hf_dir)
    initialize_model_parallel(pcfg, seed=3, model=mcfg)
    chunks = build_gpt_model(mcfg, pcfg)
    groups = ActorGroups.from_parallel_state(sequence_parallel=pcfg.sequence_parallel)
    for name, m in chunks[0].named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            kind = ROW if name.endswith(("linear_proj", "linear_fc2")) else COLUMN
            tp = 1 if m.tp_group is None else torch.distributed.get_world_size(m.tp_group)
            o, i = m.weight.shape
            m.__class__ = lora_class(type(m), kind)
            m.attach(RANK, ALPHA / RANK, 0.0, torch.zeros(RANK, i * (tp if kind == ROW else 1)), 0)
    load_full_state_dict_into_model(chunks, full, mcfg, groups)  # cuts A / B like their base (param_kind)
    geom = HFGeometry.from_hf_config(storage.read_hf_config(hf_dir))
    view = LoraSync("merged", RANK, ALPHA).view()
    owned = {n: t.to(torch.bfloat16) for n, t in iter_hf_tensors(chunks, mcfg, geom, groups, owner_only=True,
                                                                  gather_dtype=torch.bfloat16, view=view)}
    fp32 = {n: t.clone() for n, t in iter_hf_tensors(chunks, mcfg, geom, groups, view=view)}
    with torch.no_grad():
        chunks[0].eval()
        pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
        logits = chunks[0](tokens, pos, None)
        if groups.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(groups.tp_size)]
            torch.distributed.all_gather(parts, logits.contiguous(), group=groups.tp_group)
            logits = torch.cat(parts, -1)
    return owned, (fp32 if rank == 0 else None), logits[..., :geom.vocab_size]
