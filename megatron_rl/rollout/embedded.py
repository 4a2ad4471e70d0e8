"""``EmbeddedEngine``: in-process rollouts from an HF ``transformers`` causal LM (Qwen2, Llama, ...) — the
embedded default, no server.

Rule: every rollout has its own random stream seeded by (call seed, prompt ids, occurrence, sample index), so
results do not depend on the batch they ran in; log-probs have SGLang's semantics (``embedded_sampling``). What a
call does, weights, MoE routing: docs/engines.md.

Usage::

    engine = EmbeddedEngine("/models/tiny_copy", dtype="bfloat16", seed=0, weight_version="0")
    rollouts = engine.generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_new_tokens=8), n=4)
    engine.update_weights_from_state_dict(actor_hf_state_dict, version="1")
"""
from __future__ import annotations

import os
from typing import Mapping

import torch

from megatron_rl.rollout.base import (
    Rollout,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    WeightSyncError,
    validate_n,
    validate_prompts,
)
from megatron_rl.rollout.embedded_sampling import (
    NoiseBlocks,
    row_seed,
    sample_next_tokens,
    sampled_logprobs,
)
from megatron_rl.weight_sync.receivers.embedded import BucketLoader, load_state_dict_checked, read_weight_update
from megatron_rl.rollout.embedded_lora import EmbeddedAdapters
from megatron_rl.rollout.finish import stop_ids
from megatron_rl.weight_sync.endpoint import SyncCapabilities, WeightHolding, tensor_checksum
from megatron_rl.weight_sync.layout import transformers_layout
from megatron_rl.rollout.routing import RouterCapture

