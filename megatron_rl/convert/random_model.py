"""Write a randomly initialised HF causal LM to a directory: the one builder of tiny models.

The tiny task models (``megatron_rl.tasks.char_tokenizer.build_task_model``) and the test checkpoints
(``megatron_rl.convert.tiny_hf.build_tiny_hf_model``) choose a ``transformers`` config and a tokenizer;
this module turns the config into weights on disk: ``architectures`` set from ``model_type``, weights
initialised by ``transformers`` under ``torch.manual_seed(seed)`` (the caller's RNG state is left as it
was), fp32 (or ``dtype``) safetensors, ``config.json`` recording the ``dtype`` (readers such as SGLang's
``--dtype auto`` look at it). Same config and seed -> byte-identical files.

    path = write_random_hf_model(transformers.Qwen2Config(...), "out_dir", seed=0)
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_rl.convert.hf_config import ARCHITECTURES

__all__ = ["write_random_hf_model"]


def write_random_hf_model(config, out_dir: str | os.PathLike, seed: int, dtype: str = "float32") -> str:
    """Write a random-init model for the ``transformers`` config ``config`` (a supported ``model_type``)
    to ``out_dir`` (created; files in it overwritten) with weights in ``dtype`` and return the path."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if config.model_type not in ARCHITECTURES:
        raise ValueError(f"model_type={config.model_type!r} is not one of {sorted(ARCHITECTURES)}")
    config.architectures = [ARCHITECTURES[config.model_type]]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    transformers.utils.logging.disable_progress_bar()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    cfg_path = out / "config.json"
    data = json.loads(cfg_path.read_text())
    data["dtype"] = dtype
    cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return str(out)
