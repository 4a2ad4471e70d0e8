"""The weight-sync part of ``megatron-rl check``: what one trainer -> engine sync moves and holds (``SyncPlan``).

``weight_sync_plan(settings, rollout, model, parallel, precision, total_params)`` plans the job's
``WeightSyncSettings`` (its plan's: the mode resolved): bytes per sync (every
parameter once in ``rollout.dtype``), the senders and their bytes, host memory on rank 0 and on the other senders,
an estimated time at an ASSUMED bandwidth (``DISK_GBPS`` / ``LINK_GBPS``: planning only; measure with
``tools/bench_weight_sync.py``), and for ``rollout.weight_sync_delta`` the expected delta bytes and the copies it
keeps. docs/weight_sync.md ("What check plans") says what each number counts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

from megatron_rl.actor.precision import Precision
from megatron_rl.ops.memory import layer_counts, stage_layers
from megatron_rl.weight_sync import shm
from megatron_rl.weight_sync.delta import sparse_nbytes
from megatron_rl.weight_sync.settings import WeightSyncSettings

__all__ = ["SyncPlan", "weight_sync_plan", "DISK_GBPS", "LINK_GBPS", "DELTA_CHANGED_FRAC"]

DISK_GBPS = 2.0
"""Assumed disk bandwidth (GB/s) of the disk mode: the export is written once and read once."""
LINK_GBPS = 20.0
"""Assumed bandwidth (GB/s) of the in-memory modes (host copy / NCCL broadcast to the engine)."""
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DELTA_CHANGED_FRAC = 0.05
"""Assumed fraction of the elements a step changes for the delta estimate (measured 3.8 % per step on the tiny
models at lr 1e-6; NeMo-RL reports 3-5 % for RL learning rates)."""


@dataclass
class SyncPlan:
    """One weight sync of the job (bytes, seconds)."""

    mode: str
    """The resolved rollout.weight_sync mode."""
    bytes_per_sync: float
    """Every parameter once, in the engine's dtype."""
    bucket_bytes: float
    """rollout.weight_sync_bucket_mb in bytes (0 for disk)."""
    rank0_host_bytes: float
    """Extra host memory of a sync on global rank 0."""
    leader_host_bytes: float
    """Extra host memory on every other sender (0 with one sender or for disk)."""
    seconds: float
    """Estimated time at the assumed bandwidth."""
    gbps: float
    """The bandwidth the estimate assumes."""
    shared_dir: str = ""
    """disk mode with SGLang servers: the export directory, which the servers load by path, so it must be on a
    filesystem the trainer's rank 0 and every server share ("" otherwise)."""
    delta_bytes: float = 0.0
    """rollout.weight_sync_delta: expected bytes of a delta sync at ``DELTA_CHANGED_FRAC`` (0: no delta)."""
    senders: List[Tuple[str, float]] = field(default_factory=list)
    """In-memory modes: each sender ("stage S EP rank E") and the bytes it sends per sync."""
    delta_copy_bytes: List[float] = field(default_factory=list)
    """rollout.weight_sync_delta: each sender's copy of its own tensors (host memory of that rank; in
    ``senders`` order), already part of ``rank0_host_bytes`` / ``leader_host_bytes``."""
    engine_store_bytes: float = 0.0
    """rollout.weight_sync_delta with SGLang: the model each server TP process keeps in its host memory."""
    server_tp: int = 0
    """The TP size of the one SGLang server this job launches (``rollout.sglang_launch`` without
    ``sglang_urls``: 1); 0 when servers are given by URL (their TP is not in the config)."""
    segments: List[Segment] = field(default_factory=list)
    """The shared-memory segments the syncs keep for the job's life (``weight_sync.shm.segment_bytes``)."""

    def line(self) -> str:
        """One line for the check output."""
        mem = f"rank 0 +{_binary(self.rank0_host_bytes)} host"
        if self.leader_host_bytes:
            mem += f", other senders +{_binary(self.leader_host_bytes)}"
        bucket = f", buckets of {self.bucket_bytes / 2**20:g} MiB" if self.bucket_bytes else ""
        per_sync = _decimal(self.bytes_per_sync)
        out = (f"weight sync ({self.mode}{bucket}): {per_sync} per sync, {mem}; "
               f"~{self.seconds:.1f} s at an assumed {self.gbps:g} GB/s (measure: tools/bench_weight_sync.py)")
        if self.senders:
            big = max(b for _, b in self.senders)
            each = ", ".join(f"{n} {_binary(b)}" for n, b in self.senders[:8])
            more = f", ... ({len(self.senders) - 8} more)" if len(self.senders) > 8 else ""
            out += (f"\n  senders: {len(self.senders)}, each over its own channel in parallel ({each}{more}); "
                    f"the largest sends {_binary(big)}")
        if self.shared_dir:
            out += (f"\n  the SGLang servers load each export from {self.shared_dir} by path: it must be on a "
                    f"filesystem shared by the trainer's rank 0 and every server node (rollout.weight_sync_dir)")
        if self.segments:
            out += "\n  " + segments_line(self.segments)
        if self.delta_bytes:
            out += (f"\n  delta sync: ~{_decimal(self.delta_bytes)} per sync when {DELTA_CHANGED_FRAC:.0%} of the "
                    f"elements change ({self.delta_bytes / self.bytes_per_sync:.1%} of a full sync; the first sync "
                    f"and the one after a failed or skipped version are full)")
            out += "\n  " + self.delta_memory()
        return out

    def delta_memory(self) -> str:
        """Where a delta sync's copies live, per process (part of ``line``)."""
        copies = self.delta_copy_bytes
        each = ", ".join(f"{n} {_binary(b)}" for (n, _), b in zip(self.senders[:8], copies[:8]))
        more = f", ... ({len(copies) - 8} more)" if len(copies) > 8 else ""
        out = (f"delta copies, host memory (CPU RAM, none on the GPU), in the totals above: each sender keeps "
               f"its own tensors ({each}{more}; {_binary(sum(copies))} over all senders)")
        if self.engine_store_bytes:
            per = _binary(self.engine_store_bytes)
            if self.server_tp:
                whole = _binary(self.server_tp * self.engine_store_bytes)
                server = f"the launched server (TP {self.server_tp}): {whole}"
            else:
                server = f"a server of TP t holds t x {per}, e.g. {_binary(8 * self.engine_store_bytes)} at TP 8"
            out += (f"; every SGLang server TP process keeps the whole model on its host: {per} per TP process "
                    f"({server}; on the trainer's nodes, weight_sync tensor)")
        return out


