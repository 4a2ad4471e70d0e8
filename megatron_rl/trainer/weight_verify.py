"""Weight-sync verification (rank 0): the engine's own checksums of a sample of ITS tensors — fused, padded and
sharded as the engine holds them (``rollout.weight_layout``) — compared with the same fusion / padding /
sharding of the trainer's tensors, cast to the engine's dtype (tensors the engine keeps in higher precision
stay in their own dtype).

Usage (one ``WeightVerifier`` per sync; ``offer`` every HF tensor of the sync in any order)::

    v = WeightVerifier(engine, hf_names, geometry, k=16, version=3, dtype=torch.bfloat16, keep=set())
    for name, t in stream:
        v.offer(name, t)
    v.check("weight sync to 'step-3'", "the trainer's")   # WeightSyncError naming every tensor that differs
    v.verified_frac                                        # parameters compared / parameters synced

Memory: the HF pieces of a sampled engine tensor are held (cloned) until its last piece arrived — for a
sampled fused expert tensor, the experts of one layer.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from megatron_rl.rollout.base import WeightSyncError

__all__ = ["WeightVerifier", "sample_spread"]


def sample_spread(names: List[str], k: int, version: int) -> List[str]:
    """``k`` names spread evenly over ``names`` (model order, so every stage), rotated by ``version``."""
    if k < 0 or k >= len(names):
        return list(names)
    if k == 0:
        return []
    step = len(names) / k
    return sorted({names[(int(i * step) + version) % len(names)] for i in range(k)}, key=names.index)


class WeightVerifier:
    """See the module doc. ``k`` < 0: every engine tensor the layout maps; 0: none (nothing is checked)."""

    def __init__(self, engine, hf_names: Sequence[str], geometry, k: int, version: int,
                 dtype: Optional[torch.dtype], keep: set):
        self.engine = engine
        self.dtype = dtype
        self.keep = set(keep)
        self.hf_names = set(hf_names)
        # the engine's own hash (SGLang on a GPU: its Triton hash); None: this process cannot reproduce it,
        # so nothing is compared and verified_frac stays 0 (said once per job by ``unverifiable_notice``)
        self.hash = engine.weight_checksum_fn() if k != 0 else None
        layout = engine.weight_layout(list(hf_names), geometry) if self.hash is not None else []
        chosen = set(sample_spread([t.name for t in layout], k, version))
        self.tensors = [t for t in layout if t.name in chosen]
        self.tp_sizes = sorted(set(engine.weight_tp_sizes())) if self.tensors else []
        self._need: Dict[str, int] = {}
        for t in self.tensors:
            for s in t.sources:
                self._need[s] = self._need.get(s, 0) + 1
        self._held: Dict[str, torch.Tensor] = {}
        self._numel: Dict[str, int] = {}
        self.expected: Dict[int, Dict[str, tuple]] = {tp: {} for tp in self.tp_sizes}
        self.verified_frac = 0.0

    def needs(self, name: str) -> bool:
        """Whether ``offer`` must be given the values of HF tensor ``name`` (else its numel is enough)."""
        return name in self._need

    def count(self, name: str, numel: int) -> None:
        """Count a synced HF tensor that is not needed (for ``verified_frac``)."""
        self._numel[name] = int(numel)

    def offer(self, name: str, t: torch.Tensor) -> None:
        """One synced HF tensor (any dtype: cast here as the engine casts it)."""
        self._numel[name] = t.numel()
        if name not in self._need:
            return
        if self.dtype is not None and t.is_floating_point() and name not in self.keep:
            t = t.to(self.dtype)
        self._held[name] = t.detach().clone()
        for et in self.tensors:
            if name in et.sources and all(s in self._held for s in et.sources):
                for tp in self.tp_sizes:
                    self.expected[tp][et.name] = tuple(self.hash(et.shard(self._held, r, tp))
                                                       for r in range(tp))
                for s in et.sources:
                    self._need[s] -= 1
                    if self._need[s] == 0:
                        del self._need[s], self._held[s]

    def check(self, what: str, source_text: str) -> List[str]:
        """Compare with the engine's checksums (every server, every TP rank); a mismatch raises
        ``WeightSyncError`` naming each engine tensor, its HF sources and the TP rank. Returns the engine
        tensor names compared and sets ``verified_frac``."""
        names = [t.name for t in self.tensors if t.name in self.expected[self.tp_sizes[0]]] if self.tensors else []
        if not names:
            return []
        srcs = {t.name: t.sources for t in self.tensors}
        got = self.engine.weight_checksums(names)
        bad = []
        for server, sums in got.items():
            for n in names:
                have = tuple(sums.get(n) or ())
                want = self.expected.get(len(have)) if have else None
                if want is None:
                    bad.append(f"{n} on {server}: no checksum of its {len(have)} TP shard(s) expected")
                    continue
                for r, (a, b) in enumerate(zip(want[n], have)):
                    if a != b:
                        parts = [] if srcs[n] == (n,) else ["from " + " + ".join(srcs[n])]
                        parts += [f"TP rank {r}"] if len(have) > 1 else []
                        parts += [f"on {server}"] if len(got) > 1 else []
                        bad.append(f"{n} ({', '.join(parts + [f'expected {a}, engine {b}'])})")
        if bad:
            raise WeightSyncError(f"{what}: verification failed, the engine's copy of {len(bad)} tensor(s) differs "
                                  f"from {source_text}: " + "; ".join(bad))
        total = sum(self._numel.get(n, 0) for n in self.hf_names)
        done = {s for n in names for s in srcs[n]}
        self.verified_frac = sum(self._numel.get(s, 0) for s in done) / total if total else 0.0
        return names
