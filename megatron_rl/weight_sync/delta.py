"""Delta weight sync: per tensor, only the elements whose BITS changed since the version the engine holds.

With RL learning rates most bf16 weights do not change from one step to the next (the bf16 rounding absorbs the
update), so a sync can send, per HF tensor, one of:

* ``same``   -- nothing changed: no bytes (the entry only says so);
* ``sparse`` -- the flat positions of the changed elements and their new values, when that is smaller than the
  tensor; on the wire a position costs 2 bytes (its offset inside a block of 65536 elements, plus 4 bytes per
  block for the block's count), so a bf16 element changed costs 4 bytes and sparse wins below ~50 % changed;
* ``dense``  -- the whole tensor (the first version, after a failed or skipped one, or when much changed).

Elements are compared by their bits (an integer view of the same width), never with ``==``: ``-0.0`` vs ``+0.0``
is a change and a NaN that kept its bits is not. Applying a delta to the tensors of the previous version gives,
bit for bit, the new tensor (``apply_delta``), so an engine holding version V and applying the delta V -> W holds
exactly what a full sync of W gives it.

``DeltaBucket`` packs deltas into one flat uint8 buffer (each section 8-byte aligned) with a picklable ``meta``;
it travels like a ``Bucket`` (``meta()`` / ``flat`` / ``empty(meta)``). Entries of kind ``check`` carry whole
tensors for rank 0's verifier only: they sit after ``engine_nbytes`` and no receiver is sent them.

    d = encode_delta("model.norm.weight", new, base)      # TensorDelta; base=None -> dense
    apply_delta(target, d)                                 # in place, any strides
    for bucket in pack_deltas(stream, 512 << 20, base="step-3", version="step-4"):
        receiver.load(bucket)                              # bucket.deltas(): [TensorDelta views into bucket.flat]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Tuple

import torch

__all__ = ["TensorDelta", "changed_positions", "encode_delta", "apply_delta", "DeltaBucket", "pack_deltas",
           "INT_OF_WIDTH", "BLOCK", "sparse_nbytes", "encode_positions", "decode_positions"]

#: An integer dtype of each element width: bits are compared in these views.
INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ALIGN = 8
_KINDS = ("same", "sparse", "dense", "check")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width (a view when contiguous)."""
    return t.contiguous().view(INT_OF_WIDTH[t.element_size()])


