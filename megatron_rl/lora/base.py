"""The frozen base a LoRA run trains on, named and fingerprinted (``base_record``): what a LoRA checkpoint keeps
instead of the base weights, and what a resume checks.

Rule: the fingerprint is the sha256 of the base checkpoint's weight files and config.json (every byte, file names
included; not the tokenizer), so any changed weight changes it whatever the layout the run loads it at. It reads
the whole base once per call (rank 0 only: ``actor`` broadcasts it).
"""
from __future__ import annotations

import hashlib
import os
from typing import Dict

__all__ = ["base_fingerprint", "base_record", "WEIGHT_SUFFIXES"]

#: the files of a base directory that the fingerprint covers
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".distcp")
_CHUNK = 16 * 1024 * 1024


def _files(root: str):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in sorted(filenames):
            if fn.endswith(WEIGHT_SUFFIXES) or fn == "config.json":
                yield os.path.join(dirpath, fn)


def base_fingerprint(path: str) -> str:
    """sha256 (hex) of ``path``'s weight files and config.json, in name order; ValueError when it has none."""
    h, n = hashlib.sha256(), 0
    for f in _files(path):
        h.update(os.path.relpath(f, path).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(_CHUNK), b""):
                h.update(block)
        n += 1
    if not n:
        raise ValueError(f"actor.load_hf: {path!r} holds no weight files to fingerprint")
    return h.hexdigest()


def base_record(path: str) -> Dict[str, str]:
    """{"path": the base directory, "sha256": its fingerprint}."""
    return {"path": os.path.abspath(path), "sha256": base_fingerprint(path)}
