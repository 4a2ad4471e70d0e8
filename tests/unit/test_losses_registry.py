"""The objectives' rows: an objective is its row and its term function, the docs' table is the rows', the losses
package has no import loop. Run: ``pytest tests/unit/test_losses_registry.py``."""
import ast
import dataclasses
import os

import torch

from megatron_rl.losses import LossBatch, Objective, PolicyLoss, PolicyLossConfig, compute_policy_loss
from megatron_rl.losses.params import PARAMETERS, TAU_POS
from megatron_rl.losses.registry import OBJECTIVES, objectives_markdown
from megatron_rl.losses.terms import ObjectiveTerms

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOSSES = os.path.join(ROOT, "megatron_rl", "losses")


def _weighted_pg(x):
    """-A w log pi (a plain torch formula, no code of the project's objectives)."""
    w = 1.0 if x.is_weights is None else x.is_weights
    zeros = torch.zeros_like(x.log_probs, dtype=torch.float64)
    return ObjectiveTerms(-x.advantages * w * x.log_probs, zeros, zeros, zeros)


def test_a_row_outside_the_table_runs_end_to_end():
    """A new objective needs its row and its term function only: the loss runs it with the row's aggregation."""
    row = Objective("toy", _weighted_pg, "this test", parameters=(TAU_POS,), aggregation="token-sum")
    loss = PolicyLoss(row, PolicyLossConfig(loss_agg_mode="token-mean"))
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(3, 5, generator=g, dtype=torch.float64) - 0.1).requires_grad_()
    old, adv = lp.detach() - 0.05, torch.randn(3, 5, generator=g, dtype=torch.float64)
    w = torch.rand(3, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(3, 5, generator=g) > 0.3).double()
    sel, kept, metrics = loss.select(old, None, adv, mask)
    assert sel is None and kept is mask and metrics == {}
    old_used, w_used = loss.loss_inputs(old - 1.0, old, w)
    assert old_used is old and w_used is w
    out = compute_policy_loss(loss, LossBatch(lp, old_used, adv, kept, is_weights=w_used))
    valid = mask != 0
    expected = (-adv * w * lp)[valid].sum()                 # token-sum: the row's, not the config's token-mean
    torch.testing.assert_close(out.pg_loss, expected, rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(out.loss, lp)
    torch.testing.assert_close(grad, torch.where(valid, -adv * w, torch.zeros(())), rtol=1e-12, atol=1e-12)
    assert loss.parameter_errors() == []
    assert PolicyLoss(row, PolicyLossConfig(clip_ratio_c=5.0)).parameter_errors()[0].startswith(
        "actor.policy_loss.clip_ratio_c: set to 5.0 but loss_type 'toy'")


def test_every_parameter_row_is_a_documented_config_field():
    fields = {f.name: f for f in dataclasses.fields(PolicyLossConfig)}
    assert [p.name for p in PARAMETERS if p.name not in fields] == []
    read = {p for row in OBJECTIVES.values() for p in row.parameters}
    assert read == set(PARAMETERS), "a parameter row no objective reads"


def test_docs_table_is_the_rows():
    text = open(os.path.join(ROOT, "docs", "objectives.md")).read()
    begin, end = "<!-- objectives table: begin -->\n", "<!-- objectives table: end -->"
    assert text[text.index(begin) + len(begin):text.index(end)].strip() == objectives_markdown().strip(), (
        "docs/objectives.md's table is stale: paste the output of "
        "python -c 'from megatron_rl.losses.registry import objectives_markdown as m; print(m())'")


def _imports(path):
    """(modules of megatron_rl.losses this file imports at its top level, names imported inside functions)."""
    tree = ast.parse(open(path).read())
    top, inner = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            (top.update(names) if node in tree.body else inner.extend(names))
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and node not in tree.body:
            inner.append(getattr(node, "module", None) or node.names[0].name)
    return top, inner


def test_losses_modules_import_downwards_only():
    graph, inner = {}, {}
    for f in sorted(os.listdir(LOSSES)):
        if f.endswith(".py") and f != "__init__.py":
            graph[f[:-3]], inner[f[:-3]] = _imports(os.path.join(LOSSES, f))
    assert {m: i for m, i in inner.items() if i} == {}, "imports inside functions"
    done, stack = set(), []

    def visit(m):
        assert m not in stack, f"import loop: {' -> '.join(stack + [m])}"
        if m in done or m not in graph:
            return
        stack.append(m)
        for dep in graph[m]:
            visit(dep)
        stack.pop()
        done.add(m)

    for m in graph:
        visit(m)
