"""The engine ends of an in-memory weight sync (``rollout.base.WeightReceiver``): ``embedded.py`` copies each bucket
into the in-process transformers model; ``sglang.py`` runs an update session on every SGLang server."""
