"""Weight buckets: the unit of an in-memory weight sync (``rollout.weight_sync: tensor | distributed``).

A ``Bucket`` is one flat byte buffer holding several HF-named tensors of ONE dtype back to back (no
padding: the layout of SGLang's ``FlattenedTensorBucket``, so the buffer can be broadcast as it is to
``/update_weights_from_distributed`` with ``load_format: flattened_bucket``) plus their names and shapes.
``bucketize`` fills buffers of ``bucket_bytes`` from a ``(name, tensor)`` stream, copying (and casting)
each tensor straight into the buffer, so a sender holds one bucket + the tensor being copied, never the
model. ``tensor_checksum`` (``endpoint.py``) is SGLang's ``/weights_checker`` checksum.

Usage::

    for bucket in bucketize(iter_hf_tensors(...), 512 << 20, torch.bfloat16):
        receiver.load(bucket)                 # bucket.tensors(): [(name, view into bucket.flat)]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional, Set, Tuple

import torch

from megatron_rl.convert.pieces import FENCE, copy_into
from megatron_rl.weight_sync.endpoint import tensor_checksum

__all__ = ["Bucket", "HeldBucket", "bucketize", "hold_buckets", "tensor_checksum", "DTYPE_NAMES"]

#: torch dtype -> the name SGLang's HTTP API uses (``getattr(torch, name)``).
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
               torch.float64: "float64", torch.int64: "int64", torch.int32: "int32", torch.uint8: "uint8"}


@dataclass
class Bucket:
    """Tensors of one dtype packed back to back in ``flat`` (uint8)."""

    names: List[str]
    """HF tensor names, in buffer order."""
    shapes: List[Tuple[int, ...]]
    """Their shapes."""
    dtype: torch.dtype
    """The one dtype of every tensor in the bucket."""
    flat: torch.Tensor
    """The bytes (1-D uint8, exactly ``nbytes`` long)."""

    @property
    def nbytes(self) -> int:
        """Bytes in the bucket."""
        return int(self.flat.numel())

    def meta(self) -> dict:
        """Everything but the bytes (picklable; sent ahead of the buffer)."""
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes], "dtype": DTYPE_NAMES[self.dtype],
                "nbytes": self.nbytes}

    @classmethod
    def empty(cls, meta: dict, device="cpu", buffer: Optional[torch.Tensor] = None) -> "Bucket":
        """A bucket for ``meta`` with an uninitialised buffer to receive into (``buffer``: the start of a uint8
        buffer of at least ``meta["nbytes"]``, reused)."""
        n = int(meta["nbytes"])
        flat = buffer[:n] if buffer is not None else torch.empty(n, dtype=torch.uint8, device=device)
        return cls(list(meta["names"]), [tuple(s) for s in meta["shapes"]], getattr(torch, meta["dtype"]), flat)

    def tensors(self) -> List[Tuple[str, torch.Tensor]]:
        """``(name, tensor)`` views into ``flat`` (no copy)."""
        out, off = [], 0
        item = torch.empty((), dtype=self.dtype).element_size()
        for name, shape in zip(self.names, self.shapes):
            n = 1
            for s in shape:
                n *= int(s)
            out.append((name, self.flat[off:off + n * item].view(self.dtype).view(shape)))
            off += n * item
        return out


@dataclass
class HeldBucket(Bucket):
    """A bucket that holds its tensors instead of copying them (``flat`` is None): for an engine in this process,
    which copies each tensor into its own weights (casting to its dtype) when the bucket is loaded -- one pass over
    the bytes instead of two. ``tensors()`` gives the held tensors, uncast (a ``pieces.Pieces`` copies itself into
    place: ``copy_into``); ``nbytes`` counts them in ``dtype``."""

    held: List[torch.Tensor] = None
    """The tensors (or ``Pieces``), in ``names`` order (not copied, not cast)."""

    @property
    def nbytes(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return sum(t.numel() for t in self.held) * item

    def tensors(self) -> List[Tuple[str, torch.Tensor]]:
        return list(zip(self.names, self.held))


def _target_dtype(name: str, t: torch.Tensor, dtype, keep_dtype) -> torch.dtype:
    return dtype if (dtype is not None and t.is_floating_point() and name not in keep_dtype) else t.dtype


def bucketize(pairs: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int,
              dtype: Optional[torch.dtype] = None, keep_dtype: Optional[Set[str]] = None,
              reuse: bool = False, alloc: Optional[Callable[[int], torch.Tensor]] = None) -> Iterator[Bucket]:
    """Pack a ``(name, tensor)`` stream into buckets of at most ``bucket_bytes`` (a tensor larger than that
    gets a bucket of its own). Floating tensors are cast to ``dtype`` (None: kept), except those named in
    ``keep_dtype`` (tensors the engine keeps in higher precision than its compute dtype, e.g. DeepSeek-V3's
    fp32 ``e_score_correction_bias`` in a bf16 model); a dtype change starts a new bucket. Each tensor is
    copied into the buffer as it arrives and not kept. ``reuse``: the consumer is done with a bucket when it asks
    for the next one (a streamed sync sends each before the next), so one buffer serves them all (no fresh pages
    to fault in per bucket). ``alloc(n)``: the uint8 buffer (at least ``n`` bytes) each bucket is packed into,
    asked for when a bucket starts (the consumer is done with the previous one: a channel's shared memory)."""
    keep_dtype = keep_dtype or set()
    if bucket_bytes < 1:
        raise ValueError(f"bucketize: bucket_bytes={bucket_bytes} must be >= 1")
    buf: Optional[torch.Tensor] = None
    spare: Optional[torch.Tensor] = None
    names: List[str] = []
    shapes: List[Tuple[int, ...]] = []
    cur_dtype = None
    used = 0

    def flush() -> Optional[Bucket]:
        if not names:
            return None
        return Bucket(list(names), list(shapes), cur_dtype, buf[:used])

    for name, t in pairs:
        if name is FENCE:  # (a lazy stream) pieces are copied in as they come
            continue
        want = _target_dtype(name, t, dtype, keep_dtype)
        n = t.numel() * torch.empty((), dtype=want).element_size()
        if names and (want != cur_dtype or used + n > buf.numel()):
            yield flush()
            if reuse and buf.numel() == bucket_bytes:
                spare = buf
            names, shapes, used = [], [], 0
        if not names and alloc is not None:
            cur_dtype, buf = want, alloc(max(bucket_bytes, n))
        elif not names:
            cur_dtype = want
            buf = spare if (spare is not None and n <= bucket_bytes) else torch.empty(max(bucket_bytes, n),
                                                                                       dtype=torch.uint8)
        copy_into(t.detach(), buf[used:used + n].view(want).view(t.shape))
        names.append(name)
        shapes.append(tuple(t.shape))
        used += n
    last = flush()
    if last is not None:
        yield last


def hold_buckets(pairs: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int,
                 dtype: Optional[torch.dtype] = None, keep_dtype: Optional[Set[str]] = None) -> Iterator[HeldBucket]:
    """As ``bucketize``, but each bucket holds its tensors (``HeldBucket``): at most ``bucket_bytes`` of them as they
    are (the memory of one bucket), for an engine in this process that copies them in at once; a bucket also ends
    at each ``pieces.FENCE`` of a lazy stream (``convert.live.iter_hf_tensors(lazy=True)``)."""
    keep_dtype = keep_dtype or set()
    if bucket_bytes < 1:
        raise ValueError(f"hold_buckets: bucket_bytes={bucket_bytes} must be >= 1")
    names: List[str] = []
    held: List[torch.Tensor] = []
    cur_dtype = None
    used = 0
    for name, t in pairs:
        if name is FENCE:  # the pieces held so far are valid until the stream is asked past it: loaded now
            if names:
                yield HeldBucket(names, [tuple(x.shape) for x in held], cur_dtype, None, held)
                names, held, used = [], [], 0
            continue
        want = _target_dtype(name, t, dtype, keep_dtype)
        n = t.numel() * t.element_size()
        if names and (want != cur_dtype or used + n > bucket_bytes):
            yield HeldBucket(names, [tuple(x.shape) for x in held], cur_dtype, None, held)
            names, held, used = [], [], 0
        cur_dtype = want
        names.append(name)
        held.append(t.detach())
        used += n
    if names:
        yield HeldBucket(names, [tuple(x.shape) for x in held], cur_dtype, None, held)
