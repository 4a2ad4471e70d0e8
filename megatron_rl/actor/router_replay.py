"""Routing replay in the actor's megatron model: megatron-core's ``RouterReplay`` hook, plus what it lacks.

Only the choice of experts is replayed: megatron gathers the trainer's OWN scores at the replayed experts, so the
gate weights are the trainer's and gradients reach the router. Added here (``LayerReplay``, ``RoutingReplay``): a
per-model registry keyed by global layer number (each PP / VPP stage replays its own layers), per-micro-batch
targets in megatron's token order, partial replay (-1 keeps the trainer's top-k), recording of the trainer's own
top-k, and activation recomputation without a switch. The rule to keep: a router call inside autograd's backward
is a recompute and pops its forward's target (FIFO per router). What is refused and what token dropping does:
docs/actor.md.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_rl.actor.routing import (RoutingError, RoutingSpec, agreement_counts, agreement_metrics,
                                       check_routing, routing_dtype, routing_valid_mask)
from megatron_rl.parallel.devices import all_reduce_
from megatron_rl.parallel.groups import ActorGroups

__all__ = ["RoutingReplay", "ReplayPass", "agree_on_error"]


def _in_backward() -> bool:
    """True while autograd's engine runs a backward (i.e. this forward is an activation recompute)."""
    return torch._C._current_graph_task_id() != -1


@functools.lru_cache(maxsize=1)
def _layer_replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class LayerReplay(RouterReplay):
        """megatron's ``RouterReplay`` for one MoE layer, with partial replay, recompute detection and
        recording of the trainer's own choice (see the module docstring)."""

        def __init__(self, moe_index: int, layer: int):
            super().__init__()
            RouterReplay.global_router_replay_instances.remove(self)  # registry: RoutingReplay, per model
            self.moe_index = moe_index
            self.layer = layer
            self.own: List[torch.Tensor] = []
            self.used: List[torch.Tensor] = []
            self.keep_used = False
            self.recomputed = 0
            """Router calls seen inside a backward (activation recompute) so far (a diagnostic)."""

        def replaying(self, on: bool) -> None:
            self.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD if on else None)

        def reset(self) -> None:
            self.clear_indices()
            self.clear_router_replay_action()
            self.own, self.used = [], []

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            recompute = _in_backward()
            probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            if recompute:
                self.recomputed += 1
            else:
                self.own.append(own.detach())
            if self.router_replay_action is None:
                idx = own
            else:
                if recompute:
                    if not self.replay_backward_list:
                        raise RoutingError(f"routing replay, layer {self.layer}: an activation recompute found no "
                                           f"recorded target (more recomputes than forwards)")
                    target = self.replay_backward_list.pop(0)
                else:
                    target = self.target_topk_idx
                if target is None or tuple(target.shape) != tuple(own.shape):
                    raise RoutingError(f"routing replay, layer {self.layer}: router sees {tuple(own.shape)} "
                                       f"(tokens, topk) but the target is "
                                       f"{None if target is None else tuple(target.shape)}")
                target = target.to(own.device)
                idx = torch.where(target >= 0, target, own)
                probs = scores.gather(1, idx)
            if self.keep_used and not recompute:
                self.used.append(idx.detach())
            return probs, idx

    return LayerReplay


