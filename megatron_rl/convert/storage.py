"""On-disk formats: HF safetensors directories and the project's sharded Megatron checkpoint directory.

Megatron shard directory (written by :func:`save_mcore_shards`)::

    OUT/megatron_rl_checkpoint.json          metadata: format, geometry, layout, padded vocab, dtype,
                                             model_config (ModelConfig dict when available)
    OUT/hf_assets/                           config.json, generation_config.json, tokenizer files of the source
    OUT/mp_rank_{tp:02d}_{pp:03d}/model.safetensors                 non-expert tensors of (tp, pp)
    OUT/expert_rank_{etp:02d}_{pp:03d}_{ep:03d}/model.safetensors   routed experts of (ep, etp, pp) (MoE only)

Tensor names inside the files are megatron local-spec names with stage-local layer numbers and
EP-local expert numbers, exactly what ``model.state_dict()`` of that rank holds (see shard_files.py).

HF directories: ``model.safetensors`` or ``model-XXXXX-of-YYYYY.safetensors`` + ``model.safetensors.index.json``.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rl.convert.checks import CheckpointFormatError

Tensor = torch.Tensor

METADATA_FILE = "megatron_rl_checkpoint.json"
FORMAT_NAME = "megatron_rl.mcore_shards"
FORMAT_VERSION = 1
ASSETS_DIR = "hf_assets"
HF_ASSET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                  "chat_template.jinja", "chat_template.json")
SAFE_INDEX = "model.safetensors.index.json"
#: HF weight files above this size are split (``model-XXXXX-of-YYYYY.safetensors`` + index).
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


def dense_file(root: str, tp: int, pp: int) -> str:
    """Path of the non-expert shard of (tp, pp)."""
    return os.path.join(root, f"mp_rank_{tp:02d}_{pp:03d}", "model.safetensors")


def expert_file(root: str, ep: int, etp: int, pp: int) -> str:
    """Path of the routed-expert shard of (ep, etp, pp)."""
    return os.path.join(root, f"expert_rank_{etp:02d}_{pp:03d}_{ep:03d}", "model.safetensors")


def is_converted_dir(path: str) -> bool:
    """True for a directory written by ``convert_hf_to_mcore`` (per-rank shards + metadata)."""
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def hf_assets_dir(path: str) -> str:
    """Where config.json / tokenizer files of ``path`` live (``hf_assets/`` of a converted directory)."""
    return os.path.join(path, ASSETS_DIR) if is_converted_dir(path) else path


def read_hf_config(hf_dir: str) -> dict:
    """``config.json`` of a HF model directory."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointFormatError(f"{hf_dir}: no config.json (not a HF model directory)")
    with open(path) as f:
        return json.load(f)


