"""The actor's numeric precision, decided once from ``ActorConfig`` where the actor is built.

    prec = Precision.from_actor_config(job_cfg.actor)   # Precision(params_dtype=torch.bfloat16, ...)
    chunks = build_gpt_model(model_cfg, parallel_cfg, params_dtype=prec.params_dtype)
    prec.apply_output_layer(chunks)                      # fp32 output layer when asked

``actor.bf16`` (Megatron's ``--bf16``): bf16 parameters and compute; the Megatron optimizer keeps fp32 main
parameters (``OptimizerConfig.bf16``) and DDP accumulates and all-reduces gradients in fp32
(``grad_reduce_in_fp32``, Megatron-LM's ``--accumulate-allreduce-grads-in-fp32``) -- each micro-batch's weight
gradient itself is bf16 (autograd's, in the parameter's dtype; ``gradient_accumulation_fusion=False``), added into
the fp32 ``main_grad`` buffer. The loss and the log-prob
pass compute log-softmax / entropy in fp32 from the logits (``megatron_rl.logprobs``), whatever their dtype.
``actor.fp32_output_layer``: the output layer's weight stays fp32 and its matmul runs in fp32 (fp32 logits); it
needs ``actor.use_distributed_optimizer`` (``precision_error``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["Precision", "precision_error"]


def precision_error(actor_cfg) -> Optional[str]:
    """The problem with ``actor.bf16`` / ``actor.fp32_output_layer`` / ``actor.use_distributed_optimizer`` together
    (naming the key), or None. megatron's non-distributed mixed-precision optimizer cannot checkpoint a param group
    that mixes fp32 and bf16 weights (its sharded state dict numbers the bf16 parameters only: KeyError on save),
    so the fp32 output layer needs the distributed optimizer (``platform/distrib_optimizer`` orders its map)."""
    bf16 = bool(getattr(actor_cfg, "bf16", False))
    fp32_out = bool(getattr(actor_cfg, "fp32_output_layer", False))
    if fp32_out and not bf16:
        return "actor.fp32_output_layer: only with actor.bf16: true (an fp32 actor's output layer is fp32 already)"
    if fp32_out and not getattr(actor_cfg, "use_distributed_optimizer", False):
        return ("actor.fp32_output_layer: needs actor.use_distributed_optimizer: true (megatron's non-distributed "
                "mixed-precision optimizer cannot checkpoint fp32 and bf16 weights in one param group)")
    return None


@dataclass(frozen=True)
class Precision:
    """How the actor's parameters and output layer are stored and computed."""

    params_dtype: torch.dtype = torch.float32
    """dtype of the model parameters and activations (fp32 or bf16)."""
    fp32_output_layer: bool = False
    """The output layer's weight is fp32 and its matmul runs in fp32 (only with bf16 parameters)."""

    @classmethod
    def from_actor_config(cls, actor_cfg) -> "Precision":
        """``actor.bf16`` / ``actor.fp32_output_layer`` (checked by ``plan.validate_job``; ValueError here as well, for
        actors built without it)."""
        problem = precision_error(actor_cfg)
        if problem is not None:
            raise ValueError(problem)
        return cls.requested(actor_cfg)

    @classmethod
    def requested(cls, actor_cfg) -> "Precision":
        """What ``actor.bf16`` / ``actor.fp32_output_layer`` ask for, unchecked (for the checks of other keys when
        ``from_actor_config`` refused the pair): an fp32 output layer only on a bf16 actor."""
        bf16 = bool(getattr(actor_cfg, "bf16", False))
        return cls(params_dtype=torch.bfloat16 if bf16 else torch.float32,
                   fp32_output_layer=bool(getattr(actor_cfg, "fp32_output_layer", False)) and bf16)

    @property
    def bf16(self) -> bool:
        """bf16 parameters (Megatron's ``bf16``)."""
        return self.params_dtype == torch.bfloat16

    def describe(self) -> str:
        """``"bf16 params, fp32 output layer"`` / ``"fp32 params"`` (the job plan's actor line)."""
        return f"{'bf16' if self.bf16 else 'fp32'} params" + (", fp32 output layer" if self.fp32_output_layer else "")

    @property
    def params_bytes(self) -> int:
        """Bytes per model parameter."""
        return torch.empty((), dtype=self.params_dtype).element_size()

    def apply_output_layer(self, chunks: Sequence[torch.nn.Module]) -> None:
        """With ``fp32_output_layer``: on the chunk(s) holding the output layer, make its weight fp32 (the shared
        embedding weight when tied) and run it in fp32; the tied embedding's output goes back to bf16. Call
        before DDP wrapping (DDP buffers follow the parameters' dtypes). No-op otherwise."""
        if not self.fp32_output_layer:
            return
        for chunk in chunks:
            _fp32_output_layer(chunk, self.params_dtype)


def _to_fp32(module: torch.nn.Module, name: str) -> None:
    """``module.<name>`` (a parameter) as an fp32 parameter, keeping megatron's attributes on it."""
    old = getattr(module, name)
    new = torch.nn.Parameter(old.detach().to(torch.float32), requires_grad=old.requires_grad)
    for k, v in vars(old).items():  # tensor_model_parallel, partition_dim, shared, sequence_parallel, ...
        setattr(new, k, v)
    setattr(module, name, new)


def _fp32_output_layer(chunk: torch.nn.Module, compute_dtype: torch.dtype) -> None:
    post = getattr(chunk, "post_process", False)
    if post:
        out = chunk.output_layer
        if getattr(out, "weight", None) is not None:
            _to_fp32(out, "weight")
        out.register_forward_pre_hook(_inputs_to_fp32, with_kwargs=True)
    tied = getattr(chunk, "share_embeddings_and_output_weights", False)
    if tied and getattr(chunk, "pre_process", False):
        emb = chunk.embedding.word_embeddings
        _to_fp32(emb, "weight")
        emb.register_forward_hook(lambda _m, _a, y: y.to(compute_dtype))
    # tied at PP > 1: the last stage's own copy (output_layer.weight, kept in sync by megatron) is fp32 above


def _inputs_to_fp32(_module, args, kwargs):
    args = tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
    kwargs = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}
    return args, kwargs
