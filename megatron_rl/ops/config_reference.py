"""Configuration reference (Markdown) generated from the config dataclasses' field docstrings.

    python -m megatron_rl.ops.config_reference > docs/config_reference.md

Every field of a config dataclass is documented by a string literal right after it; this module reads the
source files with :mod:`ast` (nothing is imported or executed), so the reference is exactly what the code
says. Fields declared with ``field(..., init=False)`` are internal and skipped.
"""
from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

#: (YAML key, module, class) in the order of the YAML file.
SECTIONS: Sequence[Tuple[str, str, str]] = (
    ("cluster", "megatron_rl.config.sections", "ClusterConfig"),
    ("model", "megatron_rl.models.config", "ModelConfig"),
    ("parallel", "megatron_rl.parallel.config", "ParallelConfig"),
    ("rollout", "megatron_rl.config.sections", "RolloutConfig"),
    ("rollout.val_kwargs", "megatron_rl.config.sections", "ValKwargsConfig"),
    ("data", "megatron_rl.config.sections", "DataConfig"),
    ("multi_turn", "megatron_rl.config.sections", "MultiTurnConfig"),
    ("algorithm", "megatron_rl.config.sections", "AlgorithmConfig"),
    ("algorithm.rollout_correction", "megatron_rl.correction.config", "RolloutCorrectionConfig"),
    ("algorithm.filter_groups", "megatron_rl.config.sections", "FilterGroupsConfig"),
    ("algorithm.kl_ctrl", "megatron_rl.algo.kl_reward", "KLControlConfig"),
    ("actor", "megatron_rl.config.sections", "ActorConfig"),
    ("actor.policy_loss", "megatron_rl.losses.config", "PolicyLossConfig"),
    ("actor.lora", "megatron_rl.lora.config", "LoraConfig"),
    ("trainer", "megatron_rl.config.sections", "TrainerConfig"),
    ("reward", "megatron_rl.config.reward_section", "RewardConfig"),
    ("reward.judge", "megatron_rl.tasks.judge_config", "JudgeConfig"),
    ("reward.model", "megatron_rl.config.reward_section", "RewardModelConfig"),
    ("critic", "megatron_rl.config.critic", "CriticConfig"),
)


@dataclass
class FieldDoc:
    """One documented dataclass field."""

    name: str
    """Field name (the YAML key)."""
    type: str
    """Annotation as written in the source."""
    default: Optional[str]
    """Default as written in the source (None = required)."""
    doc: str
    """The string literal after the field ("" if there is none)."""


def _source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise ImportError(f"cannot locate module {module}")
    with open(spec.origin) as fh:
        return fh.read()


def _is_internal(value: Optional[ast.expr]) -> bool:
    if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) == "field":
        for kw in value.keywords:
            if kw.arg == "init" and isinstance(kw.value, ast.Constant) and kw.value.value is False:
                return True
    return False


def _default(value: Optional[ast.expr]) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "path_field":  # config/paths.py's marker
        return ast.unparse(value.args[0]) if value.args else "None"
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                return ast.unparse(kw.value)
            if kw.arg == "default_factory":
                f = kw.value
                if isinstance(f, ast.Name) and f.id in ("list", "dict"):
                    return "[]" if f.id == "list" else "{}"
                return f"{ast.unparse(f)}()"
    return ast.unparse(value)


def class_fields(module: str, cls: str) -> Tuple[str, List[FieldDoc]]:
    """(class docstring, documented fields) of dataclass ``cls`` in ``module``, parsed with ast."""
    tree = ast.parse(_source(module))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            out: List[FieldDoc] = []
            body = node.body
            for i, stmt in enumerate(body):
                if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                    continue
                if _is_internal(stmt.value):
                    continue
                doc = ""
                nxt = body[i + 1] if i + 1 < len(body) else None
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    doc = nxt.value.value
                out.append(FieldDoc(stmt.target.id, ast.unparse(stmt.annotation), _default(stmt.value), doc))
            return ast.get_docstring(node) or "", out
    raise LookupError(f"class {cls} not found in {module}")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(sections: Sequence[Tuple[str, str, str]] = SECTIONS) -> str:
    """The whole reference as Markdown."""
    lines = ["# Configuration reference", "",
             "Generated by `python -m megatron_rl.ops.config_reference` from the field docstrings of the config "
             "dataclasses. Every key can be overridden on the command line as `section.key=value` (values are "
             "parsed as YAML).", ""]
    for key, module, cls in sections:
        doc, fields = class_fields(module, cls)
        lines += [f"## `{key}`", "", f"{_cell(doc)} (`{module}.{cls}`)", "",
                  "| key | type | default | description |", "|---|---|---|---|"]
        for f in fields:
            default = "**required**" if f.default is None else f"`{_cell(f.default)}`"
            lines.append(f"| `{f.name}` | `{_cell(f.type)}` | {default} | {_cell(f.doc) or '(undocumented)'} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    """Print the reference."""
    print(render())


if __name__ == "__main__":
    main()
