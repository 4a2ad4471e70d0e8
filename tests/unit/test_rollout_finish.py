"""The stop set of ``megatron_rl.rollout.finish``: ``ignore_eos`` means what SGLang means by it.

``SamplingParams.ignore_eos`` is documented as "keep generating past EOS / stop ids" and the project mirrors
SGLang's ``sampling_params``. SGLang 0.5.23 (``Req._check_token_based_finish``) returns before it looks at
``stop_token_ids`` when ``ignore_eos`` is set, so a stop id does not end a response there. The stop set of
``megatron_rl.rollout.finish`` (which the embedded engine stops on, and by which the SGLang client and the
async segmented view turn "length" into "stop") kept the stop ids under ``ignore_eos``: the two engines then
ended the same request at different places, and the SGLang client called a row "stop" that SGLang itself would
have continued.

* the stop set equals SGLang's own finish rule, read from the installed SGLang source (not imported: the
  package import is heavy) and run on every (ignore_eos, stop ids, EOS ids, token) combination;
* the embedded engine with ``ignore_eos`` and a stop id that the greedy response contains runs to
  ``max_new_tokens`` (reference: the same greedy response without the stop id).
"""
import ast
import importlib.util
import itertools
import os

import pytest

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.finish import normalised_finish, stop_ids


def _sglang_token_finish():
    """SGLang's ``Req._check_token_based_finish`` compiled from the installed source, or None."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "srt", "managers", "schedule_batch.py")
    if not os.path.isfile(path):
        return None
    tree = ast.parse(open(path).read())
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and cls.name == "Req":
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "_check_token_based_finish":
                    mod = ast.Module(body=[fn], type_ignores=[])
                    ns = {"List": list, "FINISH_MATCHED_TOKEN": lambda matched: ("stop", matched)}
                    exec(compile(mod, path, "exec"), ns)
                    return ns["_check_token_based_finish"]
    return None


class _Req:
    """The attributes SGLang's finish check reads."""

    def __init__(self, ignore_eos, stop_token_ids, eos_token_ids, output_ids):
        self.sampling_params = type("SP", (), {"ignore_eos": ignore_eos, "stop_token_ids": set(stop_token_ids)})()
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer = None
        self.output_ids = list(output_ids)
        self.finished_reason = None
        self.finished_len = None


def test_stop_set_is_sglangs_token_finish_rule():
    check = _sglang_token_finish()
    if check is None:
        pytest.skip("SGLang's Req._check_token_based_finish source is not installed")
    cases = 0
    for ignore_eos, stops, eos in itertools.product((False, True), ((), (7,), (7, 8)), ((), (1,), (1, 2))):
        ours = stop_ids(SamplingParams(max_new_tokens=4, stop_token_ids=stops, ignore_eos=ignore_eos), eos)
        for tok in range(10):
            req = _Req(ignore_eos, stops, eos, [5, tok])
            sglang_stops = bool(check(req, [tok]))
            assert (tok in ours) == sglang_stops, (ignore_eos, stops, eos, tok)
            # and the client's normalisation of a "length" reply agrees with what SGLang would have reported
            assert normalised_finish("length", [5, tok], ours) == ("stop" if sglang_stops else "length")
            cases += 1
    assert cases == 2 * 3 * 3 * 10


def test_embedded_ignore_eos_also_ignores_stop_ids(copy_model):
    from megatron_rl.rollout.embedded import EmbeddedEngine
    engine = EmbeddedEngine(copy_model, dtype="float32", weight_version="v")
    prompt = [[17, 13, 4, 5, 14]]
    free = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))[0]
    assert len(free.response_ids) == 6 and free.finish_reason == "length"
    stop = free.response_ids[1]
    got = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True,
                                                 stop_token_ids=(stop,)))[0]
    assert got.response_ids == free.response_ids and got.finish_reason == "length"
    # without ignore_eos the stop id ends it (the rule is unchanged there)
    got = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(stop,)))[0]
    k = next(i for i, t in enumerate(free.response_ids) if t in (stop, 1)) + 1   # 1: the task model's EOS
    assert got.response_ids == free.response_ids[:k] and got.finish_reason == "stop"
