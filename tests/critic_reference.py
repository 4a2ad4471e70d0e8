"""The critic tests' single-process reference: HF transformers (fp32) body + a plain [hidden -> 1] head, and verl
0.9.1's own ``compute_value_loss`` (the vendored core_algos, ``tests/verl_core_algos.py``) on the whole batch.
No megatron, no micro-batches, no parallelism."""
from __future__ import annotations

import torch


def reference_values(model, tokens: torch.Tensor, head_w: torch.Tensor, head_b: torch.Tensor) -> torch.Tensor:
    """[B, L-1] values: the final-norm hidden state of position t through the head (value of the state before
    token t+1)."""
    hidden = model.model(input_ids=tokens).last_hidden_state
    return (hidden @ head_w.t() + head_b)[..., 0][:, :-1]


def reference_step(verl, model, tokens, head_w, head_b, values, returns, mask, cliprange: float, agg: str):
    """verl's value loss of the whole batch and its gradients: (loss, clipfrac, {HF name: grad}, head grads,
    grad norm of everything, vpred mean)."""
    w = head_w.clone().requires_grad_(True)
    b = head_b.clone().requires_grad_(True)
    model.zero_grad()
    vpreds = reference_values(model, tokens, w, b)
    loss, clipfrac = verl.compute_value_loss(vpreds, returns, values, mask, cliprange, loss_agg_mode=agg)
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in model.named_parameters()}
    every = [g for n, g in grads.items() if n != "lm_head.weight"] + [w.grad, b.grad]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in every))
    vmean = (vpreds.detach() * mask).sum() / mask.sum()
    return float(loss.detach()), float(clipfrac), grads, (w.grad.clone(), b.grad.clone()), float(norm), float(vmean)