def segments_line(segments: List["Segment"]) -> str:
    """The ``check`` line of the shared-memory segments (part of ``SyncPlan.line``)."""
    each = ", ".join(f"{g.holder} {_binary(g.nbytes)}" for g in segments[:8])
    more = f", ... ({len(segments) - 8} more)" if len(segments) > 8 else ""
    out = (f"shared memory (memfd segments, host RAM, kept across syncs; a page is taken once written): "
           f"{len(segments)} segment(s) ({each}{more})")
    gather = [g for g in segments if g.rank0_host and not g.is_sender]
    sender = [g for g in segments if g.rank0_host and g.is_sender]
    if gather:
        out += (f"; on rank 0's host the TP / ETP gather slots of {len(gather)} rank(s): "
                f"{_binary(sum(g.nbytes for g in gather))}, written up to {_binary(sum(g.resident for g in gather))} "
                f"(besides rank 0's total above)")
    if sender:
        out += (f"; {len(sender)} sender segment(s) of {_binary(sum(g.nbytes for g in sender))} on rank 0's host, "
                f"written up to {_binary(sum(g.resident for g in sender))}: the buckets rank 0 receives in place "
                f"(in its total above)")
    return out


@dataclass(frozen=True)
class Segment:
    """One shared-memory segment of the sync (``weight_sync.shm``): its holder and size."""

    holder: str
    """The rank that creates it, e.g. ``stage 0 TP rank 1`` (a TP gather slot pair) or ``sender stage 1``."""
    nbytes: float
    """Its size (``/proc/<pid>/fd``'s ``memfd:megatron_rl_ws_*`` file; ``shm.segment_bytes``)."""
    resident: float
    """The most of it ever written (host RAM taken: a memfd's pages exist once written)."""
    rank0_host: bool
    """On global rank 0's host."""

    @property
    def is_sender(self) -> bool:
        """A sender's bucket segment (else a TP / ETP gather slot pair)."""
        return self.holder.startswith("sender")