def hf_weight_files(hf_dir: str) -> List[str]:
    """The safetensors files of a HF model directory (single file or index)."""
    index = os.path.join(hf_dir, SAFE_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        paths = [os.path.join(hf_dir, x) for x in files]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise CheckpointFormatError(f"{hf_dir}: {SAFE_INDEX} lists missing files {missing}")
        return paths
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise CheckpointFormatError(f"{hf_dir}: no model.safetensors or {SAFE_INDEX} (only safetensors is supported)")


@dataclass
class ReadCount:
    """Bytes copied out of checkpoint files (by one or more :class:`SafetensorsReader`)."""

    bytes_read: int = 0
    """Bytes of every tensor read so far."""
    largest_read: int = 0
    """Bytes of the largest single tensor read so far."""

    def add(self, nbytes: int) -> None:
        """Count one tensor of ``nbytes`` bytes."""
        self.bytes_read += nbytes
        self.largest_read = max(self.largest_read, nbytes)


def _header_dtypes(path: str) -> set:
    """The dtypes (``"BF16"``, ``"F32"`` ...) of a safetensors file's tensors, from its header alone."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def weight_dtypes(ckpt_dir: str) -> set:
    """The safetensors dtypes of every weight of a HF or converted directory (file headers only, nothing read)."""
    if is_converted_dir(ckpt_dir):
        paths = [os.path.join(ckpt_dir, d, "model.safetensors") for d in sorted(os.listdir(ckpt_dir))
                 if d.startswith(("mp_rank_", "expert_rank_"))]
    else:
        paths = hf_weight_files(ckpt_dir)
    return set().union(*map(_header_dtypes, paths)) if paths else set()


class SafetensorsReader:
    """Reads tensors, or slices of them, from a set of safetensors files; every byte copied out of the files
    goes through :meth:`read` and is counted in ``count`` (what a loader's host memory grows by).

    Slices are read with ``safe_open(...).get_slice(name)[...]``: only the requested rows / columns are
    copied, never the whole tensor. A name present in two files raises, naming both."""

    def __init__(self, paths: Iterable[str], count: Optional[ReadCount] = None):
        self._handles: Dict[str, object] = {}
        self._where: Dict[str, str] = {}
        self.count = count if count is not None else ReadCount()
        """What this reader (and any other sharing the count) has read."""
        for p in paths:
            h = safe_open(p, framework="pt")
            self._handles[p] = h
            for k in h.keys():
                if k in self._where:
                    raise CheckpointFormatError(f"tensor {k!r} appears in more than one file (again in {p})")
                self._where[k] = p

    @classmethod
    def for_hf_dir(cls, hf_dir: str, count: Optional[ReadCount] = None) -> "SafetensorsReader":
        """A reader over the weight files of a HF model directory."""
        return cls(hf_weight_files(hf_dir), count)

    def keys(self) -> List[str]:
        """Every tensor name, in file order."""
        return list(self._where)

    def shape(self, name: str) -> Tuple[int, ...]:
        """Shape of tensor ``name`` (nothing is read)."""
        return tuple(self._handles[self._file(name)].get_slice(name).get_shape())

    def _file(self, name: str) -> str:
        if name not in self._where:
            raise CheckpointFormatError(f"tensor {name!r} is not in {sorted(set(self._where.values()))}")
        return self._where[name]

    def read(self, name: str, dim: Optional[int] = None, start: int = 0, stop: Optional[int] = None) -> Tensor:
        """Tensor ``name``, or only its positions [start, stop) along ``dim`` (None: the whole tensor)."""
        handle = self._handles[self._file(name)]
        if dim is None:
            t = handle.get_tensor(name)
        else:
            t = handle.get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]
        self.count.add(t.numel() * t.element_size())
        return t

    def read_all(self) -> Dict[str, Tensor]:
        """Every tensor of the files."""
        return {k: self.read(k) for k in self._where}


def read_safetensors(paths: Iterable[str], count: Optional[ReadCount] = None) -> Dict[str, Tensor]:
    """All tensors of the given safetensors files (counted in ``count``); a name present twice raises."""
    return SafetensorsReader(paths, count).read_all()


def read_hf_state_dict(hf_dir: str, count: Optional[ReadCount] = None) -> Dict[str, Tensor]:
    """All tensors of a HF safetensors model directory."""
    return read_safetensors(hf_weight_files(hf_dir), count)


def write_safetensors(path: str, sd: Mapping[str, Tensor]) -> None:
    """Write a state dict to one safetensors file (tensors made contiguous, parent dirs created)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, path, metadata={"format": "pt"})


def write_hf_state_dict(out_dir: str, sd: Mapping[str, Tensor],
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> List[str]:
    """Write HF weights: one ``model.safetensors`` or, above ``max_shard_bytes``, shards + index."""
    os.makedirs(out_dir, exist_ok=True)
    names = sorted(sd)
    groups: List[List[str]] = [[]]
    size = 0
    for n in names:
        b = sd[n].numel() * sd[n].element_size()
        if groups[-1] and size + b > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += b
    if len(groups) == 1:
        path = os.path.join(out_dir, "model.safetensors")
        write_safetensors(path, sd)
        return [path]
    paths, weight_map = [], {}
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(os.path.join(out_dir, fname), {n: sd[n] for n in g})
        weight_map.update({n: fname for n in g})
        paths.append(os.path.join(out_dir, fname))
    total = sum(t.numel() * t.element_size() for t in sd.values())
    with open(os.path.join(out_dir, SAFE_INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return paths


def copy_hf_assets(src_dir: str, dst_dir: str) -> List[str]:
    """Copy config / generation config / tokenizer files that exist in ``src_dir``; returns their names."""
    os.makedirs(dst_dir, exist_ok=True)
    copied = []
    for name in HF_ASSET_FILES:
        p = os.path.join(src_dir, name)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(dst_dir, name))
            copied.append(name)
    return copied


def write_hf_model_dir(out_dir: str, hf_sd: Mapping[str, Tensor], assets_dir: Optional[str] = None,
                       config: Optional[dict] = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> List[str]:
    """Write a HF model directory: the config / tokenizer files of ``assets_dir`` (if given), ``config``
    as config.json when none is there yet, then the weights. Without any config.json it raises before
    writing weights. Returns the weight files."""
    os.makedirs(out_dir, exist_ok=True)
    if assets_dir is not None:
        copy_hf_assets(assets_dir, out_dir)
    cfg_path = os.path.join(out_dir, "config.json")
    if not os.path.isfile(cfg_path):
        if config is None:
            raise CheckpointFormatError(
                f"export to {out_dir}: no config.json to write beside the weights (assets_dir={assets_dir!r})")
        with open(cfg_path, "w") as fh:
            json.dump(config, fh, indent=2, sort_keys=True)
    return write_hf_state_dict(out_dir, hf_sd, max_shard_bytes)


def prepare_output_dir(root: str, overwrite: bool) -> None:
    """Make ``root`` ready for a new converted checkpoint: it must be empty or absent; with
    ``overwrite`` a previous converted checkpoint (metadata, shard dirs, hf_assets) is deleted first.
    Any other file in it raises (nothing of the user's is deleted)."""
    if not os.path.isdir(root):
        os.makedirs(root, exist_ok=True)
        return
    entries = sorted(os.listdir(root))
    if not entries:
        return
    ours = [e for e in entries if e in (METADATA_FILE, ASSETS_DIR) or e.startswith(("mp_rank_", "expert_rank_"))]
    foreign = sorted(set(entries) - set(ours))
    if not overwrite or foreign:
        raise CheckpointFormatError(
            f"output directory {root} is not empty ({entries[:8]}{'...' if len(entries) > 8 else ''}); "
            + ("pass overwrite=True / --overwrite to replace the converted checkpoint in it" if not foreign
               else f"it holds files that are not a converted checkpoint: {foreign[:8]}"))
    for e in ours:
        p = os.path.join(root, e)
        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


def write_metadata(root: str, meta: dict) -> None:
    """Write the shard directory's metadata JSON (adds format name and version)."""
    os.makedirs(root, exist_ok=True)
    meta = dict(meta, format=FORMAT_NAME, format_version=FORMAT_VERSION)
    with open(os.path.join(root, METADATA_FILE), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)


def read_metadata(root: str) -> dict:
    """Read and check the shard directory's metadata JSON."""
    path = os.path.join(root, METADATA_FILE)
    if not os.path.isfile(path):
        raise CheckpointFormatError(f"{root}: no {METADATA_FILE} (not a megatron-rl converted checkpoint)")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_NAME or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointFormatError(f"{path}: format {meta.get('format')!r} v{meta.get('format_version')} "
                                    f"is not {FORMAT_NAME!r} v{FORMAT_VERSION}")
    return meta


def read_shard(path: str, what: str, count: Optional[ReadCount] = None) -> Dict[str, Tensor]:
    """One shard file; a missing file raises naming the shard."""
    if not os.path.isfile(path):
        raise CheckpointFormatError(f"missing {what} file {path}")
    return read_safetensors([path], count)
