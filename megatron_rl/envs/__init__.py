"""Environments of multi-turn rollouts: the interface (``base``), tool-call parsing (``tool_calls``), a tool
environment (``tool_env``) and the out-of-process pool (``pool``).

The multi-turn driver (``rollout/multi_turn.py``) talks to user environments only through this package, and
only through ``EnvPool``: a call to an environment is bounded by a timeout and never raises into the driver, it
answers an ``EnvStep`` or an ``EnvFailure``. Every class and method, with its contract: docs/environments.md.
"""
