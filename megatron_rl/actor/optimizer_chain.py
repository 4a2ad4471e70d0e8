"""Whether a checkpoint's optimizer tensors were saved under another chaining of megatron's optimizers.

megatron builds a separate optimizer for the expert parameters only at ``expert_model_parallel_size`` > 1 and
keys a chained optimizer's tensors ``chained_<i>.optimizer.state...``; one optimizer keys them ``optimizer.state...``.
The actor's checkpoints do not convert between the two, so a requested optimizer tensor that the checkpoint holds
only under another ``chained_<i>.`` prefix is refused before anything is read (naming both expert-parallel sizes
and the key), not failed inside the load. Compared key by key: a pipeline stage may hold one optimizer while
another holds two.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Optional

__all__ = ["requested_keys", "chain_problem"]

_CHAIN = re.compile(r"^chained_\d+\.")


def requested_keys(sharded_state_dict: Any) -> Iterable[str]:
    """The keys of the sharded tensors / objects in a (nested) sharded state dict."""
    if isinstance(sharded_state_dict, dict):
        for v in sharded_state_dict.values():
            yield from requested_keys(v)
    elif isinstance(sharded_state_dict, (list, tuple)):
        for v in sharded_state_dict:
            yield from requested_keys(v)
    elif isinstance(getattr(sharded_state_dict, "key", None), str):
        yield sharded_state_dict.key


def _bare(key: str) -> str:
    return _CHAIN.sub("", key, count=1)


def chain_problem(requested: Iterable[str], saved_keys: Iterable[str], saved_ep: Any, now_ep: Any) -> Optional[str]:
    """None unless a requested key is missing from the checkpoint but saved under another chaining; then the
    refusal (without the checkpoint's name)."""
    saved = set(saved_keys)
    by_bare = {_bare(k): k for k in saved}
    for key in requested:
        other = by_bare.get(_bare(key))
        if key not in saved and other is not None:
            return (f"its optimizer state was saved under another chaining of megatron's optimizers ({other!r}, "
                    f"this actor asks for {key!r}; expert_model_parallel_size saved {saved_ep}, now {now_ep}): "
                    f"megatron builds a separate expert optimizer only at expert_model_parallel_size > 1 and the two "
                    f"optimizer layouts are not converted; resume at an expert_model_parallel_size on the same side "
                    f"of 1 as when saved, or load the model part alone (MegatronActor.load_model_state; docs/lora.md)")
    return None
