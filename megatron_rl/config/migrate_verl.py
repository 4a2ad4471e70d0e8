"""Migrate a verl config to this project's: every key mapped by the verl key table or reported with its reason.

    m = migrate_verl(yaml_load(open("verl_grpo.yaml")))
    m.tree            # this project's config (nested dict): what ``megatron-rl migrate verl`` writes
    m.entries         # one Entry per verl key: mapped (-> our keys), unchanged, or not mapped (with the reason)
    m.report()        # the lines the command prints (and writes as comments at the top of the output)

The verl config is read as verl reads it: Hydra interpolations (``${oc.select:...}``, ``${.x}``) are resolved
within the file first (:mod:`megatron_rl.config.interpolation`); a value that cannot be resolved is reported
with its key and not mapped. Each key (a leaf of the tree) then goes through the first matching rule of
:data:`megatron_rl.config.verl_keys.VERL_KEYS`:

* mapped: the value (or the rule's conversion of it) is written to this project's key(s); when two verl keys
  write one key with different values, the first wins and the second is reported as a conflict;
* unchanged: the key has nothing to carry over -- null / empty, a value that is this project's behaviour anyway
  (``param_offload: false``), or a setting without effect in that verl config (``kl_ctrl.*`` while
  ``use_kl_in_reward`` is false);
* not mapped: "not supported yet", "no meaning here", "the SGLang server's setting", each with the reason;
  "unresolved" (an interpolation or Hydra's ``???``) and "unknown" (a key the table does not know).

Keys the verl file does not set take verl's defaults (``with_verl_defaults``: verl's own generated config of the
version the file is read as, :mod:`megatron_rl.config.verl_versions`). Entries of the kinds in ``DIFFERS`` are
values whose verl behaviour this project's config does not reproduce: ``megatron-rl migrate verl`` exits 3 on them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

from megatron_rl.config.interpolation import lookup, resolve_interpolations
from megatron_rl.config.job import SECTIONS
from megatron_rl.config.load import SECTION_CLASSES
from megatron_rl.config.paths import resolve_tree_paths
from megatron_rl.config.sections import DEFAULT_GPU_MEMORY_GB
from megatron_rl.config.verl_keys import (
    MAPPED, NO_MEANING, NOTE, SERVER, UNSUPPORTED, Rule, Skip, Verl, rule_for, same_value,
)
from megatron_rl.config.verl_versions import NEWEST, verl_defaults

UNCHANGED = "unchanged"
UNRESOLVED = "unresolved"
CONFLICT = "conflict"
UNKNOWN = "unknown"
#: Report order of the kinds that are not mapped.
NOT_MAPPED = (UNSUPPORTED, SERVER, NO_MEANING, UNRESOLVED, CONFLICT, UNKNOWN)
#: Kinds whose verl behaviour the migrated config does not carry: each needs the user's decision.
DIFFERS = (UNSUPPORTED, UNRESOLVED, CONFLICT, UNKNOWN)


@dataclass
class Entry:
    """What became of one verl key."""

    key: str
    """The verl key, dotted."""
    value: Any
    """Its value (interpolations resolved where possible)."""
    kind: str
    """MAPPED, UNCHANGED, or one of NOT_MAPPED."""
    detail: str = ""
    """The reason (not mapped, unchanged) or a remark (mapped)."""
    targets: Dict[str, Any] = field(default_factory=dict)
    """MAPPED: this project's dotted keys and the values written."""
    rule: Optional[Rule] = None
    """The table rule that decided it (None: unresolved before any rule, or unknown)."""


