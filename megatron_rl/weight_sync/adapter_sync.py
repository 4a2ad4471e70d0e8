"""Adapter-only LoRA sync (``rollout.lora_sync: adapter``): only A and B reach the engine, tagged with the version.

    payload = adapter_payload(actor, settings, "step-3")   # collective: gathers A / B (+ the trainer's probe)
    payload.apply(engine, settings, "step-3")              # rank 0: load, then compare the engine's probe

Rule: checksums cannot see an unmerged adapter, so a due version is verified by log-probs -- every trainer rank
computes the log-probs of a fixed probe batch at publish time (the version the adapter is), and whoever applies
the payload (now, or the async producer later) compares the engine's log-probs of the same tokens with them.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron_rl.actor.batch import RolloutBatch
from megatron_rl.convert.live import gather_full_state_dict
from megatron_rl.convert.lora_export import peft_adapter_tensors
from megatron_rl.lora.merge import adapter_items
from megatron_rl.parallel.rank0 import is_rank0
from megatron_rl.weight_sync.endpoint import WeightSyncError
from megatron_rl.weight_sync.report import SyncReport
from megatron_rl.weight_sync.settings import WeightSyncSettings
from megatron_rl.weight_sync.versions import parse_version

__all__ = ["PROBE_ROWS", "PROBE_LEN", "probe_sequences", "probe_tolerance", "AdapterPayload", "adapter_payload"]

#: The fixed probe batch: rows x tokens, drawn from a fixed seed over the model's vocabulary.
PROBE_ROWS, PROBE_LEN = 4, 24


def probe_sequences(vocab_size: int, rows: int = PROBE_ROWS, length: int = PROBE_LEN) -> List[List[int]]:
    """The probe token sequences (the same for every version and rank)."""
    g = torch.Generator().manual_seed(48)
    return torch.randint(0, vocab_size, (rows, length), generator=g).tolist()


def probe_tolerance(dtype: Optional[torch.dtype]) -> float:
    """Largest |engine - trainer| log-prob accepted: fp32 engines 1e-3, half-precision ones 0.1 (a forward in bf16
    moves single log-probs by a few 1e-2; a stale or missing adapter moves them by far more)."""
    return 1e-3 if dtype == torch.float32 else 0.1


def _trainer_probe(actor, sequences: List[List[int]]) -> torch.Tensor:
    """Collective: the trainer's log-probs [rows, L-1] of the probe at temperature 1 (each rank: all rows)."""
    batch = RolloutBatch.from_sequences([s[:1] for s in sequences], [s[1:] for s in sequences])
    logp, _ = actor.compute_log_probs(batch, temperature=1.0, compute_entropy=False)
    return logp.detach().float().cpu()


def _engine_probes(engine, probe: List[List[int]]) -> Dict[str, List[List[float]]]:
    """{source: the engine's probe log-probs}: every server of an engine with several, else the engine's own."""
    by_server = getattr(engine, "token_log_probs_by_server", None)
    return by_server(probe) if by_server is not None else {"the engine": engine.token_log_probs(probe)}


class AdapterPayload:
    """A version's adapters under PEFT's names (rank 0), their scale, and the trainer's probe when due."""

    def __init__(self, tensors: Dict[str, torch.Tensor], scale: float, probe: Optional[List[List[int]]],
                 trainer_logp: Optional[torch.Tensor]):
        self.tensors, self.scale, self.probe, self.trainer_logp = tensors, scale, probe, trainer_logp

    def apply(self, engine, settings: WeightSyncSettings, version: str, actor=None) -> SyncReport:
        """Load into ``engine`` tagged ``version``; verify against the trainer's probe when it was taken. A
        mismatch marks the engine invalid and raises ``WeightSyncError`` naming the worst row / token."""
        engine.load_lora_adapter(self.tensors, self.scale, version)
        if self.probe is None:
            return SyncReport()
        tol = probe_tolerance(getattr(engine, "weight_dtype", None))
        for source, logp in _engine_probes(engine, self.probe).items():
            got = torch.tensor(logp, dtype=torch.float32)
            diff = (got - self.trainer_logp[:, : got.shape[1]]).abs()
            if not bool(diff.max() <= tol):
                row, col = divmod(int(diff.argmax()), diff.shape[1])
                reason = (f"adapter-only sync to {version!r}: {source}: the log-probs of the probe differ from "
                          f"the trainer's by {float(diff.max()):.3g} > {tol} (row {row}, token {col + 1})")
                engine.invalidate_weights(reason)
                raise WeightSyncError(reason)
        return SyncReport(verified=True, verified_frac=1.0)  # the probe sees the whole model's output

    def report(self) -> SyncReport:
        return SyncReport(bytes=sum(t.numel() * t.element_size() for t in self.tensors.values()),
                          buckets=1)

    def release(self, keep_versions: set) -> None:
        """Nothing on disk."""


def adapter_payload(actor, settings: WeightSyncSettings, version: str) -> Optional[AdapterPayload]:
    """Collective: the adapters of ``actor`` gathered on rank 0 (full, PEFT names; None elsewhere) and, when
    ``version`` is due for verification, the trainer's probe log-probs."""
    full = gather_full_state_dict(actor.model, actor.model_cfg, actor.groups, view=adapter_items)
    probe = trainer = None
    if version.startswith("step-") and settings.due(parse_version(version)):
        probe = probe_sequences(actor.hf_target.geometry.vocab_size)
        trainer = _trainer_probe(actor, probe)
    if not is_rank0():
        return None
    if not full:
        raise WeightSyncError("rollout.lora_sync: adapter, but the model has no LoRA adapters (actor.lora)")
    return AdapterPayload(peft_adapter_tensors(full, actor.hf_target.geometry), settings.lora.scale, probe,
                          trainer)