#: Engine compute dtypes by name.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _eos_ids(config, generation_config) -> tuple[int, ...]:
    """EOS ids from the generation config (preferred) or the model config; ints or lists."""
    for src in (generation_config, config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is None:
            continue
        return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ()


def fuse_expert_tensors(state_dict: Mapping[str, torch.Tensor], model_keys) -> Mapping[str, torch.Tensor]:
    """Per-expert HF tensors (``...mlp.experts.{e}.gate_proj / up_proj / down_proj.weight``, the safetensors
    format an export writes) -> the fused in-memory tensors transformers >= 5 keeps for Qwen2/3-MoE
    (``...mlp.experts.gate_up_proj [E, 2F, H]``, ``...mlp.experts.down_proj [E, H, F]``) when the model has
    those; anything else passes through (a missing expert is then reported by the strict check)."""
    fused = [k[: -len("gate_up_proj")] for k in model_keys if k.endswith("mlp.experts.gate_up_proj")]
    if not fused or any(k.endswith("mlp.experts.gate_up_proj") for k in state_dict):
        return state_dict
    out = dict(state_dict)
    for pre in fused:
        gates, ups, downs, e = [], [], [], 0
        while f"{pre}{e}.gate_proj.weight" in out:
            gates.append(out.pop(f"{pre}{e}.gate_proj.weight"))
            ups.append(out.pop(f"{pre}{e}.up_proj.weight"))
            downs.append(out.pop(f"{pre}{e}.down_proj.weight"))
            e += 1
        if e:
            out[f"{pre}gate_up_proj"] = torch.stack([torch.cat([g, u], 0) for g, u in zip(gates, ups)])
            out[f"{pre}down_proj"] = torch.stack(downs)
    return out


class EmbeddedEngine(RolloutEngine):
    """In-process generation with an HF ``transformers`` causal LM (see the module docstring)."""

    #: Disk exports or in-process buckets ("distributed" has no servers to reach); both arrive whole on rank 0 (the
    #: export path; the model's buckets), so the async producer can load them later; auto: "tensor", sync or async.
    sync_capabilities = SyncCapabilities(modes=("disk", "tensor"), deferred=("disk", "tensor"),
                                         default_sync="tensor", default_async="tensor")
    #: Every rollout's random stream is seeded by the call's ``seed`` (see the module docstring).
    seeded_sampling = True
    #: LoRA adapters sent alone are applied in the forward (``embedded_lora``; rollout.lora_sync: adapter).
    lora_adapter_sync = True

    @classmethod
    def describe(cls, rollout) -> str:
        """"embedded" (one in-process model on rank 0)."""
        return "embedded"

    def __init__(self, model_path: str | os.PathLike, dtype: str = "bfloat16", seed: int = 0,
                 weight_version: str = "init", attn_implementation: str = "sdpa",
                 max_batch_rows: int = 256, source: str = "embedded", capture_routing: bool | None = None):
        """Load the HF checkpoint at ``model_path`` in ``dtype`` ("bfloat16" | "float16" | "float32").

        Args:
            seed: seeds the engine's generator (call seeds when ``generate`` gets none).
            weight_version: the version tag of the initial weights.
            attn_implementation: ``transformers`` attention backend ("sdpa" or "eager").
            max_batch_rows: rows (prompts x n) generated together; larger requests run in chunks.
            source: ``Rollout.source`` of every rollout.
            capture_routing: record MoE routing per rollout (None: when the model has MoE routers).
        """
        if dtype not in DTYPES:
            raise ValueError(f"EmbeddedEngine dtype={dtype!r} must be one of {sorted(DTYPES)}")
        if not isinstance(max_batch_rows, int) or max_batch_rows < 1:
            raise ValueError(f"EmbeddedEngine max_batch_rows={max_batch_rows!r} must be an int >= 1")
        if not os.path.isdir(model_path):
            raise ValueError(f"EmbeddedEngine model_path={str(model_path)!r} is not a directory")
        import transformers
        from transformers import AutoModelForCausalLM, GenerationConfig

        transformers.utils.logging.disable_progress_bar()
        self.dtype = DTYPES[dtype]
        self.dtype_name = dtype
        self.model_path = str(model_path)
        self.max_batch_rows = max_batch_rows
        self.source = source
        try:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype,
                                                              attn_implementation=attn_implementation)
        except Exception as e:
            raise ValueError(f"EmbeddedEngine: cannot load an HF causal LM from {self.model_path!r}: "
                             f"{type(e).__name__}: {e}") from e
        self.model.eval()
        self.model.requires_grad_(False)
        self.config = self.model.config
        try:
            gen_cfg = GenerationConfig.from_pretrained(self.model_path)
        except Exception:  # no generation_config.json
            gen_cfg = None
        self.eos_token_ids = _eos_ids(self.config, gen_cfg)
        pad = getattr(self.config, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0))
        self.vocab_size = int(self.config.vocab_size)
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self.tied_lm_head = bool(getattr(self.config, "tie_word_embeddings", False))
        self._capture = RouterCapture(self.model)
        if capture_routing and not self._capture.enabled:
            raise ValueError(f"EmbeddedEngine capture_routing=True but {self.model_path!r} has no MoE routers")
        self.capture_routing = self._capture.enabled if capture_routing is None else bool(capture_routing)
        self._generator = torch.Generator().manual_seed(int(seed))
        self._version = str(weight_version)
        self._invalid: str | None = None  # why the weights must not be served (a failed bucketed sync)
        self._adapters = EmbeddedAdapters(self.model, self.dtype)  # adapter-only LoRA sync (none installed)

    # ------------------------------------------------------------------ interface
    @property
    def weight_version(self) -> str | None:
        """The version tag of the weights currently loaded."""
        return self._version

    def get_rng_state(self) -> torch.Tensor:
        """The engine generator's state (for checkpoints; or pass ``generate(..., seed=f(step))`` instead)."""
        return self._generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore a state from ``get_rng_state`` (resume reproduces the uninterrupted run)."""
        self._generator.set_state(state)

    def health(self) -> dict[str, bool]:
        """``{source: True}`` while the model is loaded."""
        return {self.source: self.model is not None}

    def close(self) -> None:
        """Drop the model."""
        self.model = None

    def update_weights(self, hf_dir: str, version: str) -> None:
        """Load the HF checkpoint tensors in ``hf_dir`` and tag them ``version`` (all-or-nothing)."""
        self._require_model(generating=False)
        sd = read_weight_update(hf_dir)
        self.update_weights_from_state_dict(sd, version, _source=repr(str(hf_dir)))

    def update_weights_from_state_dict(self, state_dict: Mapping[str, torch.Tensor], version: str,
                                       _source: str = "the state dict") -> None:
        """Copy a full HF-named ``state_dict`` (any float dtype; cast to the engine dtype) into the model and
        tag it ``version``. Every name and shape is checked first; on error the weights and version are
        unchanged and ``WeightSyncError`` names the bad keys."""
        self._require_model(generating=False)
        if not isinstance(version, str) or not version:
            raise ValueError(f"update_weights: version={version!r} must be a non-empty string")
        if not isinstance(state_dict, Mapping):
            raise WeightSyncError(f"update_weights_from_state_dict: expected a mapping name -> tensor, got "
                                  f"{type(state_dict).__name__}")
        state_dict = fuse_expert_tensors(state_dict, self.model.state_dict().keys())
        load_state_dict_checked(self.model, state_dict, source=_source, tied_lm_head=self.tied_lm_head)
        self._mark_synced(version)

    # ------------------------------------------------------------------ bucketed sync (rollout.weight_sync)
    def weight_holding(self, hf_names, geometry=None, verify: bool = False) -> WeightHolding:
        """The engine's compute dtype (buckets arrive cast to it); full precision: floating parameters / buffers
        transformers keeps in another dtype (e.g. fp32 ``e_score_correction_bias`` of DeepSeek-V3 in a bf16 model);
        verified: the model's own tensors built from ``hf_names`` (fused experts included; rotary buffers not),
        hashed with ``tensor_checksum``."""
        self._require_model(generating=False)
        own = self.model.state_dict()
        keep = frozenset(n for n, t in own.items() if t.is_floating_point() and t.dtype != self.dtype)
        if not verify:
            return WeightHolding(dtype=self.dtype, full_precision=keep)
        layout = transformers_layout(hf_names, {k for k in own if not k.endswith("inv_freq")})
        return WeightHolding(dtype=self.dtype, full_precision=keep, checksum=tensor_checksum, layout=tuple(layout))

    def begin_weight_sync(self, version: str, timeout_s: float, groups=None) -> BucketLoader:
        """A ``BucketLoader`` copying each bucket into the model as it arrives (every sender's buckets come to
        this process: no update groups)."""
        self._require_model(generating=False)
        if groups is not None:
            raise WeightSyncError("EmbeddedEngine receives weights in the trainer's rank-0 process, not over update "
                                  "groups (rollout.weight_sync: distributed is for SGLang servers)")
        if not isinstance(version, str) or not version:
            raise ValueError(f"begin_weight_sync: version={version!r} must be a non-empty string")
        return BucketLoader(self, version, float(timeout_s or 600.0))

    def weight_checksums(self, names) -> dict:
        """``{"embedded": {name: (tensor_checksum of the engine's copy,)}}``."""
        self._require_model(generating=False)
        own = self.model.state_dict()
        missing = [n for n in names if n not in own]
        if missing:
            raise WeightSyncError(f"EmbeddedEngine has no tensor(s) {missing[:8]}")
        return {"embedded": {n: (tensor_checksum(own[n]),) for n in names}}

    # ------------------------------------------------------------------ adapter-only sync (rollout.lora_sync)
    def load_lora_adapter(self, tensors: Mapping[str, torch.Tensor], scale: float, version: str) -> None:
        """Apply the LoRA adapter ``tensors`` (PEFT names; ``scale`` = alpha / rank) over the base weights and tag
        ``version`` (all-or-nothing: ``embedded_lora.EmbeddedAdapters``)."""
        self._require_model(generating=False)
        self._adapters.load(tensors, scale, version)
        self._mark_synced(version)

    def token_log_probs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token t | tokens < t) at temperature 1 for t >= 1 of each sequence, as the engine (adapter
        included) computes it: the probe of adapter-only sync verification."""
        self._require_model(generating=False)
        out = []
        with torch.no_grad():
            for seq in sequences:
                ids = torch.tensor([seq], dtype=torch.long, device=next(self.model.parameters()).device)
                logits = self.model(input_ids=ids).logits[0, :-1].float()
                out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).cpu().tolist())
        return out

    def _mark_synced(self, version: str) -> None:
        self._version = version
        self._invalid = None

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams, n: int = 1,
                 seed: int | None = None) -> list[Rollout]:
        """Sample ``n`` responses per prompt (prompt-major), all tagged with the current weight version.

        ``seed`` fixes this call's randomness (default: drawn from the engine's generator). Raises
        ``ValueError`` for bad input (before any work) and ``RolloutError`` if generation fails."""
        self._require_model()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        prompts = validate_prompts(prompt_ids, vocab_size=self.vocab_size)
        n = validate_n(n)
        for i, p in enumerate(prompts):
            if len(p) + sampling.max_new_tokens > self.max_positions:
                raise ValueError(f"prompt_ids[{i}] has {len(p)} tokens; with max_new_tokens="
                                 f"{sampling.max_new_tokens} that exceeds the model's "
                                 f"max_position_embeddings={self.max_positions}")
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), generator=self._generator).item())
        occurrence: dict[tuple[int, ...], int] = {}
        rows = []  # (prompt_index, prompt, row seed)
        for i, p in enumerate(prompts):
            occ = occurrence.get(tuple(p), 0)
            occurrence[tuple(p)] = occ + 1
            for j in range(n):
                rows.append((i, p, row_seed(seed, p, occ, j)))
        version = self._version
        out: list[Rollout] = []
        try:
            for start in range(0, len(rows), self.max_batch_rows):
                chunk = rows[start:start + self.max_batch_rows]
                out.extend(self._generate_rows(chunk, sampling, version))
        except RolloutError:
            raise
        except Exception as e:
            raise RolloutError(f"EmbeddedEngine.generate failed: {type(e).__name__}: {e}") from e
        if self._version != version:  # weights changed concurrently: the batch mixes versions
            raise RolloutError(f"EmbeddedEngine: weights changed from {version!r} to {self._version!r} "
                               "during generate")
        return out

    # ------------------------------------------------------------------ internals
    def _require_model(self, generating: bool = True):
        if self.model is None:
            raise RolloutError("EmbeddedEngine is closed")
        if generating and self._invalid is not None:
            raise WeightSyncError(f"EmbeddedEngine will not generate until a weight sync succeeds: {self._invalid}")

    @torch.no_grad()
    def _generate_rows(self, rows, sampling: SamplingParams, version: str) -> list[Rollout]:
        """Generate one batch of rows ``(prompt_index, prompt_ids, row_seed)`` (capturing routing if on)."""
        if not self.capture_routing:
            return self._generate_rows_inner(rows, sampling, version, None)
        with self._capture as cap:
            return self._generate_rows_inner(rows, sampling, version, cap)

    def _generate_rows_inner(self, rows, sampling: SamplingParams, version: str,
                             cap: RouterCapture | None) -> list[Rollout]:
        B, T = len(rows), sampling.max_new_tokens
        # one prefill per distinct prompt (the n samples of a prompt share it, as a prefix cache would share
        # it), its KV cache and last logits then copied to every row of that prompt
        distinct: dict[tuple[int, ...], int] = {}
        of_row = [distinct.setdefault(tuple(p), len(distinct)) for _, p, _ in rows]
        input_ids, mask = left_padded(list(distinct), self.pad_token_id)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        L = input_ids.shape[1]
        greedy = sampling.temperature == 0
        stop_t = torch.tensor(sorted(stop_ids(sampling, self.eos_token_ids)), dtype=torch.long)

        # logits_to_keep=1: only the last position's logits (a [B, L, V] prefill tensor would not fit for real vocabularies)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        cache = out.past_key_values
        logits = out.logits[:, -1, :]
        routed: list[list[torch.Tensor]] = [[] for _ in range(B)]
        if cap is not None:  # prefill: [prompts * L, layers, k], left padding -> the prompt is the last len(p)
            pre = cap.take()
            pre = pre.reshape(len(distinct), L, pre.shape[-2], pre.shape[-1])
            for r, (_, p, _) in enumerate(rows):
                routed[r].append(pre[of_row[r], L - len(p):])
        if len(distinct) < B:
            index = torch.tensor(of_row, dtype=torch.long)
            logits, mask, positions = logits[index], mask[index], positions[index]
            cache = select_cache_rows(cache, index)
        last_pos = positions[:, -1]
        noise = None if greedy else NoiseBlocks([s for _, _, s in rows], logits.shape[-1], T)

        tokens = torch.zeros((B, T), dtype=torch.long)
        logps = torch.zeros((B, T), dtype=torch.float32)
        length = torch.full((B,), T, dtype=torch.long)  # response length of each row (T: not stopped)
        stopped = torch.zeros(B, dtype=torch.bool)
        done = torch.zeros(B, dtype=torch.bool)
        for step in range(T):
            if not torch.isfinite(logits[~done].float()).all():
                bad = [r for r in range(B) if not done[r] and not torch.isfinite(logits[r].float()).all()]
                raise RolloutError(f"EmbeddedEngine: non-finite logits at generation step {step} for rows "
                                   f"{bad[:8]} (prompt indices {[rows[r][0] for r in bad[:8]]}); "
                                   f"weight version {version!r}")
            nxt = sample_next_tokens(logits, sampling.temperature, sampling.top_k, sampling.top_p,
                                     None if greedy else noise.step(step))
            tokens[:, step] = nxt
            logps[:, step] = sampled_logprobs(logits, nxt, sampling.temperature)
            # a stop token ends the response, also when it is the last allowed one
            new_stop = torch.isin(nxt, stop_t) & ~done if len(stop_t) else torch.zeros(B, dtype=torch.bool)
            length[new_stop] = step + 1
            stopped |= new_stop
            done |= new_stop
            if bool(done.all()) or step == T - 1:
                break
            feed = torch.where(done, torch.full_like(nxt, self.pad_token_id), nxt).unsqueeze(-1)
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype)], dim=1)
            last_pos = last_pos + 1
            out = self.model(input_ids=feed, attention_mask=mask, position_ids=last_pos.unsqueeze(-1),
                             past_key_values=cache, use_cache=True)
            if cap is not None:  # decode: [B, layers, k]; rows still running fed their last sampled token
                dec = cap.take()
                for r in range(B):
                    if not done[r]:
                        routed[r].append(dec[r:r + 1])
            cache = out.past_key_values
            logits = out.logits[:, -1, :]

        # one host copy of each tensor (per-element tensor indexing costs microseconds per row and token)
        tok_l, lp_l, len_l, stop_l = tokens.tolist(), logps.tolist(), length.tolist(), stopped.tolist()
        result = []
        for r, (i, p, _) in enumerate(rows):
            n_r = len_l[r]
            info = {"matched_stop": tok_l[r][n_r - 1]} if stop_l[r] else {}
            result.append(Rollout(prompt_index=i, prompt_ids=list(p), response_ids=tok_l[r][:n_r],
                                  rollout_log_probs=lp_l[r][:n_r], finish_reason="stop" if stop_l[r] else "length",
                                  weight_version=version, source=self.source, info=info,
                                  routed_experts=torch.cat(routed[r]) if cap is not None else None))
        return result


def left_padded(prompts, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[len(prompts), longest]`` of token-id sequences, left padded with
    ``pad_id``."""
    L = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for r, p in enumerate(prompts):
        input_ids[r, L - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[r, L - len(p):] = 1
    return input_ids, mask


def select_cache_rows(cache, index: torch.Tensor):
    """The KV cache of batch rows ``index`` (a row may repeat): an HF ``Cache`` is reordered in place
    (``reorder_cache``), a legacy tuple of per-layer tensors is rebuilt."""
    if hasattr(cache, "reorder_cache"):
        cache.reorder_cache(index)
        return cache
    return tuple(tuple(t.index_select(0, index) for t in layer) for layer in cache)