@dataclass
class Migration:
    """The result of :func:`migrate_verl`."""

    tree: Dict[str, Any]
    """This project's config, nested, sections in file order."""
    entries: List[Entry]
    """One per verl key, in file order."""
    version: str = NEWEST
    """The verl version the file was read as (its defaults, its objectives' behaviour)."""
    base: str = ""
    """What the file's unset keys were read from (verl's defaults file of ``version``, or ``--base``)."""

    def differences(self) -> List[Entry]:
        """The entries whose verl behaviour the migrated config does not carry (kinds ``DIFFERS``)."""
        return self.of_kind(*DIFFERS)

    def of_kind(self, *kinds: str) -> List[Entry]:
        """The entries of the given kinds."""
        return [e for e in self.entries if e.kind in kinds]

    def report(self, verbose: bool = False) -> List[str]:
        """Summary line, then every key not mapped grouped by kind with its reason, then the mapped keys
        (``verbose``: also the unchanged ones). A sub-tree rule (``critic.**``) with more than 3 keys of one
        reason is one line."""
        n = {k: len(self.of_kind(k)) for k in (MAPPED, UNCHANGED) + NOT_MAPPED}
        missing = sum(n[k] for k in NOT_MAPPED)
        lines = [f"{len(self.entries)} verl keys: {n[MAPPED]} mapped, {n[UNCHANGED]} with nothing to carry over, "
                 f"{missing} not mapped"]
        if self.base:
            lines.append(f"read as verl {self.version}; keys the file does not set: {self.base}")
        differ = self.differences()
        lines.append(f"{len(differ)} value(s) differ from verl's behaviour" + (
            " (the kinds not supported yet / unresolved / conflict / unknown below: each needs your decision)"
            if differ else ""))
        for kind in NOT_MAPPED + ((UNCHANGED,) if verbose else ()):
            entries = self.of_kind(kind)
            if entries:
                lines.append(f"{kind} ({len(entries)}):")
                lines += [f"  {line}" for line in _grouped(entries)]
        if (self.tree.get("cluster") or {}).get("gpu_memory_gb") == DEFAULT_GPU_MEMORY_GB:
            lines.append(f"default: cluster.gpu_memory_gb = {DEFAULT_GPU_MEMORY_GB:g} (verl has no GPU memory key; "
                         f"`megatron-rl check` plans the job against it: set your GPUs' memory)")
        mapped = self.of_kind(MAPPED)
        if mapped:
            lines.append(f"mapped ({len(mapped)}):")
            for e in mapped:
                to = ", ".join(f"{k}: {_short(v)}" for k, v in e.targets.items()) or "(decides other keys)"
                lines.append(f"  {e.key} = {_short(e.value)} -> {to}" + (f"  ({e.detail})" if e.detail else ""))
        return lines


def _short(value: Any, limit: int = 60) -> str:
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _grouped(entries: List[Entry]) -> Iterator[str]:
    by_rule: Dict[Tuple[Any, str], List[Entry]] = {}
    for e in entries:
        by_rule.setdefault((id(e.rule) if e.rule and e.rule.pattern.endswith("**") else e.key, e.detail),
                           []).append(e)
    for (_, detail), group in by_rule.items():
        if len(group) > 3:
            yield f"{group[0].rule.pattern.replace('**', '*')} ({len(group)} keys): {detail}"
        else:
            for e in group:
                yield f"{e.key} = {_short(e.value)}: {detail}"


