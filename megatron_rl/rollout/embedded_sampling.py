"""Token sampling for the embedded engine, with SGLang's log-prob semantics (pure tensor functions).

* ``sampled_logprobs(logits, tokens, temperature)``: ``log_softmax(logits / T)`` over the FULL vocabulary at
  ``tokens`` (``T == 0`` -> raw logits, as SGLang does for greedy), computed in float32.
* ``sample_next_tokens(logits, temperature, top_k, top_p, exp_noise)``: one token per row. ``T == 0`` is greedy
  (argmax). Otherwise probabilities are ``softmax(logits / T)``; top-k and top-p truncate the sampling
  distribution the way SGLang's torch sampler does (sort descending; drop ranks ``>= top_k``; drop tokens whose
  preceding cumulative mass ``> top_p`` — cumulative sums taken on the untruncated probabilities), the kept mass
  is renormalised for SAMPLING only; the returned log-prob is NOT renormalised (``sampled_logprobs``).
  Randomness comes from ``exp_noise`` (Exp(1) draws per row and vocabulary entry, exponential race), so a row's
  token depends only on its own logits and its own random stream — batch composition does not change it.
* ``NoiseBlocks(seeds, vocab_size, steps)``: the same noise as ``exponential_noise`` per step, drawn several
  steps per call (cheaper for small vocabularies).
* ``row_seed(base_seed, prompt_ids, occurrence, sample_index)``: a deterministic 63-bit seed per rollout
  (blake2b of its identity), so a prompt's samples are the same whether it is generated alone or in a batch.

Usage::

    noise = exponential_noise(generators, logits.shape[-1])
    tok = sample_next_tokens(logits, 1.0, top_k=-1, top_p=0.9, exp_noise=noise)
    lp = sampled_logprobs(logits, tok, 1.0)
"""
from __future__ import annotations

import hashlib
import math
import struct
from typing import Sequence