def changed_positions(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Flat (row-major) positions where ``new`` and ``base`` differ in bits (int64, ascending)."""
    if new.shape != base.shape or new.dtype != base.dtype:
        raise ValueError(f"changed_positions: new {tuple(new.shape)} {new.dtype} vs base "
                         f"{tuple(base.shape)} {base.dtype}")
    return torch.nonzero((_bits(new) != _bits(base)).reshape(-1)).reshape(-1)


BLOCK = 1 << 16
"""Elements per block of the sparse wire format (a position is sent as its 16-bit offset in its block)."""


def sparse_nbytes(numel: int, changed: int, item: int) -> int:
    """Wire bytes of a sparse delta: one int32 count per block, a 2-byte offset and the value per change."""
    return -(-numel // BLOCK) * 4 + changed * (2 + item)


def encode_positions(pos: torch.Tensor, numel: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ascending flat positions -> (changes per block of ``BLOCK`` elements, int32; offsets in their block,
    the 16 bits stored as int16)."""
    pos = pos.to(torch.int64)
    counts = torch.bincount(pos // BLOCK, minlength=-(-numel // BLOCK)).to(torch.int32)
    off = pos % BLOCK
    return counts, (off - BLOCK * (off >= BLOCK // 2)).to(torch.int16)


def decode_positions(counts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Inverse of ``encode_positions`` (int64)."""
    blocks = torch.repeat_interleave(torch.arange(counts.numel(), dtype=torch.int64), counts.to(torch.int64))
    return blocks * BLOCK + (offsets.to(torch.int64) & (BLOCK - 1))


@dataclass
class TensorDelta:
    """How one HF tensor changed."""

    name: str
    """HF tensor name."""
    shape: Tuple[int, ...]
    """The tensor's shape."""
    dtype: torch.dtype
    """The tensor's dtype (the values' dtype)."""
    kind: str
    """``same`` | ``sparse`` | ``dense`` | ``check`` (a whole tensor for verification, not for the engine)."""
    index: Optional[torch.Tensor] = None
    """sparse: the flat positions changed (1-D int64, ascending)."""
    values: Optional[torch.Tensor] = None
    """sparse: the new values at ``index`` (1-D); dense / check: the whole tensor (in ``shape``)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the payload on the wire (sparse: block counts + 2-byte offsets + values)."""
        if self.kind == "sparse":
            return sparse_nbytes(self.numel, int(self.index.numel()), self.values.element_size())
        return 0 if self.values is None else int(self.values.numel()) * self.values.element_size()

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def changed(self) -> int:
        """Elements sent as changed (dense: every element)."""
        return {"same": 0, "sparse": 0 if self.index is None else int(self.index.numel())}.get(self.kind, self.numel)


def encode_delta(name: str, new: torch.Tensor, base: Optional[torch.Tensor]) -> TensorDelta:
    """The delta of ``new`` against ``base`` (the engine's current copy; None: unknown -> dense). Sparse when
    positions + values take fewer bytes than the tensor. The result never aliases ``base``; dense holds ``new``
    itself (copy it before changing ``new``)."""
    shape, dtype = tuple(new.shape), new.dtype
    if base is None:
        return TensorDelta(name, shape, dtype, "dense", values=new)
    if tuple(base.shape) != shape or base.dtype != dtype:
        raise ValueError(f"encode_delta: {name!r} is {shape} {dtype} but its base is {tuple(base.shape)} {base.dtype}")
    pos = changed_positions(new, base)
    k, n = int(pos.numel()), new.numel()
    if k == 0:
        return TensorDelta(name, shape, dtype, "same")
    item = new.element_size()
    if sparse_nbytes(n, k, item) >= n * item:
        return TensorDelta(name, shape, dtype, "dense", values=new)
    return TensorDelta(name, shape, dtype, "sparse", index=pos,
                       values=new.contiguous().reshape(-1)[pos].clone())


def apply_delta(target: torch.Tensor, d: TensorDelta) -> None:
    """Bring ``target`` (holding the delta's base, cast to ``target``'s dtype) to the new tensor, in place, by
    the same cast a full copy makes: ``target.copy_(new)`` and ``apply_delta(target, encode_delta(.., new,
    base))`` leave the same bits. ValueError when the shape differs or the kind cannot be applied."""
    if tuple(target.shape) != tuple(d.shape):
        raise ValueError(f"apply_delta: {d.name!r} is {tuple(d.shape)} but the target is {tuple(target.shape)}")
    with torch.no_grad():
        if d.kind == "same":
            return
        if d.kind == "dense":
            target.copy_(d.values.reshape(d.shape))
            return
        if d.kind != "sparse":
            raise ValueError(f"apply_delta: {d.name!r} has kind {d.kind!r}, which no engine applies")
        if d.index.numel() and (int(d.index.min()) < 0 or int(d.index.max()) >= d.numel):
            raise ValueError(f"apply_delta: {d.name!r} has positions outside its {d.numel} elements")
        values = d.values.to(target.dtype)
        if target.is_contiguous():
            target.view(-1).index_put_((d.index.to(torch.int64),), values)
            return
        rem, where = d.index.to(torch.int64), []
        for size in reversed(d.shape):  # flat positions -> coordinates (row-major), for any strides
            where.append(rem % size)
            rem = rem // size
        target.index_put_(tuple(reversed(where)), values)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class DeltaBucket:
    """Deltas packed back to back in ``flat`` (uint8; every section 8-byte aligned); ``check`` entries last."""

    entries: List[dict]
    """Per tensor: name, shape, dtype, kind, count (sparse: positions), and the byte offsets of its sections."""
    flat: torch.Tensor
    """The bytes (1-D uint8, exactly ``nbytes`` long)."""
    base: Optional[str]
    """The version the deltas apply to (None: every entry is dense or same-less, a full sync)."""
    version: str
    """The version the deltas lead to."""

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer (verification copies included)."""
        return int(self.flat.numel())

    @property
    def engine_nbytes(self) -> int:
        """Bytes an engine is sent: the buffer up to the first ``check`` entry."""
        checks = [e["offset"] for e in self.entries if e["kind"] == "check"]
        return min(checks) if checks else self.nbytes

    @property
    def names(self) -> List[str]:
        """HF names of the engine entries, in buffer order."""
        return [e["name"] for e in self.entries if e["kind"] != "check"]

    def meta(self) -> dict:
        """Everything but the bytes (picklable, JSON-able; sent ahead of the buffer)."""
        return {"format": "delta", "entries": [dict(e) for e in self.entries], "nbytes": self.nbytes,
                "base": self.base, "version": self.version}

    def engine_meta(self) -> dict:
        """``meta`` of the part an engine is sent (``flat[:engine_nbytes]``)."""
        meta = self.meta()
        meta["entries"] = [e for e in meta["entries"] if e["kind"] != "check"]
        meta["nbytes"] = self.engine_nbytes
        return meta

    @classmethod
    def empty(cls, meta: dict, device="cpu") -> "DeltaBucket":
        """A bucket for ``meta`` with an uninitialised buffer (to receive into)."""
        return cls([dict(e) for e in meta["entries"]], torch.empty(int(meta["nbytes"]), dtype=torch.uint8,
                                                                     device=device), meta["base"], meta["version"])

    @classmethod
    def from_meta(cls, meta: dict, flat: torch.Tensor) -> "DeltaBucket":
        """The bucket of ``meta`` over the received bytes ``flat``; ValueError when they do not fit."""
        if meta.get("format") != "delta" or int(meta["nbytes"]) != int(flat.numel()):
            raise ValueError(f"delta bucket: meta for {meta.get('nbytes')} bytes ({meta.get('format')!r}) but "
                             f"{int(flat.numel())} bytes arrived")
        return cls([dict(e) for e in meta["entries"]], flat.reshape(-1).view(torch.uint8), meta["base"],
                   meta["version"])

    def _view(self, off: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        item = torch.empty((), dtype=dtype).element_size()
        return self.flat[off:off + count * item].view(dtype)

    def deltas(self, checks: bool = False) -> List[TensorDelta]:
        """The entries as ``TensorDelta`` views into ``flat`` (no copy); ``check`` entries only if ``checks``."""
        out = []
        for e in self.entries:
            if e["kind"] == "check" and not checks:
                continue
            dt, shape = getattr(torch, e["dtype"]), tuple(e["shape"])
            d = TensorDelta(e["name"], shape, dt, e["kind"])
            if e["kind"] == "sparse":
                d.index = decode_positions(self._view(e["offset"], e["blocks"], torch.int32),
                                           self._view(e["offsets_offset"], e["count"], torch.int16))
                d.values = self._view(e["values_offset"], e["count"], dt)
            elif e["kind"] in ("dense", "check"):
                d.values = self._view(e["offset"], d.numel, dt).view(shape)
            out.append(d)
        return out

    def counts(self) -> List[Tuple[str, int, int]]:
        """``(name, elements, elements changed)`` of the engine entries (dense: every element changed)."""
        return [(d.name, d.numel, d.changed) for d in self.deltas()]

    def full_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        """``(name, whole new tensor)`` of the dense and check entries (what a verifier can be offered)."""
        return [(d.name, d.values) for d in self.deltas(checks=True) if d.kind in ("dense", "check")]


def _entry_sizes(d: TensorDelta) -> List[int]:
    if d.kind == "sparse":
        k = int(d.index.numel())
        return [-(-d.numel // BLOCK) * 4, k * 2, k * d.values.element_size()]
    if d.kind in ("dense", "check"):
        return [d.values.numel() * d.values.element_size()]
    return []


def pack_deltas(deltas: Iterable[TensorDelta], bucket_bytes: int, base: Optional[str],
                version: str) -> Iterator[DeltaBucket]:
    """Pack a stream of deltas (``check`` entries after the engine entries of their bucket) into buckets of
    about ``bucket_bytes`` (a larger delta gets a bucket of its own). A delta's tensors are copied into the
    buffer when its bucket is complete: they must not change before (``encode_delta`` never aliases a base).
    ``base`` / ``version``: the versions the bucket leads from and to."""
    if bucket_bytes < 1:
        raise ValueError(f"pack_deltas: bucket_bytes={bucket_bytes} must be >= 1")
    pending: List[TensorDelta] = []
    size = 0

    def flush() -> DeltaBucket:
        order = [d for d in pending if d.kind != "check"] + [d for d in pending if d.kind == "check"]
        total = sum(_aligned(s) for d in order for s in _entry_sizes(d))
        flat = torch.empty(total, dtype=torch.uint8)
        entries, off = [], 0
        for d in order:
            e = {"name": d.name, "shape": list(d.shape), "dtype": _dtype_name(d.dtype), "kind": d.kind,
                 "offset": off, "count": 0}
            parts = []
            if d.kind == "sparse":
                counts, offsets = encode_positions(d.index, d.numel)
                e["count"], e["blocks"] = int(d.index.numel()), int(counts.numel())
                parts = [counts, offsets, d.values]
            elif d.kind in ("dense", "check"):
                parts = [d.values]
            for i, t in enumerate(parts):
                n = t.numel() * t.element_size()
                if i:
                    e["offsets_offset" if i == 1 else "values_offset"] = off
                flat[off:off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
                off += _aligned(n)
            entries.append(e)
        return DeltaBucket(entries, flat, base, version)

    for d in deltas:
        if d.kind not in _KINDS:
            raise ValueError(f"pack_deltas: {d.name!r} has unknown kind {d.kind!r}")
        n = sum(_aligned(s) for s in _entry_sizes(d))
        if pending and size + n > bucket_bytes:
            yield flush()
            pending, size = [], 0
        pending.append(d)
        size += n
    if pending:
        yield flush()
