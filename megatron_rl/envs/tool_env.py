"""``ToolEnvironment``: an ``Environment`` whose model calls Python tools with Hermes / Qwen ``<tool_call>`` blocks.

A subclass gives ``tools`` (name -> callable, called with the call's ``arguments`` as keyword arguments) and
``score(answer_text) -> float`` (the episode's row is ``self.sample``). Each model turn is one ``step``:

* tool calls in the turn -> each is run in order, its result formatted as a ``<tool_response>`` block; a tool
  that raises (or a name not in ``tools``, or arguments it does not take) answers with ``error: ...`` text and
  counts ``info["tool_error"]``; ``info["tool_calls"]`` counts the calls made;
* malformed calls (``tool_calls.parse_tool_calls``) -> one error response each, after the others, telling the
  model the expected format; ``info["malformed_tool_call"]`` counts them; the episode goes on (never a crash);
* no call at all -> the final answer: ``EnvStep(observation="", reward=score(action), done=True)``.

The observation is the responses joined by ``"\\n"``: what the Qwen chat templates render between
``<|im_start|>user\\n`` and ``<|im_end|>`` for consecutive tool messages (the driver's observation template adds
that wrapper and the next assistant header).

Usage::

    class Calculator(ToolEnvironment):
        tools = {"add": lambda a, b: a + b}
        def score(self, answer_text):
            return float(answer_text.strip() == str(self.sample["answer"]))
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

from megatron_rl.envs.base import Environment, EnvStep
from megatron_rl.envs.tool_calls import format_tool_response, parse_tool_calls

#: The error response to a malformed call (the expected format, as the Qwen system prompt states it).
MALFORMED_CALL_ERROR = ('error: malformed tool call; call a tool with <tool_call>\n'
                        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


class ToolEnvironment(Environment):
    """Tools called with ``<tool_call>`` blocks, a scored final answer (see the module docstring)."""

    #: The tools: name -> callable taking the call's arguments as keyword arguments.
    tools: Dict[str, Callable[..., Any]] = {}

    def reset(self, sample: Dict[str, Any]) -> None:
        """Keep the episode's row in ``self.sample``."""
        self.sample = sample

    def score(self, answer_text: str) -> float:
        """The reward of the final answer ``answer_text`` (the whole last model turn)."""
        raise NotImplementedError(f"{type(self).__name__}.score")

    def step(self, action: str) -> EnvStep:
        """Run the turn's tool calls, or score it as the final answer when it has none."""
        calls, malformed = parse_tool_calls(action)
        if not calls and not malformed:
            return EnvStep(observation="", reward=float(self.score(action)), done=True)
        responses: List[str] = []
        errors = 0
        for call in calls:
            text, ok = self.call_tool(call.name, call.arguments)
            errors += not ok
            responses.append(format_tool_response(text))
        responses.extend(format_tool_response(MALFORMED_CALL_ERROR) for _ in range(malformed))
        info = {"tool_calls": float(len(calls))}
        if errors:
            info["tool_error"] = float(errors)
        if malformed:
            info["malformed_tool_call"] = float(malformed)
        return EnvStep(observation="\n".join(responses), info=info)

    def call_tool(self, name: str, arguments: Dict[str, Any]) -> tuple[Any, bool]:
        """``(result, True)``, or ``(error text, False)`` when the tool is unknown or raises."""
        fn = self.tools.get(name)
        if fn is None:
            return f"error: unknown tool {name!r}; tools: {sorted(self.tools)}", False
        try:
            return fn(**arguments), True
        except Exception as e:  # noqa: BLE001 - a failing tool is the model's information, not a crash
            return f"error: {type(e).__name__}: {e}", False