import torch


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits.float() / T)[row, tokens[row]]`` for ``logits`` ``[B, V]`` and ``tokens`` ``[B]``;
    ``temperature == 0`` (greedy) uses the raw logits (SGLang reports greedy log-probs at T=1)."""
    if logits.dim() != 2 or tokens.dim() != 1 or tokens.shape[0] != logits.shape[0]:
        raise ValueError(f"sampled_logprobs: logits must be [B, V] and tokens [B], got logits "
                         f"{tuple(logits.shape)} and tokens {tuple(tokens.shape)}")
    z = logits.float()
    if temperature > 0:
        z = z / float(temperature)
    return torch.log_softmax(z, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def truncated_probs(logits: torch.Tensor, temperature: float, top_k: int = -1,
                    top_p: float = 1.0) -> torch.Tensor:
    """The (unnormalised) sampling distribution after top-k / top-p truncation, ``[B, V]`` in vocabulary order:
    ``softmax(logits / T)`` with truncated entries set to 0 (the most likely token is always kept).

    SGLang's rule: sort descending; drop ranks ``>= top_k``; drop tokens whose preceding cumulative mass
    (computed on the untruncated probabilities) is ``> top_p``. ``temperature`` must be > 0."""
    if temperature <= 0:
        raise ValueError(f"truncated_probs: temperature={temperature} must be > 0 (use greedy for 0)")
    probs = torch.softmax(logits.float() / float(temperature), dim=-1)
    if top_k == -1 and top_p >= 1.0:
        return probs
    probs_sorted, index_sorted = probs.sort(dim=-1, descending=True)
    drop = torch.zeros_like(probs_sorted, dtype=torch.bool)
    if top_k != -1:
        ranks = torch.arange(probs_sorted.shape[-1], device=probs_sorted.device)
        drop |= (ranks >= top_k).unsqueeze(0)
    if top_p < 1.0:
        drop |= (probs_sorted.cumsum(dim=-1) - probs_sorted) > top_p
    drop[:, 0] = False
    drop_vocab = torch.zeros_like(drop).scatter_(-1, index_sorted, drop)
    return probs.masked_fill(drop_vocab, 0.0)


def sample_next_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                       exp_noise: torch.Tensor | None) -> torch.Tensor:
    """Sample one token id per row of ``logits`` ``[B, V]`` (see the module docstring).

    Sampling is an exponential race (equivalent to Gumbel-max): ``argmax_i q_i / E_i`` with ``q`` the truncated
    probabilities and ``E_i ~ Exp(1)`` from ``exp_noise`` ``[B, V]`` — an exact draw from ``q / sum(q)``.
    Unlike inverse-CDF sampling, a tiny (bf16-sized) change of the probabilities flips the choice only when two
    candidates are nearly tied, so results are stable under batch-shape-dependent rounding. ``exp_noise`` is
    ignored (may be None) for greedy ``temperature == 0``."""
    if logits.dim() != 2:
        raise ValueError(f"sample_next_tokens: logits must be [B, V], got {tuple(logits.shape)}")
    if temperature == 0:
        return logits.float().argmax(dim=-1)
    if exp_noise is None or exp_noise.shape != logits.shape:
        raise ValueError(f"sample_next_tokens: exp_noise must be {tuple(logits.shape)} for temperature > 0")
    q = truncated_probs(logits, temperature, top_k, top_p)
    score = torch.where(q > 0, torch.log(q) - torch.log(exp_noise.float()), torch.full_like(q, -math.inf))
    return score.argmax(dim=-1)


def exponential_noise(generators: Sequence[torch.Generator], vocab_size: int) -> torch.Tensor:
    """``[len(generators), vocab_size]`` Exp(1) draws, row ``r`` from ``generators[r]`` only."""
    return torch.stack([torch.empty(vocab_size).exponential_(generator=g) for g in generators])


class NoiseBlocks:
    """Per-step Exp(1) noise of a batch of rows, row ``r`` from its own generator seeded with ``seeds[r]``: the
    draws of ``exponential_noise`` called once per step on those generators (a generator's draws form one stream,
    so ``k`` steps drawn in one call per row equal ``k`` calls of one step), drawn ``k`` steps at a time --
    one call per row per block instead of one per row per step -- with blocks of at most ``max_floats`` values.
    When one block holds every step, one generator is re-seeded row after row (no generator per row).

    ``step(t)`` (``t = 0, 1, ...`` in order, ``< steps``) returns a contiguous ``[len(seeds), vocab_size]``."""

    def __init__(self, seeds: Sequence[int], vocab_size: int, steps: int, max_floats: int = 1 << 22):
        self.seeds = [int(s) for s in seeds]
        self.vocab_size, self.steps = int(vocab_size), int(steps)
        self.block = max(1, min(self.steps, max_floats // max(1, len(self.seeds) * self.vocab_size)))
        self.generators = None  # per-row generators, when the steps take several blocks
        self._start, self._buf = 0, None

    def step(self, t: int) -> torch.Tensor:
        end = self._start + (0 if self._buf is None else self._buf.shape[0])
        if not self._start <= t < end:
            if t != end or t >= self.steps:
                raise ValueError(f"NoiseBlocks.step({t}): steps must come in order 0..{self.steps - 1} "
                                 f"(next: {end})")
            k = min(self.block, self.steps - t)
            raw = torch.empty(len(self.seeds), k, self.vocab_size)
            if k == self.steps:  # every step in this one block: each row's stream is needed once
                g = torch.Generator()
                for row, s in zip(raw.unbind(0), self.seeds):
                    row.exponential_(generator=g.manual_seed(s))
            else:
                if self.generators is None:
                    self.generators = [torch.Generator().manual_seed(s) for s in self.seeds]
                for row, g in zip(raw.unbind(0), self.generators):
                    row.exponential_(generator=g)
            self._start, self._buf = t, raw.transpose(0, 1).contiguous()
        return self._buf[t - self._start]


def row_seed(base_seed: int, prompt_ids: Sequence[int], occurrence: int, sample_index: int) -> int:
    """Deterministic 63-bit seed of one rollout: a hash of the call's ``base_seed``, the prompt's token ids,
    which ``occurrence`` of that identical prompt in the call it is, and the ``sample_index`` (0..n-1)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<qqq", int(base_seed) & ((1 << 63) - 1), int(occurrence), int(sample_index)))
    h.update(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids))
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)
