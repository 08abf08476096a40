"""A new strategy's checklist: each record of ``parallel.STRATEGIES`` has a memory term, a cost in the step-time
model, and a translation (or a refusal in words) in every other stack the course writes settings for.

Each strategy is turned on, on the smallest layout that shows it, beside the same layout with it off: the memory
estimate, the modeled step and each tool's settings must each say something different. A strategy added to the
records without them fails here, naming what it lacks.
"""

from __future__ import annotations

import pytest

from gpucourse.config import ConfigError, TrainConfig
from gpucourse.interop import stack_config
from gpucourse.modeled import memory
from gpucourse.modeled.costs import COSTS, Cost
from gpucourse.modeled.gpus import get_gpu
from gpucourse.modeled.plan import step_time
from gpucourse.parallel import STRATEGIES

# Each strategy off and on: the layouts differ by that strategy alone.
ON = {
    "pipeline": ({}, {"pp": 2, "microbatches": 2}),
    "tensor": ({}, {"tp": 2}),
    "context": ({}, {"cp": 2}),
    "experts": ({"dp": 2, "moe_experts": 4}, {"dp": 2, "moe_experts": 4, "ep": 2}),
    "recomputation": ({}, {"checkpoint_activations": True}),
    "data": ({}, {"dp": 2}),
}
NAMES = [s.name for s in STRATEGIES]


def _pair(name):
    off, on = ON[name]
    return TrainConfig(**off), TrainConfig(**on)


def test_every_strategy_has_a_layout_here_and_a_cost_function():
    assert list(ON) == NAMES, "a strategy without its pair of layouts in ON: add one to walk its checklist"
    assert set(COSTS) == set(NAMES), "each strategy needs its function in gpucourse.modeled.costs.COSTS"


@pytest.mark.parametrize("name", NAMES)
def test_each_strategy_changes_the_memory_estimate(name):
    off, on = _pair(name)
    assert memory.estimate(on)["max"] != memory.estimate(off)["max"], f"{name} has no term in the memory estimate"


@pytest.mark.parametrize("name", NAMES)
def test_each_strategy_costs_time_in_the_modeled_step_and_none_when_off(name):
    off, on = _pair(name)
    gpu = get_gpu("h100")
    n = memory.num_params(on.model_config())
    with_it, without = step_time(on, n, gpu, 8).costs[name], step_time(off, n, gpu, 8).costs[name]
    assert without == Cost(), f"{name} costs time in a layout that does not use it"
    assert with_it.comm_s > 0 or with_it.extra_s > 0, f"{name} costs nothing in the step-time model"
    assert 0 <= with_it.exposed_s <= with_it.comm_s


@pytest.mark.parametrize("tool", stack_config.TOOLS)
@pytest.mark.parametrize("name", NAMES)
def test_each_strategy_is_translated_or_refused_in_words_by_each_tool(name, tool):
    off, on = _pair(name)
    before = stack_config.translate(off, tool)
    try:
        after = stack_config.translate(on, tool)
    except (ValueError, ConfigError) as refused:  # a refusal is an answer, if it is a sentence
        assert str(refused).strip().endswith(".") and "\n" not in str(refused).strip()
        return
    assert (after.settings, after.notes) != (before.settings, before.notes), \
        f"{tool}'s settings and notes are the same with and without {name}: neither translated nor refused"


def test_the_checklist_fails_a_strategy_the_models_ignore(monkeypatch):
    """Planted: the tensor strategy's cost function forgotten (as a new strategy's would be) is caught."""
    from gpucourse.modeled import costs

    monkeypatch.setitem(costs.COSTS, "tensor", lambda step: Cost())
    with pytest.raises(AssertionError, match="tensor costs nothing"):
        test_each_strategy_costs_time_in_the_modeled_step_and_none_when_off("tensor")
