"""The contract layer the exercises' checks share, on its own: what it calls a view, what it calls unchanged, and
that each broken promise is named in one line with its reproduction (the graded wrong answers are in
tests/mutants, graded by test_grading.py)."""

from __future__ import annotations

import pytest
import torch

from gpucourse.grading.contracts import Contract, as_strided_view, describe_case, hold, same_bits
from gpucourse.grading.core import Fail, Outcome

ATTEND = Contract("attend", ("q", "k", "causal"), unchanged=("q", "k"), dtype_of="q", strided=("q", "k"))


def _outcome(value, args, rank=0):
    return Outcome(rank, value, tuple(args), None, [], 0.0)


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4, 5)])
def test_a_strided_view_holds_the_same_values_and_is_not_contiguous(shape):
    t = torch.randn(shape)
    view = as_strided_view(t)
    assert torch.equal(view, t) and not view.is_contiguous()
    if len(shape) > 1:  # a caller's transpose: dense, so empty_like copies its strides, and irecv would refuse them
        assert torch.empty_like(view).stride() == view.stride()


def test_unchanged_means_every_byte():
    a = torch.tensor([0.0, float("nan"), 1.0])
    assert same_bits(a, a.clone())
    assert not same_bits(a, torch.tensor([-0.0, float("nan"), 1.0]))  # equal as numbers, not as bytes
    assert not same_bits(a, a.double()) and not same_bits(a, a[:2])


def test_each_broken_promise_is_named_with_its_reproduction():
    q, k = torch.randn(2, 3), torch.randn(2, 3)
    sent = (q, k, True)
    hold(ATTEND, [sent], [_outcome(torch.zeros(2, 2), sent)])  # kept: nothing raised
    with pytest.raises(Fail, match=r"contract 'inputs unchanged': rank 0's attend changed its input k "
                                   r"\(1 rank, float32, q 2×3, k 2×3\)"):
        hold(ATTEND, [sent], [_outcome(torch.zeros(2, 2), (q, k * 2, True))])
    with pytest.raises(Fail, match=r"contract 'keeps the dtype': rank 1's attend returned a torch.float32 tensor "
                                   r"for q in torch.float64"):
        double = (q.double(), k.double(), True)
        hold(ATTEND, [double, double], [_outcome(torch.zeros(2, 2).double(), double),
                                        _outcome((torch.zeros(2, 2).double(), torch.zeros(2)), double, rank=1)])


def test_the_reproduction_says_which_inputs_were_views():
    case = describe_case(ATTEND, (as_strided_view(torch.randn(2, 3)), torch.randn(2, 3), False), 2)
    assert case == "2 ranks, float32, q 2×3 (a strided view), k 2×3"
