"""Environments of multi-turn rollouts: the interface, tool-call parsing, a tool environment, an out-of-process pool.

The multi-turn driver (``megatron_rl/rollout/multi_turn.py``) talks to user environments only through this
package. Interface (issue 24):

``envs/base.py``
    ``class Environment``: user code, named in the config as ``multi_turn.env: "module:Class"`` (or
    ``"path/to/file.py:Class"``), constructed as ``Class(**multi_turn.env_kwargs)`` in a worker process.
        ``reset(self, sample: dict) -> None``: start an episode; ``sample`` is the prompt row (prompt text,
        answer, meta, seed: whatever the task's row holds; plain picklable data).
        ``step(self, action: str) -> EnvStep``: ``action`` is the decoded text of the model's last turn.
    ``@dataclass EnvStep``: ``observation: str`` (text the driver tokenizes once and appends as an environment
    segment; ignored when ``done``); ``reward: float = 0.0`` (the trajectory's reward, read when ``done``);
    ``done: bool = False``; ``info: Dict[str, float] = {}`` (counts of this step, e.g. ``"tool_calls"``,
    ``"tool_error"``, ``"malformed_tool_call"``; the driver adds them to ``Trajectory.counts``).
    ``@dataclass EnvFailure``: ``kind: str`` (one of ``FAILURE_KINDS`` = ``"env_exception"``,
    ``"env_timeout"``, ``"env_garbage"``); ``message: str`` (names the env spec and the trajectory key).
    ``load_env_class(spec) -> type``: import and check a ``module:Class`` (``ValueError`` naming
    ``multi_turn.env``); ``env_import_error(spec) -> Optional[str]``: the same check as a message, for config
    validation before anything starts.

``envs/tool_calls.py``
    ``parse_tool_calls(text) -> (List[ToolCall], malformed: int)``: Hermes / Qwen2.5 / Qwen3
    ``<tool_call>\\n{"name": "...", "arguments": {...}}\\n</tool_call>`` blocks, several per turn;
    ``ToolCall(name: str, arguments: dict)``. ``format_tool_response(result) -> str``:
    ``"<tool_response>\\n" + text + "\\n</tool_response>"`` (several responses joined by ``"\\n"``, as the
    Qwen chat templates render consecutive tool messages inside one user turn).
    Malformed: a body that is not a JSON object, a missing / empty / non-str ``"name"``, non-object
    ``"arguments"`` (missing ``"arguments"`` = ``{}``), an unclosed ``<tool_call>``, a stray ``</tool_call>``.

``envs/tool_env.py``
    ``class ToolEnvironment(Environment)``: a subclass sets ``tools: Dict[str, Callable]`` (called with the
    call's arguments as keyword arguments) and ``score(self, answer_text: str) -> float``; ``reset`` keeps the
    row in ``self.sample``. A turn with tool calls -> observation = the tool responses (a tool that raises, or
    an unknown tool, answers with error text, ``info["tool_error"]``); a malformed call -> an error response,
    ``info["malformed_tool_call"]``; ``info["tool_calls"]`` = calls run. A turn without any call is the final
    answer -> ``EnvStep("", reward=score(action), done=True)``.

``envs/pool.py``
    ``EnvPool(spec, env_kwargs, workers, step_timeout_s, start_timeout_s=120.0)``: environments live in worker
    processes (``python -m megatron_rl.envs.env_worker``); a trajectory key (any hashable picklable value,
    e.g. ``(step, index)``) is pinned to one worker, which holds its environment's state.
        ``reset(keys, samples) -> List[Optional[EnvFailure]]`` (None: ready), a new environment per key;
        ``step(keys, actions) -> List[EnvStep | EnvFailure]``, in key order, in parallel over workers;
        ``release(keys)`` forgets environments the driver stopped (limits; idempotent, unknown keys ignored:
        releasing every key of a batch at its end is the simple rule); an environment whose step returned
        ``done`` or a failure is forgotten automatically (stepping it again raises ``ValueError``, a driver
        bug); ``close()`` stops every worker it started (by pid); ``worker_pids()`` lists them.
    Every call to an environment is bounded by ``step_timeout_s``: an env that raises ->
    ``EnvFailure("env_exception", ...)`` (message: the traceback's last line); one that hangs -> its worker is
    killed and replaced, ``EnvFailure("env_timeout", ...)`` (the other environments that lived in that worker
    are lost too: their next call answers ``env_timeout`` naming the trajectory that hung); one that returns
    something that is not an ``EnvStep`` (non-str observation, non-finite reward, non-bool done, non-numeric
    info) -> ``EnvFailure("env_garbage", ...)``. A worker that dies -> ``env_exception``. ``workers=0`` runs the
    environments in this process (same checks, no timeout: tests, debugging).

Usage::

    pool = EnvPool("my_envs:Calculator", {}, workers=4, step_timeout_s=10.0)
    pool.reset([0, 1], [row0, row1])
    results = pool.step([0, 1], [text0, text1])     # [EnvStep(...), EnvFailure("env_timeout", "...")]
    pool.close()
"""
