"""The contract layer the exercises' checks share, on its own: what it calls a view, what it calls unchanged, and
that each broken promise is named in one line with its reproduction (the graded wrong answers are in
tests/mutants, graded by test_grading.py)."""

from __future__ import annotations

import pytest
import torch

from gpucourse.grading.contracts import Contract, as_strided_view, describe_case, expect_precision, hold, same_bits
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


def test_lists_and_numbers_the_caller_passed_are_held_unchanged_with_their_types():
    tables = Contract("attend", ("q", "tables", "lengths"), unchanged=("q", "tables", "lengths"))
    q = torch.randn(2, 3)
    sent = (q, [[0, 2], [4]], [6, 3])
    hold(tables, [sent], [_outcome(None, (q, [[0, 2], [4]], [6, 3]))])
    with pytest.raises(Fail, match=r"changed its input tables: \[\[0, 2\], \[4\]\] became \[tensor\(\[0, 2\]\), "):
        hold(tables, [sent], [_outcome(None, (q, [torch.tensor([0, 2]), torch.tensor([4])], [6, 3]))])
    with pytest.raises(Fail, match=r"changed its input lengths: \[6, 3\] became \[3\]"):
        hold(tables, [sent], [_outcome(None, (q, [[0, 2], [4]], [3]))])


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


STEP = Contract("step", ("params", "grads"), unchanged=("grads",), strided=("params",))
SUM = Contract("ring_all_reduce", ("tensor",), fresh=True)


def test_a_list_of_tensors_is_held_element_by_element_and_described_by_its_shapes():
    grads = [torch.randn(2, 3), torch.randn(4)]
    sent = ([as_strided_view(torch.randn(2, 3))], grads)
    hold(STEP, [sent], [_outcome(None, (None, [g.clone() for g in grads]))])  # kept
    with pytest.raises(Fail, match=r"contract 'inputs unchanged': rank 0's step changed its input grads in backward "
                                   r"\(1 rank, float32, params \[2×3\] \(strided views\), grads \[2×3, 4\]\)"):
        hold(STEP, [sent], [_outcome(None, (None, [grads[0], torch.zeros(4)]))], " in backward")


def test_a_result_that_shares_the_inputs_memory_breaks_a_new_tensor():
    t = torch.randn(3)
    hold(SUM, [(t,)], [_outcome(t.clone(), (t,))])
    with pytest.raises(Fail, match=r"contract 'a new tensor': rank 0's ring_all_reduce returned a tensor that shares "
                                   r"its memory with its input tensor"):
        hold(SUM, [(t,)], [Outcome(0, t, (t,), 0, [], 0.0)])


def test_precision_is_float64s_once_the_values_agree():
    want = torch.randn(5, dtype=torch.float64)
    expect_precision(STEP, "the weights", want + 1e-15, want, "1 rank")
    with pytest.raises(Fail, match=r"contract 'keeps the dtype': step left the weights 1e-08 away from the float64 "
                                   r"result, float32's rounding"):
        expect_precision(STEP, "the weights", want + 1e-8, want, "1 rank")
    with pytest.raises(Fail, match=r"contract 'keeps the dtype': step left the weights in torch.float32"):
        expect_precision(STEP, "the weights", want.float(), want, "1 rank")
    with pytest.raises(Fail, match=r"^the weights: 5 of 5 elements differ"):  # wrong values are said as such
        expect_precision(STEP, "the weights", want + 1, want, "1 rank")