def sync_segments(settings: WeightSyncSettings, model, parallel, dtype_bytes: int, device: str,
                  senders: List[Tuple[str, float]], world_size: int = 0, ranks_per_node: int = 0,
                  piece_bytes: int = 0) -> List[Segment]:
    """The segments of a sync: the ``shm`` TP / ETP gather slots of every non-owner rank of a sender's group on its
    sender's host (CPU jobs: a CUDA job gathers with NCCL), and the segment of every sender but rank 0 on rank 0's
    host that reaches an engine in rank 0's process (elsewhere gloo: ``shm_reach``). ``world_size`` /
    ``ranks_per_node`` place ranks on hosts (megatron's order, TP innermost; 0: one host); ``piece_bytes``: bytes
    per gathered element (default ``dtype_bytes``, the engine's)."""
    m, p = model, parallel
    pp, tp, ep, etp = (p.pipeline_model_parallel_size, p.tensor_model_parallel_size, p.expert_model_parallel_size,
                       p.etp)
    block = world_size // pp if world_size else 0  # ranks of one pipeline stage

    def host(rank: int) -> int:
        return rank // ranks_per_node if ranks_per_node and world_size else 0

    out: List[Segment] = []
    piece_bytes = piece_bytes or dtype_bytes
    layers = stage_layers(m.num_layers, pp, p.virtual_pipeline_model_parallel_size or 1,
                          p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage)
    if device != "cuda":
        for st, ids in enumerate(layers):
            dense, expert = largest_pieces(m, ids, st, pp, tp, etp)
            for size, n, what, experts in ((dense, tp, "TP", 1), (expert, etp, "ETP", ep)):
                nbytes = shm.segment_bytes(settings, size * piece_bytes)[0] if n > 1 else 0
                for e in range(experts if nbytes else 0):
                    sender = st * block + e * etp
                    for r in range(1, n):
                        if host(sender + r) != host(sender):  # its sender cannot map it: gloo (``shm_reach``)
                            continue
                        ep_name = f" EP rank {e}" if what == "ETP" and ep > 1 else ""
                        out.append(Segment(f"stage {st}{ep_name} {what} rank {r}", float(nbytes),
                                           float(min(nbytes, 2 * size * piece_bytes)), host(sender + r) == 0))
    if settings.engine != "sglang" and len(senders) > 1:  # an engine in rank 0's process
        for name, nbytes in senders[1:]:
            st = int(name.split()[1])
            e = int(name.split()[-1]) if "EP rank" in name else 0
            size = shm.segment_bytes(settings, 0, largest_tensor(m, layers[st], st, pp, e > 0) * dtype_bytes)[1]
            if size and host(st * block + e * etp) == 0:  # a sender on another host sends over gloo
                out.append(Segment(f"sender {name}", float(size), float(min(size, nbytes)), True))
    return out


