"""TF32, FP8 and tensor-core shapes, emulated: the rounding is the hardware's, checked against an independent
computation; the errors and the delayed-scaling story that notebook 07 tells hold."""

from __future__ import annotations

import pytest
import torch

from gpucourse.modeled import tensor_cores as tc
from gpucourse.model import MODELS


def test_fp8_formats_and_their_maxima():
    # E4M3 (fn: no infinities): 1.75 × 2^8; E5M2: 1.75 × 2^15 — the numbers the course states.
    assert tc.fp8_max("e4m3") == 448.0 == 1.75 * 2 ** 8
    assert tc.fp8_max("e5m2") == 57344.0 == 1.75 * 2 ** 15
    assert tc.fp8_smallest("e4m3") == 2 ** -9 and tc.fp8_smallest("e5m2") == 2 ** -16
    assert torch.tensor([2 ** -9, 2 ** -11]).to(torch.float8_e4m3fn).float().tolist() == [2 ** -9, 0.0]
    with pytest.raises(ValueError, match="e4m3, e5m2"):
        tc.fp8_max("e3m4")


def test_quantize_keeps_representable_values_and_saturates_the_rest():
    x = torch.tensor([0.0, 1.0, -2.5, 448.0, 1000.0, -1e6])
    assert tc.quantize(x, "e4m3").tolist() == [0.0, 1.0, -2.5, 448.0, 448.0, -448.0]
    assert tc.quantize(x, "e5m2", scale=0.5).tolist() == [0.0, 1.0, -2.5, 448.0, 1024.0, -114688.0]
    assert tc.amax_scale(4.0, "e4m3") == 112.0 and tc.amax_scale(4.0, "e4m3", margin=1) == 56.0


def test_to_tf32_rounds_to_ten_mantissa_bits_nearest_even():
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=gen) * 10 ** torch.randint(-30, 30, (20000,), generator=gen),
                   1 + torch.tensor([1, 3, 5, 2.5]) * 2 ** -11])  # exact ties go to the even neighbour
    mantissa, exponent = torch.frexp(x.double())
    reference = torch.ldexp(torch.round(mantissa * 2 ** 11) / 2 ** 11, exponent)  # 1 + 10 bits; round: ties to even
    assert torch.equal(tc.to_tf32(x).double(), reference)
    assert tc.to_tf32(torch.tensor([1 + 2 ** -11])).item() == 1.0
    assert tc.to_tf32(torch.tensor([float("inf"), float("nan")])).isfinite().tolist() == [False, False]


def test_matmul_error_grows_as_the_inputs_lose_bits():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(128, 256, generator=gen), torch.randn(256, 64, generator=gen)
    err = {how: tc.matmul_error(a, b, how) for how in ("fp32", "tf32", "bf16", "e4m3", "e5m2")}
    assert err["fp32"] < 1e-6 < err["tf32"] < 2 ** -10 < err["bf16"] < 2 ** -7 < err["e4m3"] < err["e5m2"] < 0.15


def test_unscaled_gradients_underflow_in_e4m3_and_scaling_saves_them():
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(10000, generator=gen) * 1e-4  # gradient-sized values
    assert tc.errors(grads, "e4m3")["underflow"] > 0.9      # below E4M3's smallest subnormal, 2^-9
    assert tc.errors(grads, "e5m2")["underflow"] < 0.1      # E5M2 reaches 2^-16
    scaled = {f: tc.errors(grads, f, tc.amax_scale(grads.abs().max().item(), f)) for f in ("e4m3", "e5m2")}
    assert all(s["underflow"] < 0.01 and s["saturated"] == 0 for s in scaled.values())
    # One more mantissa bit: about half the error.
    assert 0.35 < scaled["e4m3"]["relative_error"] / scaled["e5m2"]["relative_error"] < 0.65


def test_delayed_scaling_clips_the_step_of_a_jump_and_a_margin_absorbs_growth():
    rows = tc.delayed_scaling_demo(steps=8, jump_at=5, jump=4.0)
    assert rows[0]["scale"] == 1.0 and rows[1]["scale"] == tc.amax_scale(rows[0]["amax"], "e4m3")
    # What notebook 07 says of it: about a third clipped, more than ten times the error of the steps around it.
    assert 0.25 < rows[5]["saturated"] < 0.45 and rows[5]["relative_error"] > 10 * rows[4]["relative_error"]
    assert rows[6]["saturated"] == 0 and rows[6]["scale"] == tc.amax_scale(rows[5]["amax"], "e4m3")
    margin = tc.delayed_scaling_demo(steps=8, jump_at=5, jump=4.0, margin=1)
    assert all(r["saturated"] == 0 for r in margin if r["step"] != 5) and margin[5]["saturated"] > 0
    recent = tc.delayed_scaling_demo(steps=8, jump_at=5, jump=4.0, algo="most_recent")
    assert recent[7]["scale"] == tc.amax_scale(recent[6]["amax"], "e4m3")  # forgets the jump at once


def test_tensor_core_shapes():
    assert tc.padded(50257) == 50304 == tc.padded(50257, 128) and tc.padded(64) == 64
    assert tc.misaligned_dims(MODELS["gpt2-small"]) == {"vocabulary": 50257}
    assert tc.misaligned_dims(MODELS["gpt2-small"], tp=2) == {"vocabulary": 50257}
    assert tc.misaligned_dims(MODELS["tiny"], tp=16) == {"vocabulary": 64}  # 4 columns a rank
    assert tc.misaligned_dims(MODELS["tiny"]) == {}


def test_pytorchs_tf32_defaults_are_what_notebook_07_says():
    """fp32 matmuls stay fp32 unless TF32 is allowed; cuDNN's convolutions use it unless it is forbidden."""
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is True
