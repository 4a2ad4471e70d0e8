"""Weight-sync verification (rank 0): the engine's own checksums of a sample of ITS tensors — fused, padded and
sharded as the engine holds them (``weight_sync.layout``) — compared with the same fusion / padding /
sharding of the trainer's tensors, cast to the engine's dtype (tensors the engine keeps in higher precision
stay in their own dtype).

Usage (one ``WeightVerifier`` per sync; ``offer`` every HF tensor of the sync in any order)::

    v = WeightVerifier(engine, hf_names, engine.weight_holding(hf_names, geometry, verify=True), k=16, version=3)
    for name, t in stream:
        v.offer(name, t)
    v.check("weight sync to 'step-3'", "the trainer's")   # WeightSyncError naming every tensor that differs
    v.verified_frac                                        # parameters compared / parameters synced

Memory: the HF pieces of a sampled engine tensor are held (cloned) until its last piece arrived — for a
sampled fused expert tensor, the experts of one layer.

Entry points per payload (each builds the verifier of a version -- nothing sampled unless
``rollout.weight_sync_verify_interval`` makes the version due -- offers the tensors and compares):
``verifier_for`` + ``finish_verify`` (streamed buckets, as they pass), ``verify_export`` / ``verify_disk_sync``
(an HF export the engine loaded) and ``verify_buckets`` (owned buckets applied by the async producer).
"""
from __future__ import annotations

import copy
import json
import os
from typing import Dict, List, Sequence

import torch

from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.weight_sync.endpoint import WeightHolding, WeightSyncError
from megatron_rl.weight_sync.versions import parse_version
from megatron_rl.weight_sync.report import SyncReport
from megatron_rl.weight_sync.settings import WeightSyncSettings

__all__ = ["WeightVerifier", "sample_spread", "verifier_for", "finish_verify", "verify_export", "verify_buckets",
           "verify_disk_sync"]


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

    def __init__(self, engine, hf_names: Sequence[str], holding: WeightHolding, k: int, version: int):
        self.engine = engine
        self.dtype = holding.dtype
        self.keep = set(holding.full_precision)
        self.hf_names = set(hf_names)
        # the engine's own hash (SGLang on a GPU: its Triton hash); None: this process cannot reproduce it,
        # so nothing is compared and verified_frac stays 0 (said once per job by ``unverifiable_notice``)
        self.hash = holding.checksum if k != 0 else None
        layout = list(holding.layout) if self.hash is not None else []
        chosen = set(sample_spread([t.name for t in layout], k, version))
        self.tensors = [t for t in layout if t.name in chosen]
        self.tp_sizes = sorted(set(holding.tp_sizes)) if self.tensors else []
        self._need: Dict[str, int] = {}
        for t in self.tensors:
            for s in t.sources:
                self._need[s] = self._need.get(s, 0) + 1
        self._held: Dict[str, torch.Tensor] = {}
        self._numel: Dict[str, int] = {}
        self.expected: Dict[int, Dict[str, tuple]] = {tp: {} for tp in self.tp_sizes}
        self.verified_frac = 0.0

    def for_sender(self) -> "WeightVerifier":
        """A copy for another sender, without the engine (picklable): it hashes the sampled engine tensors whose
        HF pieces all pass that sender; ``part`` hands back those hashes, the pieces of the sampled tensors it
        could not complete (their other pieces are another sender's: fused experts under EP) and the sizes."""
        other = copy.copy(self)
        other.engine = None
        other._need, other._held, other._numel = dict(self._need), {}, {}
        other.expected = {tp: {} for tp in self.tp_sizes}
        return other

    def part(self) -> tuple:
        """What this sender's copy found (``merge`` it into rank 0's verifier)."""
        return self.expected, self._held, self._numel

    def merge(self, part: tuple) -> None:
        """Add another sender's ``part``: its hashes, sizes and left-over pieces (offered here)."""
        expected, held, numel = part
        for tp, sums in expected.items():
            self.expected[tp].update(sums)
        self._numel.update(numel)
        for name, t in held.items():
            self.offer(name, t)

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
        given = t
        if self.dtype is not None and t.is_floating_point() and name not in self.keep:
            t = t.to(self.dtype)
        self._held[name] = t.detach()  # may be the caller's buffer: copied below if kept past this call
        for et in self.tensors:
            if name in et.sources and all(s in self._held for s in et.sources):
                for tp in self.tp_sizes:
                    self.expected[tp][et.name] = tuple(self.hash(et.shard(self._held, r, tp))
                                                       for r in range(tp))
                for s in et.sources:
                    self._need[s] -= 1
                    if self._need[s] == 0:
                        del self._need[s], self._held[s]
        if name in self._held and t is given:  # another engine tensor still needs it: own a copy
            self._held[name] = self._held[name].clone()

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