def flatten(tree: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """(dotted key, value) of every leaf of a nested dict; an empty mapping is a leaf (value ``{}``)."""
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from flatten(v, key + ".")
        else:
            yield key, v


def _set(tree: Dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def _decide(rule: Rule, key: str, value: Any, verl: Verl) -> Entry:
    """The entry of one verl key under its rule (before conflicts are looked at)."""
    why_inactive = rule.inactive(verl) if rule.inactive else None
    if why_inactive:
        return Entry(key, value, UNCHANGED, why_inactive, rule=rule)
    if rule.kind != MAPPED:
        if value is None or value == {} or value == []:
            return Entry(key, value, UNCHANGED, "not set in verl (nothing to carry over)", rule=rule)
        if any(same_value(value, n) for n in rule.neutral):
            return Entry(key, value, UNCHANGED, f"{_short(value)} is this project's behaviour too ({rule.note})",
                         rule=rule)
        return Entry(key, value, rule.kind, rule.note, rule=rule)
    if value is None and rule.target is not None:  # block copies (rollout_correction.*) keep their nulls
        return Entry(key, value, UNCHANGED, "not set in verl (this project's default applies)", rule=rule)
    if rule.convert is not None:
        try:
            targets = dict(rule.convert(value, verl))
        except Skip as skip:
            kind = UNCHANGED if skip.kind == NO_MEANING else skip.kind
            return Entry(key, value, kind, skip.reason, rule=rule)
        note = targets.pop(NOTE, None)
        if note:
            return Entry(key, value, MAPPED, f"{rule.note}; {note}" if rule.note else note, targets=targets, rule=rule)
    elif rule.target is not None:
        targets = {rule.target: value}
    else:  # same name under the same block (actor.policy_loss.*, algorithm.rollout_correction.*)
        block = {"actor_rollout_ref.actor.policy_loss.": "actor.policy_loss.",
                 "algorithm.rollout_correction.": "algorithm.rollout_correction."}
        prefix = next(p for p in block if key.startswith(p))
        targets = {block[prefix] + key[len(prefix):]: value}
    return Entry(key, value, MAPPED, rule.note, targets=dict(targets), rule=rule)


def merge_overrides(base: Dict[str, Any], overrides: Dict[str, Any]) -> Dict[str, Any]:
    """``base`` with every key of ``overrides`` put over it, level by level (what Hydra does with a run
    script's ``key.sub=value`` overrides on its config)."""
    out = dict(base)
    for k, v in overrides.items():
        out[k] = merge_overrides(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def with_verl_defaults(verl_tree: Dict[str, Any], version: str = NEWEST) -> Tuple[Dict[str, Any], str]:
    """(``verl_tree`` over verl ``version``'s generated defaults for its actor backend, a line naming them): the
    config verl runs for that file. A file that names no backend is read over verl's FSDP defaults, as verl's
    ``main_ppo`` composes them."""
    strategy = Verl(verl_tree, version).strategy
    name = "_generated_ppo_megatron_trainer.yaml" if strategy == "megatron" else "_generated_ppo_trainer.yaml"
    said = f"verl {version}'s {name} (bundled)" + ("" if strategy else "; the file names no actor backend: "
                                                                       "verl's default, FSDP")
    return merge_overrides(verl_defaults(version, strategy), verl_tree), said


def _resolve_paths(out: Dict[str, Any], written: Dict[str, Tuple[Any, str]], entries: List[Entry],
                   cwd: str) -> None:
    """Make the path-valued keys written (data files, the reward file, the run directory, a local model directory)
    absolute against ``cwd``: verl opens a relative path from the directory it is launched from, while a
    config file's relative paths resolve from the file's own directory (``megatron_rl.config.paths``), so a copy
    written as it is would name other files wherever the migrated file is written. HF hub ids stay."""
    resolved = resolve_tree_paths(out, SECTION_CLASSES, cwd)
    by_key = {e.key: e for e in entries}
    for target, (value, key) in written.items():
        new = lookup(resolved, target, value)
        if new == value:
            continue
        _set(out, target, new)
        e = by_key[key]
        e.targets[target] = new
        said = f"{_short(value)} resolved against the directory migrate ran in ({cwd}), where verl opens it"
        e.detail = f"{e.detail}; {said}" if e.detail else said


def migrate_verl(verl_tree: Dict[str, Any], version: str = NEWEST, base: str = "",
                 cwd: Optional[str] = None) -> Migration:
    """Map every key of ``verl_tree`` (a loaded verl YAML, already over its base: ``with_verl_defaults`` or the
    user's ``--base``) read as verl ``version`` -- see the module docstring. ``base`` names that base for the
    report. Relative paths are resolved against ``cwd`` (default: the current directory), where verl opens them."""
    resolved, unresolved = resolve_interpolations(verl_tree)
    verl = Verl(resolved, version)
    out: Dict[str, Any] = {}
    written: Dict[str, Tuple[Any, str]] = {}  # our key -> (value, verl key that wrote it)
    entries: List[Entry] = []
    for key, value in flatten(resolved):
        rule = rule_for(key)
        why_inactive = rule.inactive(verl) if rule is not None and rule.inactive else None
        if key in unresolved and not why_inactive:
            entries.append(Entry(key, value, UNRESOLVED, unresolved[key], rule=rule))
            continue
        if rule is None:
            entries.append(Entry(key, value, UNKNOWN, "a key this project's verl table does not know"))
            continue
        entry = _decide(rule, key, value, verl)
        if entry.kind == MAPPED:
            clash = [(t, v) for t, v in entry.targets.items() if t in written and not same_value(written[t][0], v)]
            if clash:
                t, v = clash[0]
                entry = Entry(key, value, CONFLICT, f"{t} is already {_short(written[t][0])} from {written[t][1]}; "
                                                    f"this key's {_short(v)} is not applied", rule=rule)
            else:
                for t, v in entry.targets.items():
                    written.setdefault(t, (v, key))
                    _set(out, t, v)
        entries.append(entry)
    _resolve_paths(out, written, entries, os.getcwd() if cwd is None else cwd)
    out.setdefault("cluster", {}).setdefault("gpu_memory_gb", DEFAULT_GPU_MEMORY_GB)  # verl has no such key
    ordered = {s: out[s] for s in SECTIONS if s in out}
    return Migration(tree=ordered, entries=entries, version=version, base=base)
