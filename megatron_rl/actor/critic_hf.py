"""The critic's weights from a HF directory (``critic.load_hf``, verl's ``critic.model.path``).

    source = value_source("critic.load_hf", path, model_cfg)   # config.json checked, no weight read
    load_value_model(chunks, source, model_cfg, groups)       # chunks already carry their value heads

A ``*ForTokenClassification`` / ``*ForSequenceClassification`` checkpoint with ``num_labels == 1`` (a value or
reward model) gives the body and the value head: its ``score.weight`` [1, hidden] and ``score.bias`` where it has one
(HF's sequence classifier has none: the bias stays 0). A ``*ForCausalLM`` or a converted directory gives the body
only (``head is None``: the head starts fresh, said at the job's start).
Rule: every problem is found from config.json alone, before a weight is read, and names the key.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatron_rl.convert import storage
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.live import check_model_config_matches, chunk_coords
from megatron_rl.convert.model_state import load_state_dict_into_model
from megatron_rl.convert.slices import read_chunk_shard
from megatron_rl.models.config import ModelConfig
from megatron_rl.parallel.groups import ActorGroups

__all__ = ["HEAD_CLASSES", "ValueSource", "value_source", "load_value_model"]

#: HF classifier suffixes whose ``score`` (num_labels == 1) is the value head
HEAD_CLASSES = ("ForTokenClassification", "ForSequenceClassification")
_SCORE = ("score.weight", "score.bias")


@dataclass(frozen=True)
class ValueSource:
    """Where the critic's weights come from (built once by the plan)."""

    key: str
    """The config key that named ``path`` (``critic.load_hf``, or ``actor.load_hf`` when that is null)."""
    path: str
    """The HF (or converted) directory."""
    head: Optional[str]
    """The classifier class whose ``score`` becomes the value head, or None: body only, a fresh head."""

    def line(self) -> str:
        """What the job's start says about the critic's weights."""
        if self.head:
            return f"critic weights: body and value head from {self.key} {self.path} ({self.head}, score)"
        return f"critic weights: body from {self.key} {self.path}; the value head starts fresh (no classifier score)"


def _num_labels(cfg: dict) -> int:
    if isinstance(cfg.get("id2label"), dict):
        return len(cfg["id2label"])
    return int(cfg.get("num_labels", 2))  # HF's PretrainedConfig default


def _body_config(cfg: dict, model_cfg: ModelConfig) -> dict:
    """config.json of the classifier's body as the CausalLM the geometry knows (its output layer is not read)."""
    arch = (cfg.get("architectures") or [""])[0]
    base = next(arch[: -len(s)] for s in HEAD_CLASSES if arch.endswith(s))
    return {**cfg, "architectures": [base + "ForCausalLM"],
            "tie_word_embeddings": not model_cfg.untie_embeddings_and_output_weights}


def value_source(key: str, path: str, model_cfg: Optional[ModelConfig]) -> ValueSource:
    """The checked source of the critic's weights; ``ValueError`` naming ``key`` when its config.json cannot give
    a critic of the actor's model (another class, num_labels != 1, other shapes)."""
    if not os.path.isdir(path):
        raise ValueError(f"{key}: {path!r} is not a directory")
    if storage.is_converted_dir(path):
        cfg, head = storage.read_hf_config(storage.hf_assets_dir(path)), None
    else:
        cfg = storage.read_hf_config(path)
        arch = (cfg.get("architectures") or [""])[0]
        head = next((arch for s in HEAD_CLASSES if arch.endswith(s)), None)
        if head is not None:
            if _num_labels(cfg) != 1:
                raise ValueError(f"{key}: {path} is a {arch} with num_labels = {_num_labels(cfg)}; a value head "
                                 f"needs num_labels = 1")
            cfg = _body_config(cfg, model_cfg) if model_cfg is not None else cfg
    if model_cfg is not None:
        try:
            check_model_config_matches(cfg, model_cfg)
        except ValueError as exc:  # CheckpointMismatchError / UnsupportedCheckpointError
            raise ValueError(f"{key}: {path}: {exc} (the critic is the actor's model: model:)") from None
    return ValueSource(key=key, path=path, head=head)


class _BodyReader(storage.SafetensorsReader):
    """The classifier's files without its ``score`` (the body's tensors are then exactly a CausalLM's)."""

    def keys(self):
        return [k for k in super().keys() if k not in _SCORE]


def load_value_model(chunks: Sequence[torch.nn.Module], source: ValueSource, model_cfg: ModelConfig,
                     groups: ActorGroups) -> None:
    """Load a classifier ``source`` (``head`` set) into ``chunks`` whose output layers are already value heads:
    the body's shard of each chunk and the head from ``score``; strict (every name and shape checked)."""
    hf_cfg = _body_config(storage.read_hf_config(source.path), model_cfg)
    geom = dataclasses.replace(HFGeometry.from_hf_config(hf_cfg), tie_word_embeddings=True)  # lm_head: none
    reader = _BodyReader.for_hf_dir(source.path)
    shapes = {n: reader.shape(n) for n in _SCORE if n in storage.SafetensorsReader.keys(reader)}
    if shapes.get("score.weight") != (1, model_cfg.hidden_size) or shapes.get("score.bias", (1,)) != (1,):
        raise ValueError(f"{source.key}: {source.path}: score tensors {shapes}, expected score.weight "
                         f"(1, {model_cfg.hidden_size}) and optionally score.bias (1,)")
    for i, chunk in enumerate(chunks):
        sd = {k: v for k, v in read_chunk_shard(reader, geom, chunk_coords(groups, chunk, i),
                                                padded_vocab_size=model_cfg.vocab_size).items()
              if not k.startswith("output_layer.")}
        if chunk.post_process:
            sd["output_layer.weight"] = reader.read("score.weight")
            sd["output_layer.bias"] = (reader.read("score.bias") if "score.bias" in shapes
                                       else torch.zeros(1, dtype=sd["output_layer.weight"].dtype,
                                                    device=sd["output_layer.weight"].device))
        load_state_dict_into_model(chunk, sd, where=f"{source.key} {source.path} -> {chunk_coords(groups, chunk, i)}")
