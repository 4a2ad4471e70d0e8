"""Type check of one config value against its dataclass field's annotation, naming the dotted key.

    value, err = check_value("abc", float, "actor.lr")
    # err == "actor.lr: expected a number, got 'abc' (str)"

Rules: ``int`` takes integers only (not ``true``, not ``2.5``); ``float`` takes integers and floats (an
integer becomes a float); ``bool`` takes ``true`` / ``false`` only; ``str`` takes strings; ``Optional[X]``
adds ``null``; ``List[X]`` / ``Dict[str, X]`` check their elements; ``Union`` takes any member;
``Any``, ``dict`` and dataclass-typed fields (validated by their own ``from_dict``) are not checked here.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, Optional, Tuple

_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
          list: "a list", dict: "a mapping", type(None): "null"}


def field_types(cls) -> Dict[str, Any]:
    """``{field name: resolved annotation}`` of the init fields of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if tp in _NAMES:
        return _NAMES[tp]
    if origin is typing.Union:
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"a list of {_describe(args[0]).replace('an ', '').replace('a ', '')}s" if args else "a list"
    if origin is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp) -> Tuple[bool, Any]:
    """(matches, value converted to the field's type)."""
    if tp is Any or tp is object:
        return True, value
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = typing.get_args(tp)
        # exact type first, so Union[int, List[int]] keeps an int and Union[float, str] keeps a str
        for a in args:
            if a in (int, float, bool, str, type(None)) and type(value) is a:
                return True, value
        for a in args:
            ok, v = _coerce(value, a)
            if ok:
                return True, v
        return False, value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False, value
        return True, float(value)
    if tp is str:
        return isinstance(value, str), value
    if tp in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False, value
        args = typing.get_args(tp)
        if not args:
            return True, list(value)
        out = []
        for x in value:
            ok, v = _coerce(x, args[0])
            if not ok:
                return False, value
            out.append(v)
        return True, out
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            return False, value
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is not Any:
            out = {}
            for k, x in value.items():
                ok, v = _coerce(x, args[1])
                if not ok:
                    return False, value
                out[k] = v
            return True, out
        return True, value
    return True, value  # dataclass-typed and other fields: validated by their own constructors


def check_value(value: Any, tp, key: str) -> Tuple[Any, Optional[str]]:
    """(value converted to ``tp``, None) or (value, "key: expected ..., got ...")."""
    ok, v = _coerce(value, tp)
    if ok:
        return v, None
    return value, f"{key}: expected {_describe(tp)}, got {value!r} ({type(value).__name__})"