def largest_pieces(m, layer_ids, stage: int, pp: int, tp: int, etp: int) -> Tuple[int, int]:
    """(elements of the largest TP piece of a dense parameter, of the largest ETP piece of an expert) that a stage's
    non-owner ranks gather to their sender (``convert.live``: vocab rows padded; the tied output copy skipped)."""
    h, pattern, dense, expert = m.hidden_size, m.moe_layer_pattern(), [0], [0]
    if stage == 0 or (stage == pp - 1 and m.untie_embeddings_and_output_weights):
        dense.append(m.vocab_size * h // tp)
    for i in layer_ids:
        if m.multi_latent_attention:
            a, qk, v = m.num_attention_heads, m.q_head_dim, m.v_head_dim
            dense += [(m.q_lora_rank or h) * a * qk // tp, m.kv_lora_rank * a * (m.qk_head_dim + v) // tp,
                      a * v * h // tp]
        else:
            a, g, d = m.num_attention_heads, m.query_groups, m.head_dim
            dense += [h * (a + 2 * g) * d // tp, a * d * h // tp]
        if pattern[i]:
            fs = m.moe_shared_expert_intermediate_size
            dense.append(2 * fs * h // tp if fs else 0)
            expert.append(2 * (m.moe_ffn_hidden_size or m.dense_ffn_hidden_size) * h // etp)
        else:
            dense.append(2 * m.dense_ffn_hidden_size * h // tp)
    return max(dense), max(expert)


def largest_tensor(m, layer_ids, stage: int, pp: int, experts_only: bool = False) -> int:
    """Elements of the largest HF tensor a sender of ``stage`` packs (q / k / v and gate / up are separate;
    ``experts_only``: an EP rank but 0, which sends its own experts alone)."""
    h, pattern, out = m.hidden_size, m.moe_layer_pattern(), [0]
    for i in layer_ids:
        if pattern[i]:
            out.append((m.moe_ffn_hidden_size or m.dense_ffn_hidden_size) * h)
    if experts_only:
        return max(out)
    out.append(h)
    if stage == 0 or (stage == pp - 1 and m.untie_embeddings_and_output_weights):
        out.append(m.vocab_size * h)
    for i in layer_ids:
        out.append(m.num_attention_heads * m.head_dim * h if not m.multi_latent_attention
                   else (m.q_lora_rank or h) * m.num_attention_heads * m.q_head_dim)
        out.append(m.dense_ffn_hidden_size * h if not pattern[i] else (m.moe_shared_expert_intermediate_size or 0) * h)
    return max(out)


def _decimal(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def _binary(nbytes: float) -> str:
    """Host bytes in GiB, or MiB below 0.1 GiB (a tiny model's sync is not "0.00 GiB")."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 0.1 * 2**30 else f"{nbytes / 2**20:.2f} MiB"


def weight_sync_plan(settings: WeightSyncSettings, rollout, model, parallel, precision: Precision,
                     total_params: int, device: str = "cpu", world_size: int = 0,
                     ranks_per_node: int = 0) -> SyncPlan:
    """The sync plan of a job whose plan built ``settings`` and ``precision`` (the trainer's parameter dtype), with
    the ``rollout`` / ``model`` / ``parallel`` sections; its model has ``total_params`` parameters. ``device``:
    ``cluster.device``; ``world_size`` / ``ranks_per_node`` place the shared-memory segments on hosts (0: one)."""
    r, m, mode = rollout, model, settings.mode.name
    dtype_bytes = DTYPE_BYTES.get(r.dtype, 2)
    total = float(total_params) * dtype_bytes
    largest = float(m.vocab_size) * m.hidden_size * dtype_bytes
    if mode == "disk":
        shared = settings.export_dir if settings.engine == "sglang" else ""
        return SyncPlan(mode, total, 0.0, total, 0.0, 2 * total / (DISK_GBPS * 1e9), DISK_GBPS, shared)
    bucket = float(settings.bucket_bytes)
    filled = min(bucket, total)  # a bucket never holds more than the whole model
    senders = sender_bytes(m, parallel, dtype_bytes)
    in_process = settings.engine != "sglang"  # the embedded engine receives every sender's bucket in rank 0's process
    rank0 = (len(senders) if in_process else 1) * filled + largest  # with shm: other senders' buckets in place
    # the gathers move the engine's dtype, but the trainer's when the engine keeps a tensor in higher precision
    # (DeepSeek-V3's fp32 expert bias: ``senders.own_buckets``)
    piece = precision.params_bytes if m.moe_router_enable_expert_bias else dtype_bytes
    segments = sync_segments(settings, m, parallel, dtype_bytes, device, senders, world_size, ranks_per_node, piece)
    leader = filled + largest if len(senders) > 1 else 0.0
    delta, copies, store = 0.0, [], 0.0
    if settings.delta:  # every tensor's elements in blocks; each sender keeps its own tensors on its host
        delta = sparse_nbytes(int(total_params), int(total_params * DELTA_CHANGED_FRAC), dtype_bytes)
        copies = [b for _, b in senders]  # a sender's copy = the bytes it sends in a full sync
        rank0 += copies[0]
        leader += max(copies[1:]) if len(copies) > 1 else 0.0
        store = total if settings.engine == "sglang" else 0.0  # the embedded engine applies deltas to its own weights
    if r.mode == "async":  # the producer loads versions later: rank 0 holds each published, not yet loaded
        # version whole in the trainer's dtype (up to max_staleness + 1 of them) and builds the next one
        rank0 += (r.max_staleness + 2) * float(total_params) * precision.params_bytes
    slowest = max(b for _, b in senders)  # the senders run in parallel
    return SyncPlan(mode, total, bucket, rank0, leader, slowest / (LINK_GBPS * 1e9), LINK_GBPS, delta_bytes=delta,
                    senders=senders, delta_copy_bytes=copies, engine_store_bytes=store,
                    server_tp=1 if store and r.sglang_launch and not r.sglang_urls else 0, segments=segments)


def sender_bytes(model, parallel, dtype_bytes: int) -> List[Tuple[str, float]]:
    """Each sender of a streamed sync and its bytes: per pipeline stage, EP rank 0 sends the stage's dense tensors
    (embedding on the first stage, final norm and output layer on the last) and its own experts, every other
    EP rank its own experts (``senders.own_buckets``)."""
    m, p = model, parallel
    pp, ep = p.pipeline_model_parallel_size, p.expert_model_parallel_size
    pattern = m.moe_layer_pattern()
    layers = stage_layers(m.num_layers, pp, p.virtual_pipeline_model_parallel_size or 1,
                          p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage)
    emb = m.vocab_size * m.hidden_size
    out = []
    for s, ids in enumerate(layers):
        dense = expert = 0
        for i in ids:
            d, e = layer_counts(m, 1, 1, 1, bool(pattern[i]))
            dense, expert = dense + d, expert + e
        if s == 0:
            dense += emb
        if s == pp - 1:
            dense += m.hidden_size + (emb if m.untie_embeddings_and_output_weights else 0)
        eps = ep if expert else 1
        for e in range(eps):
            out.append((f"stage {s} EP rank {e}" if eps > 1 else f"stage {s}",
                        float((dense if e == 0 else 0) + expert // eps) * dtype_bytes))
    return out
