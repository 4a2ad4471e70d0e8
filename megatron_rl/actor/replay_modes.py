"""The MoE routing-replay modes as objects (``actor.routing_replay``), chosen once by ``replay_mode``.

    mode = replay_mode(cfg.actor.routing_replay)      # NoReplay | R2 | R3 (the job plan builds it, once)
    mode.needs_rollout_routing        # r3: every rollout must carry the engine's routing (engines capture it)
    rp = mode.log_prob_pass(routing, batch)            # actor: the log-prob pass (validates, replays, records)
    metrics = mode.finish_log_prob_pass(routing, rp, ordered, batch, inv)
    replayed = mode.train_routing(routing, batch)      # actor: what every train forward of ``batch`` replays

* ``NoReplay`` (``none``): the trainer routes on its own; when the rollouts carry the engine's routing the log-prob
  pass records the trainer's own choice for ``rollout_corr/router_agreement*``.
* ``R2``: the train forwards replay the routing the log-prob pass of the same batch chose (kept by the actor's
  ``RoutingReplay``: a mode holds no state, so one mode object serves every actor of a job).
* ``R3``: the log-prob pass and every train forward replay the rollout engine's routing, which every rollout
  must carry.

``routing`` is the actor's ``router_replay.RoutingReplay`` (the hooks in its routers); every method taking it is
collective over all ranks (validation agrees on errors, records are gathered over TP / CP).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron_rl.actor.router_replay import ReplayPass, RoutingReplay, agree_on_error

__all__ = ["ReplayMode", "NoReplay", "R2", "R3", "REPLAY_MODES", "replay_mode"]


class ReplayMode:
    """What a routing-replay mode decides; ``NoReplay`` behaviour unless a subclass overrides it."""

    name = "none"
    """The ``actor.routing_replay`` value."""
    needs_moe = False
    """The mode replays routing, so the model must be MoE."""
    needs_rollout_routing = False
    """Every rollout must carry the engine's routing (engines are asked to capture it, a partial capture fails)."""
    records_own = False
    """The log-prob pass records the trainer's own routing even when the batch carries none."""

    def _required(self) -> str:
        """Why ``RolloutBatch.routing`` must be present ("" when it need not)."""
        return ""

    def _log_prob_targets(self, batch) -> Optional[torch.Tensor]:
        """The routing the log-prob pass replays (None: the trainer's own)."""
        return None

    def log_prob_pass(self, routing: RoutingReplay, batch) -> ReplayPass:
        """Collective: validate ``batch.routing`` on every rank, then the log-prob pass over ``batch`` (replaying
        what the mode replays there; recording the trainer's own choice when the batch carries routing or the
        mode keeps it)."""
        routing.validate(batch.routing, batch.lengths, required=self._required())
        return routing.begin(batch.lengths, self._log_prob_targets(batch),
                             record=batch.routing is not None or self.records_own)

    def finish_log_prob_pass(self, routing: RoutingReplay, rp: ReplayPass, ordered, batch,
                             inv: Optional[torch.Tensor] = None) -> Dict[str, float]:
        """After the log-prob pass over ``ordered`` (``batch``'s rows in the pass's order, ``inv`` its inverse
        permutation or None): ``rollout_corr/router_agreement*`` (own top-k vs the rollout's) when the batch
        carries routing. Collective (TP / CP gathers, PP / DP sums)."""
        if not rp.record:
            return {}
        own = rp.assemble(ordered.num_rows, ordered.max_length - 1)
        self._keep(own, ordered, batch, inv, routing)
        return routing.agreement(own, ordered.routing, ordered.lengths) if ordered.routing is not None else {}

    def _keep(self, own: torch.Tensor, ordered, batch, inv, routing: RoutingReplay) -> None:
        """Keep what the train forwards will replay (R2)."""

    def train_routing(self, routing: RoutingReplay, batch) -> Optional[torch.Tensor]:
        """Collective: the routing every train forward of ``batch`` replays (None: the trainer's own)."""
        return None


class NoReplay(ReplayMode):
    """``none``: no replay; the trainer's own routing is recorded for the agreement metrics only."""


class R2(ReplayMode):
    """``r2``: the train forwards replay the routing the log-prob pass of the same batch chose."""

    name = "r2"
    needs_moe = True
    records_own = True

    def _keep(self, own, ordered, batch, inv, routing) -> None:
        r = RoutingReplay.compact(own, routing.spec)
        routing.recorded = (batch.tokens, batch.lengths, r if inv is None else r[inv])

    def train_routing(self, routing: RoutingReplay, batch) -> Optional[torch.Tensor]:
        msg, recorded = None, routing.recorded
        if recorded is None:
            msg = "actor.routing_replay='r2': train_step before any compute_log_probs (r2 replays its routing)"
        elif not (torch.equal(recorded[0], batch.tokens) and torch.equal(recorded[1], batch.lengths)):
            msg = ("actor.routing_replay='r2': train_step got a batch that the last compute_log_probs did not see "
                   f"(tokens {tuple(batch.tokens.shape)} vs {tuple(recorded[0].shape)}); call compute_log_probs "
                   f"on the same shard first")
        agree_on_error(msg)
        return recorded[2]


class R3(ReplayMode):
    """``r3``: the log-prob pass and every train forward replay the rollout engine's routing."""

    name = "r3"
    needs_moe = True
    needs_rollout_routing = True

    def _required(self) -> str:
        return ("actor.routing_replay='r3' replays the rollout engine's routing: the engine must capture it "
                "(EmbeddedEngine capture_routing, SGLang --enable-return-routed-experts) and the loop pass it to "
                "RolloutBatch.from_sequences(routing=...)")

    def _log_prob_targets(self, batch) -> Optional[torch.Tensor]:
        return batch.routing

    def train_routing(self, routing: RoutingReplay, batch) -> Optional[torch.Tensor]:
        self.log_prob_pass(routing, batch).close()  # same validation as the log-prob pass
        return batch.routing


REPLAY_MODES = {m.name: m for m in (NoReplay, R2, R3)}
"""``actor.routing_replay`` value -> its mode class."""


def replay_mode(name: str) -> ReplayMode:
    """The mode object of ``actor.routing_replay`` value ``name`` (built once per job, by its plan);
    ``ValueError`` naming the key otherwise."""
    try:
        return REPLAY_MODES[name]()
    except (KeyError, TypeError):
        raise ValueError(f"actor.routing_replay: {name!r} is not one of {', '.join(REPLAY_MODES)}") from None
