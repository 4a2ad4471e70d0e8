"""Rollout engines behind one interface; import what you need from its module.

* ``base``: ``SamplingParams``, ``Rollout``, ``RolloutEngine`` and the error types (their one home).
* ``factory``: the one place ``rollout.engine`` becomes an engine and a job's engine is built.
* ``sglang_engine``: ``SGLangEngine`` — SGLang servers over HTTP (round-robin, retries, weight sync).
* ``sglang_server``: ``launch_sglang_server`` — start/stop a local SGLang server (CPU stand-ins included).
* ``embedded``: ``EmbeddedEngine`` — in-process rollouts from an HF ``transformers`` model.
* ``multi_turn`` / ``trajectory``: multi-turn rollouts with environments, and their data model.
"""