def _version_number(tag: str) -> int:
    """The number of a ``step-N`` version tag (0 for any other tag: verified like version 0)."""
    try:
        return parse_version(tag)
    except ValueError:
        return 0


def verifier_for(geometry, engine, settings: WeightSyncSettings, names: List[str], version: str) -> WeightVerifier:
    """Rank 0: the verifier of this version (samples nothing unless a verification is due); its ``dtype`` and
    ``keep`` are the engine's (``WeightEndpoint.weight_holding``), which the sender casts to."""
    v = _version_number(version)
    due = settings.due(v)
    k = settings.verify_tensors if due else 0
    holding = engine.weight_holding(list(names), geometry, verify=k != 0)
    verifier = WeightVerifier(engine, names, holding, k, v)
    if due and verifier.hash is None and not _UNVERIFIABLE_SAID:
        _UNVERIFIABLE_SAID.append(True)
        print(f"[megatron-rl] WARNING: weight-sync verification skipped -- OFF for this whole run: "
              f"{type(engine).__name__}'s checksums cannot be reproduced in this process. SGLang on a GPU hashes "
              f"its tensors with its Triton kernel, which the trainer runs only with sglang importable in its own "
              f"environment and a CUDA device (SGLang in a separate venv, MEGATRON_RL_SGLANG_PYTHON, cannot be "
              f"verified); weight_sync/verified_param_frac stays 0. To verify: install sglang in the trainer's "
              f"environment on the GPU nodes", flush=True)
    return verifier


_UNVERIFIABLE_SAID: List[bool] = []  # the warning above, once per process


def finish_verify(verifier: WeightVerifier, report: SyncReport, what: str, source_text: str) -> None:
    report.checked = verifier.check(what, source_text)
    report.verified = bool(report.checked)
    report.verified_frac = verifier.verified_frac


def verify_disk_sync(engine, settings: WeightSyncSettings, export_dir: str, version: str) -> List[str]:
    """Rank 0, after the engine loaded ``export_dir``: compare the engine's copies of sampled engine tensors
    with the same fusion of the export's tensors (cast to the engine's dtype as its loader casts them;
    fp32-kept tensors in their own dtype) when due; a mismatch raises ``WeightSyncError`` naming each tensor.
    Returns the engine tensors checked (empty: not due, or the engine cannot report checksums)."""
    return verify_export(engine, settings, export_dir, version).checked


def verify_export(engine, settings: WeightSyncSettings, export_dir: str, version: str) -> SyncReport:
    from safetensors import safe_open  # only a disk sync reads safetensors files

    with open(os.path.join(export_dir, "config.json")) as fh:
        geometry = HFGeometry.from_hf_config(json.load(fh))
    files = sorted(f for f in os.listdir(export_dir) if f.endswith(".safetensors"))
    names = []
    for f in files:
        with safe_open(os.path.join(export_dir, f), framework="pt") as fh:
            names += list(fh.keys())
    verifier = verifier_for(geometry, engine, settings, names, version)
    report = SyncReport()
    if not verifier.tensors:
        return report
    for f in files:
        with safe_open(os.path.join(export_dir, f), framework="pt") as fh:
            for name in fh.keys():
                if verifier.needs(name):
                    verifier.offer(name, fh.get_tensor(name))
                else:
                    n = 1
                    for d in fh.get_slice(name).get_shape():
                        n *= int(d)
                    verifier.count(name, n)
    finish_verify(verifier, report, f"weight sync to {version!r} (disk)", export_dir)
    return report


def verify_buckets(engine, settings: WeightSyncSettings, actor, buckets, version: str) -> SyncReport:
    """Rank 0, after the engine applied owned ``buckets`` (async tensor mode): as ``verify_disk_sync``."""
    names = [n for b in buckets for n in b.names]
    verifier = verifier_for(actor.hf_target.geometry, engine, settings, names, version)
    report = SyncReport()
    if verifier.tensors:
        for bucket in buckets:
            for name, t in bucket.tensors():
                verifier.offer(name, t)
        finish_verify(verifier, report, f"weight sync to {version!r}", "the trainer's tensors")
    return report