def agree_on_error(message: Optional[str], present: Optional[bool] = None, error: type = RoutingError) -> None:
    """Collective over every rank (default group): if any rank has a ``message`` every rank raises
    ``error`` naming the first such rank and its message — no rank is left waiting in a later
    collective. ``present``: whether this rank's batch carries routing; it must be the same on every rank
    (the passes' collectives depend on it). One small all-reduce when all is well."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if message:
            raise error(message)
        return
    p = 1 if present else 0
    flag = all_reduce_(torch.tensor([1 if message else 0, p, -p], dtype=torch.int32), op=dist.ReduceOp.MAX)
    if int(flag[0]) == 0 and present is not None and int(flag[1]) != -int(flag[2]):
        raise RoutingError(f"RolloutBatch.routing is present on some ranks only (this rank: "
                           f"{'present' if present else 'None'}); build every rank's batch from the same rollouts")
    if int(flag[0]) == 0:
        return
    msgs: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, message)
    bad = [(r, m) for r, m in enumerate(msgs) if m]
    more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
    raise error(f"rank {bad[0][0]}: {bad[0][1]}{more}")


class ReplayPass:
    """One pass of the schedule (log-prob pass or one mini-batch's train pass) with routing: sets each
    micro-batch's targets before a chunk's forward, collects the trainer's own choice after it."""

    def __init__(self, owner: "RoutingReplay", lengths: torch.Tensor, targets: Optional[torch.Tensor],
                 record: bool, keep_used: bool = False):
        self.owner = owner
        self.lengths = lengths
        self.targets = targets
        self.record = record
        self.own: Dict[Tuple[int, int], Dict[int, torch.Tensor]] = {}
        self.used: Dict[Tuple[int, int], Dict[int, torch.Tensor]] = {}
        self.micro_batches: Optional[list] = None
        """The pass's micro-batches (set by the caller after the schedule; ``assemble`` needs them)."""
        for rep in owner.replays:
            rep.reset()
            rep.replaying(targets is not None)
            rep.keep_used = keep_used

    def wrap(self, step: Callable) -> Callable:
        """``step(mb, model)`` -> the same with this pass's targets set / records collected around it."""

        def wrapped(mb, model):
            reps = self.owner.routers_of(model)
            g = self.owner.groups
            if self.targets is not None and reps:
                t = mb.layout.routing_targets(self.targets, self.lengths, g, device=mb.tokens.device)
                for rep in reps:
                    rep.set_target_indices(t[self.owner.column[rep.moe_index]])
            out = step(mb, model)
            for rep in reps:
                if self.record and rep.own:
                    self.own.setdefault(mb.rows, {})[rep.moe_index] = rep.own[-1]
                if rep.used:
                    self.used.setdefault(mb.rows, {})[rep.moe_index] = rep.used[-1]
                rep.own, rep.used = [], []
            return out

        return wrapped

    def assemble(self, num_rows: int, width: int, which: str = "own") -> torch.Tensor:
        """[num_rows, width, num_moe_layers, topk] int64 of the recorded (``which="own"``: the trainer's
        own top-k; ``"used"``: the experts the forwards used) choice of this rank's layers (-1 elsewhere).
        Collective over the TP (sequence parallel) and CP groups."""
        g, spec = self.owner.groups, self.owner.spec
        store = self.own if which == "own" else self.used
        layers = self.owner.local_layers
        out = torch.full((num_rows, width, spec.num_moe_layers, spec.topk), -1, dtype=torch.int64)
        if not layers:
            return out
        for mb in self.micro_batches or []:
            got = store.get(mb.rows, {})
            if sorted(got) != layers:
                raise RoutingError(f"routing record: micro-batch rows {mb.rows} recorded MoE layers {sorted(got)}, "
                                   f"this rank holds {layers}")
            local = torch.stack([got[j] for j in layers])                   # [n_local_layers, n_tok, k]
            full = mb.layout.gather_records(local, g).cpu()                # [b, s, NLloc, k]
            w = min(full.shape[1], width)
            out[mb.rows[0]:mb.rows[1], :w][:, :, layers] = full[:, :w]
        return out

    def close(self) -> None:
        """Drop every target and record (also on error)."""
        for rep in self.owner.replays:
            rep.reset()
        self.own, self.used = {}, {}


class RoutingReplay:
    """The routers of one actor's model chunks (on this rank) and the passes over them."""

    def __init__(self, model_chunks: Sequence[torch.nn.Module], spec: RoutingSpec, groups: ActorGroups):
        """Install a ``LayerReplay`` in every ``TopKRouter`` of ``model_chunks`` (DDP-wrapped or not)."""
        from megatron.core.transformer.moe.router import TopKRouter

        cls = _layer_replay_class()
        self.spec, self.groups = spec, groups
        self.recorded: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        """R2: (tokens, lengths, routing) of this actor's last log-prob pass, rows in the batch's order."""
        self._by_chunk: Dict[int, list] = {}
        self.replays: list = []
        for chunk in model_chunks:
            reps = []
            for m in chunk.modules():
                if not isinstance(m, TopKRouter):
                    continue
                if getattr(m.config, "moe_router_fusion", False) or m.routing_type == "sinkhorn":
                    raise RoutingError("routing replay needs megatron's unfused top-k router "
                                       "(moe_router_fusion=False, load balancing other than sinkhorn)")
                layer = int(m.layer_number) - 1
                if layer not in spec.moe_layers:
                    raise RoutingError(f"router of layer {layer} is not an MoE layer of the config "
                                       f"({list(spec.moe_layers)})")
                rep = cls(spec.moe_layers.index(layer), layer)
                m.router_replay = rep
                reps.append(rep)
            self._by_chunk[id(chunk)] = reps
            self.replays += reps
        self.local_layers = sorted(r.moe_index for r in self.replays)
        """The MoE layers (indices into ``spec.moe_layers``) whose routers this rank holds (its pipeline stage's,
        every virtual stage's with VPP)."""
        self.column = {j: i for i, j in enumerate(self.local_layers)}
        """MoE layer index -> its column in this rank's routing (``local``)."""
        self.local_spec = RoutingSpec(spec.num_experts, spec.topk, tuple(spec.moe_layers[j] for j in self.local_layers))
        """The spec of this rank's layers (a stage-local routing tensor's dim 2)."""

    def local(self, routing: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``routing`` [B, W, moe_layers, k] as this rank's layers' columns (``local_layers``, in order): a tensor
        of every MoE layer is cut to them; one that holds only them (what a rank of a job receives, the rollout
        source sending each pipeline stage its layers' routing) is returned as it is. The two cannot be confused:
        with as many local layers as MoE layers they are the same tensor."""
        if routing is None or routing.shape[2] != self.spec.num_moe_layers or len(self.local_layers) == \
                self.spec.num_moe_layers:
            return routing
        return routing[:, :, self.local_layers]

    def spec_of(self, routing: torch.Tensor) -> RoutingSpec:
        """The spec ``routing`` is checked against: this rank's layers' when it holds only them, else every layer's."""
        local = len(self.local_layers)
        if isinstance(routing, torch.Tensor) and routing.dim() == 4 and routing.shape[2] == local and \
                local != self.spec.num_moe_layers:
            return self.local_spec
        return self.spec

    def routers_of(self, model_chunk) -> list:
        """The ``LayerReplay`` of each router in ``model_chunk`` (one of the chunks given at construction)."""
        return self._by_chunk.get(id(model_chunk), [])

    def validate(self, routing: Optional[torch.Tensor], lengths: torch.Tensor, required: str = "",
                 what: str = "RolloutBatch.routing") -> None:
        """Collective (every rank): raise ``RoutingError`` on every rank if any rank's ``routing`` cannot be
        replayed (or is None while ``required`` names why it is needed)."""
        if routing is None:
            msg = f"{what} is None but {required}" if required else None
        else:
            msg = check_routing(routing, lengths, self.spec_of(routing), what)
            local = len(self.local_layers)
            cut = local != self.spec.num_moe_layers
            if msg and cut and isinstance(routing, torch.Tensor) and routing.dim() == 4 and \
                    routing.shape[2] not in (self.spec.num_moe_layers, local):
                msg += (f" -- or only this rank's {local} (pipeline-stage-local routing: layers "
                        f"{list(self.local_spec.moe_layers)})")
        agree_on_error(msg, present=routing is not None)

    def begin(self, lengths: torch.Tensor, targets: Optional[torch.Tensor], record: bool,
              keep_used: bool = False) -> ReplayPass:
        """A pass replaying ``targets`` ([B, L-1, NL, k] of every MoE layer or of this rank's, or None) and
        recording the own choice if ``record``."""
        return ReplayPass(self, lengths, self.local(targets), record, keep_used)

    def agreement(self, own: torch.Tensor, reference: torch.Tensor, lengths: torch.Tensor,
                  prefix: str = "rollout_corr/router") -> Dict[str, float]:
        """Agreement of this rank's recorded ``own`` routing ([B, W, NL, k], ``ReplayPass.assemble``) with
        ``reference`` (every MoE layer or this rank's, ``local``), summed over the PP group (disjoint layers) and
        the DP group (disjoint rows); identical on every rank."""
        g, spec = self.groups, self.spec
        dev = own.device  # the batch's routing stays on the host (RolloutBatch.to); the counts are made here
        valid = routing_valid_mask(lengths.to(dev), own.shape[1])
        c = agreement_counts(own[:, :, self.local_layers], self.local(reference).to(dev), valid)
        per_layer = torch.zeros(spec.num_moe_layers, dtype=torch.float64, device=c["per_layer"].device)
        per_layer[self.local_layers] = c["per_layer"]
        per_token = c["per_token"]
        if g.pp_size > 1:
            all_reduce_(per_layer, group=g.pp_group)
            all_reduce_(per_token, group=g.pp_group)
        full = ((per_token == spec.topk * spec.num_moe_layers) & valid.to(per_token.device)).sum().to(torch.float64)
        vec = torch.cat([per_layer, full.reshape(1), c["tokens"].to(per_layer.device).reshape(1)])
        if g.dp_size > 1:
            all_reduce_(vec, group=g.dp_group)
        vec = vec.cpu()  # metrics: host floats
        return agreement_metrics(vec[:-2], float(vec[-2]), float(vec[-1]), spec, prefix=prefix)

    @staticmethod
    def compact(routing: torch.Tensor, spec: RoutingSpec) -> torch.Tensor:
        """int64 routing with -1 (not recorded here) -> the compact dtype (-1 -> 0: never read)."""
        return routing.clamp(min=0).to(routing_dtype(spec.num_experts))

