"""Global L2 clipping and the non-finite detector (docs/design.md §2)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from helpers import HostReads

from ampguard import clip_global_l2_norm, has_non_finite_grad

INF = float("inf")
NAN = float("nan")

# ----------------------------------------------------------------------------- helpers


def params_with_grads(*grads: torch.Tensor | None) -> list[nn.Parameter]:
    """One parameter per grad (same shape), with ``.grad`` set to a copy of it (None stays None)."""
    out = []
    for g in grads:
        shape = g.shape if g is not None else (3,)
        p = nn.Parameter(torch.zeros(shape, dtype=torch.float32 if g is None else g.dtype))
        p.grad = None if g is None else g.clone()
        out.append(p)
    return out


def random_grads(scale: float, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) * scale for s in [(3, 4), (5,), (2, 2, 2), (1,)]]


def concat_norm(grads: list[torch.Tensor]) -> float:
    """The global L2 norm computed independently: all grads as one float64 vector."""
    return float(torch.cat([g.detach().reshape(-1).double() for g in grads]).norm())


def grads_of(params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in params]


# ----------------------------------------------------------------------------- clip_global_l2_norm


def test_clips_when_above_max_norm():
    grads = random_grads(scale=10.0)
    params = params_with_grads(*grads)
    expected_pre = concat_norm(grads)
    max_norm = 1.5
    assert expected_pre > 10 * max_norm

    pre, post = clip_global_l2_norm(params, max_norm)
    assert isinstance(pre, torch.Tensor) and isinstance(post, torch.Tensor)
    assert pre.dim() == 0 and post.dim() == 0
    assert float(pre) == pytest.approx(expected_pre, rel=1e-6)
    assert float(post) <= max_norm
    assert float(post) == pytest.approx(max_norm, rel=1e-5)
    # post is what the clip really did: the norm of the clipped gradients
    assert concat_norm([p.grad for p in params]) == pytest.approx(float(post), rel=1e-5)
    # every gradient was multiplied by the same factor (the direction is kept)
    factor = float(post) / float(pre)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g * factor, rtol=1e-5, atol=1e-7)


def test_leaves_grads_alone_when_below_max_norm():
    grads = random_grads(scale=0.01)
    params = params_with_grads(*grads)
    expected_pre = concat_norm(grads)
    assert expected_pre < 1.0
    pre, post = clip_global_l2_norm(params, 1.0)
    assert float(pre) == pytest.approx(expected_pre, rel=1e-6)
    assert torch.equal(post, pre)
    assert float(post) <= 1.0
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)


@pytest.mark.parametrize("max_norm, error", [(math.nan, ValueError), (torch.tensor(math.nan), ValueError),
                                             ("1.0", TypeError), (torch.tensor([1.0, 2.0]), TypeError)])
def test_a_max_norm_that_is_neither_a_threshold_nor_off_is_refused_with_the_gradients_untouched(max_norm, error):
    # NaN read as "clipping off" (max_norm > 0 is False): (5, 5) back and the gradients as they
    # were, where clip_grad_norm_ makes them all NaN and Guard() refuses it
    params = params_with_grads(torch.tensor([3.0, 4.0]))
    with pytest.raises(error, match=r"^max_norm must be a number or None, got "):
        clip_global_l2_norm(params, max_norm)
    assert params[0].grad.tolist() == [3.0, 4.0]


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e6])
@pytest.mark.parametrize("scale", [0.1, 1.0, 100.0])
def test_bitwise_equal_to_clip_grad_norm_(scale, max_norm):
    grads = random_grads(scale=scale, seed=3)
    mine = params_with_grads(*grads)
    theirs = params_with_grads(*grads)
    pre, post = clip_global_l2_norm(mine, max_norm)
    total = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert torch.equal(pre, total)
    for a, b in zip(mine, theirs):
        assert torch.equal(a.grad, b.grad)
    assert float(post) <= max_norm
    assert float(post) == pytest.approx(min(float(pre), max_norm), rel=1e-5)


@pytest.mark.parametrize("max_norm", [torch.tensor([0.3]), torch.tensor(0.3, dtype=torch.float64),
                                      torch.tensor([[0.3]], dtype=torch.float64), torch.tensor(0.3, dtype=torch.bfloat16)])
def test_a_one_element_tensor_threshold_clips_as_clip_grad_norm_does(max_norm):
    # review 50d: a (1,)-shaped threshold was accepted, then failed in the clip's in-place
    # multiply; a float64 one computed the factor in float32, where PyTorch reads float(max_norm)
    for seed in range(20):
        grads = random_grads(scale=3.0, seed=seed)
        mine, theirs = params_with_grads(*grads), params_with_grads(*grads)
        pre, post = clip_global_l2_norm(mine, max_norm)
        assert torch.equal(pre, torch.nn.utils.clip_grad_norm_(theirs, max_norm))
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine, theirs))
        assert post.shape == () and post <= torch.tensor(float(max_norm))  # (a float32 norm: capped at it in float32)


def test_bitwise_equal_to_clip_grad_norm_on_a_model_after_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    twin = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 8), torch.randn(4, 2) * 50
    for m in (model, twin):
        torch.nn.functional.mse_loss(m(x), y).backward()
    pre, _ = clip_global_l2_norm(model.parameters(), 0.25)  # a generator is accepted
    total = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.25)
    assert float(total) > 0.25
    assert torch.equal(pre, total)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("max_norm", [None, 0, 0.0, -1.0])
def test_max_norm_none_or_nonpositive_disables_clipping(max_norm):
    grads = random_grads(scale=10.0)
    params = params_with_grads(*grads)
    pre, post = clip_global_l2_norm(params, max_norm)
    assert float(pre) == pytest.approx(concat_norm(grads), rel=1e-6)
    assert float(pre) > 1.0
    assert torch.equal(post, pre)
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)


@pytest.mark.parametrize("bad", [INF, -INF, NAN])
@pytest.mark.parametrize("max_norm", [1.0, None])
def test_non_finite_grad_gives_non_finite_pre(bad, max_norm):
    grads = random_grads(scale=1.0)
    grads[1][2] = bad
    pre, post = clip_global_l2_norm(params_with_grads(*grads), max_norm)
    assert not math.isfinite(float(pre))
    if bad != bad:
        assert math.isnan(float(pre))
    else:
        assert float(pre) == INF
    assert not math.isfinite(float(post))


def test_global_norm_is_not_the_per_parameter_norm():
    a, b = params_with_grads(torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0]))
    pre, post = clip_global_l2_norm([a, b], 2.5)
    assert float(pre) == pytest.approx(5.0)  # sqrt(3^2 + 4^2), not max(3, 4) nor 3 + 4
    assert float(post) == pytest.approx(2.5, rel=1e-5)
    # both scaled by the same factor 0.5: a (norm 3 > 2.5 alone) and b (norm 4) alike,
    # whereas per-parameter clipping would give [2.5, 0] and [0, 2.5]
    torch.testing.assert_close(a.grad, torch.tensor([1.5, 0.0]), rtol=1e-5, atol=0)
    torch.testing.assert_close(b.grad, torch.tensor([0.0, 2.0]), rtol=1e-5, atol=0)

    # A parameter whose own norm is below max_norm is still clipped when the global norm is not.
    small, big = params_with_grads(torch.tensor([0.6, 0.8]), torch.tensor([6.0, 8.0]))
    pre, _ = clip_global_l2_norm([small, big], 2.0)
    assert float(pre) == pytest.approx(math.sqrt(1.0 + 100.0))
    assert float(small.grad.norm()) < 1.0 * 0.5


def test_params_without_grad_are_ignored():
    grads = random_grads(scale=5.0)
    params = params_with_grads(grads[0], None, grads[1], None)
    pre, post = clip_global_l2_norm(params, 1.0)
    assert float(pre) == pytest.approx(concat_norm(grads[:2]), rel=1e-6)
    assert params[1].grad is None and params[3].grad is None
    assert concat_norm([params[0].grad, params[2].grad]) == pytest.approx(float(post), rel=1e-5)


def test_no_grads_at_all_gives_zero():
    params = params_with_grads(None, None)
    pre, post = clip_global_l2_norm(params, 1.0)
    assert float(pre) == 0.0 and float(post) == 0.0
    assert all(p.grad is None for p in params)


def test_single_tensor_is_accepted():
    (p,) = params_with_grads(torch.tensor([3.0, 4.0]))
    pre, post = clip_global_l2_norm(p, 1.0)
    assert float(pre) == pytest.approx(5.0)
    assert float(post) == pytest.approx(1.0, rel=1e-5)
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.8]), rtol=1e-5, atol=0)


def test_post_never_exceeds_max_norm_right_at_the_threshold():
    for target in [1.0, 1.0 + 1e-7, 1.0 - 1e-7, 2.0**-10, 1e4]:
        (p,) = params_with_grads(torch.tensor([target]))
        _, post = clip_global_l2_norm([p], 1.0)
        assert float(post) <= 1.0
        assert float(p.grad.abs().max()) <= 1.0


def test_post_is_never_above_max_norm():
    over = []
    for seed in range(20):
        for max_norm in (0.5, 1.0, 3.0, 7.0):  # exact in float32, so "<=" is meaningful
            params = params_with_grads(*random_grads(scale=100.0, seed=seed))
            _, post = clip_global_l2_norm(params, max_norm)
            if not float(post) <= max_norm:
                over.append((seed, max_norm, float(post)))
    assert over == []


def test_clip_makes_no_host_read():
    params = params_with_grads(*random_grads(scale=10.0))
    with HostReads() as reads:
        pre, post = clip_global_l2_norm(params, 1.0)
    assert reads.count == 0
    assert float(post) < float(pre)


# ----------------------------------------------------------------------------- has_non_finite_grad


def test_has_non_finite_grad_false_on_finite():
    params = params_with_grads(*random_grads(scale=1e30))  # huge but finite
    result = has_non_finite_grad(params)
    assert result is False


@pytest.mark.parametrize("bad", [INF, -INF, NAN])
@pytest.mark.parametrize("where", [0, 3])
def test_has_non_finite_grad_true(bad, where):
    grads = random_grads(scale=1.0)
    grads[where].view(-1)[0] = bad
    assert has_non_finite_grad(params_with_grads(*grads)) is True


def test_has_non_finite_grad_ignores_params_without_grads():
    assert has_non_finite_grad(params_with_grads(None, None)) is False
    assert has_non_finite_grad([]) is False
    assert has_non_finite_grad(params_with_grads(None, torch.ones(3), None)) is False
    assert has_non_finite_grad(params_with_grads(None, torch.tensor([1.0, NAN]))) is True
    (p,) = params_with_grads(torch.tensor([INF]))
    assert has_non_finite_grad(p) is True  # a single tensor


@pytest.mark.parametrize("measure", [has_non_finite_grad, lambda grads: clip_global_l2_norm(grads, 1.0)])
def test_gradient_tensors_given_for_parameters_are_refused_not_read_as_no_gradient(measure):
    """``[p.grad for p in params]`` holding a NaN: each tensor has no ``.grad`` of its own, so it
    would be skipped like a frozen parameter and the answer would be "finite"."""
    (p,) = params_with_grads(torch.tensor([1.0, NAN]))
    with pytest.raises(TypeError, match="pass the parameters"):
        measure([p.grad])
    # a frozen parameter (no grad, requires_grad False) and a plain leaf that requires grad are
    # still skipped quietly, as clip_grad_norm_ skips them
    frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
    leaf = torch.zeros(2, requires_grad=True)
    assert has_non_finite_grad([frozen, leaf]) is False


def test_has_non_finite_grad_mixed_dtypes():
    params = params_with_grads(torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.bfloat16))
    assert has_non_finite_grad(params) is False
    params[0].grad = torch.tensor([65504.0, INF], dtype=torch.float16)
    assert has_non_finite_grad(params) is True


def test_the_split_clip_is_clip_grad_norm_bit_for_bit_over_mixed_dtypes():
    """clip_factor + scale_grads_ (what clip_to_norm_ does) against PyTorch's clip_grad_norm_,
    with float32 and bfloat16 gradients grouped separately."""
    from ampguard.clipping import clip_factor, global_l2_norm, scale_grads_

    def params():
        g = torch.Generator().manual_seed(3)
        out = []
        for dtype in (torch.float32, torch.bfloat16, torch.float32):
            p = torch.nn.Parameter(torch.zeros(5, dtype=dtype))
            p.grad = (torch.randn(5, generator=g) * 4).to(dtype)
            out.append(p)
        return out

    mine, ref = params(), params()
    pre = global_l2_norm(mine)
    factor, post = clip_factor(pre, 0.5)
    scale_grads_(mine, factor)
    ref_pre = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    assert torch.equal(pre, ref_pre)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine, ref))
    assert post.item() <= 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("max_norm", [1.0, 0.5, 1e-3, 3.3, 1e30, 3.4028236e38, 1e300, 7e-39])
def test_the_host_post_clip_norm_is_the_devices_bit_for_bit(dtype, max_norm):
    """The exact step computes the post-clip norm on the host from the pre-clip norm and the
    clip factor it read: it must be the value the device's multiply and clamp give, for norms
    over the whole range (subnormal to near the largest), around the threshold and at 0; a
    threshold past float32's largest must neither change the result nor fail (the device clamp
    used to raise on it)."""
    import math

    from ampguard.clipping import clip_coefficient, post_clip_norm, post_clip_value

    g = torch.Generator().manual_seed(int(max_norm * 1000) % 997)
    exponents = torch.empty(3000, dtype=torch.float64).uniform_(-45, 38, generator=g)
    pre = (10 ** exponents) * torch.empty(3000, dtype=torch.float64).uniform_(1, 10, generator=g)
    edges = [max_norm, max_norm * (1 + 1e-7), max_norm * (1 - 1e-7), 0.0, 1e-45, 3.4e38]
    pre = torch.cat([pre, torch.tensor(edges, dtype=torch.float64)]).to(dtype)
    factor = clip_coefficient(pre, max_norm)
    device = post_clip_norm(pre, factor, max_norm)
    host = [post_clip_value(p, f, max_norm, dtype) for p, f in zip(pre.tolist(), factor.tolist())]
    mismatches = [(p, d, h) for p, d, h in zip(pre.tolist(), device.tolist(), host)
                  if not (d == h or (math.isnan(d) and math.isnan(h)))]
    assert not mismatches, mismatches[:3]


def test_the_host_post_clip_norm_refuses_a_dtype_it_cannot_round():
    from ampguard.clipping import post_clip_value

    with pytest.raises(ValueError, match="bfloat16"):
        post_clip_value(2.0, 0.5, 1.0, torch.bfloat16)


def _mixed_gradients(seed: int) -> list[torch.Tensor]:
    """Gradients of several dtypes, interleaved (so grouping by dtype reorders them), with the odd
    shapes a model has: a 0-dim one, an empty one, a non-contiguous one, a large-valued bf16 one."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16,
                               torch.float64, torch.float32, torch.bfloat16)):
        shape = [(), (0,), (7, 3), (33,), (5, 4), (3,), (4, 6), (129,)][i]
        t = (torch.randn(shape, generator=g) * 10.0 ** (i % 4 - 1)).to(dtype)
        out.append(t.t() if t.dim() == 2 else t)  # (2-d: transposed, so not contiguous)
    out[-1] = out[-1] * 3e4  # (bf16 keeps float32's range)
    return out


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float32, torch.bfloat16), None])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_the_torch_2_4_total_norm_is_get_total_norm_bit_for_bit(foreach, dtypes, norm_type):
    """review 54e: on torch 2.4/2.5 (no ``get_total_norm``, public or private) the guard's norm is
    a copy of the norm half of 2.4's ``clip_grad_norm_``; called directly here (the installed
    torch has the real one), it must give the real one's bits: float32 only, bf16 only, both
    interleaved, and every dtype at once (None), with and without foreach. (CPU is the one device
    here; the cross-device path is the same ``.to(first_device)`` as torch's.)"""
    from ampguard.clipping import _total_norm_torch24

    for seed in range(3):
        grads = [t for t in _mixed_gradients(seed) if (dtypes is None or t.dtype in dtypes)
                 and (t.numel() or norm_type == 2.0)]  # (torch refuses an inf norm of an empty tensor)
        mine = _total_norm_torch24(grads, norm_type, foreach=foreach)
        ref = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
        assert mine.dtype == ref.dtype and mine.device == ref.device
        assert torch.equal(mine, ref), (seed, mine, ref)
        params = [nn.Parameter(torch.zeros_like(t)) for t in grads]
        for p, t in zip(params, grads):
            p.grad = t.clone()
        # and clip_grad_norm_'s own return value (what 2.4's code computed inline)
        assert torch.equal(mine, torch.nn.utils.clip_grad_norm_(params, math.inf, norm_type, foreach=foreach))


def test_the_torch_2_4_total_norm_of_nothing_and_of_a_non_finite_gradient():
    """review 54e: the fallback's edges are torch's: no tensors give 0, a NaN/inf one a NaN/inf norm."""
    from ampguard.clipping import _total_norm_torch24

    assert torch.equal(_total_norm_torch24([]), torch.nn.utils.get_total_norm([]))
    for bad in (INF, NAN):
        grads = [torch.ones(3), torch.tensor([1.0, bad], dtype=torch.bfloat16)]
        torch.testing.assert_close(_total_norm_torch24(grads), torch.nn.utils.get_total_norm(grads),
                                   rtol=0, atol=0, equal_nan=True)


# ----------------------------------------------------------------------------- the host clip factor (review 54f)


def _norms_for_the_factor(dtype: torch.dtype, n: int, seed: int) -> list[float]:
    """Norms a clip factor may meet, as ``dtype`` values: random over the whole range, and the
    edges: 0, subnormals, 1e-7, the neighbours of powers of two (where adding 1e-6 rounds up, or
    back to the norm: float32's ulp crosses 1e-6 between 16 and 64), 1e30, 3e38, the largest."""
    g = torch.Generator().manual_seed(seed)
    top = 38.5 if dtype == torch.float32 else 308
    exponents = torch.empty(n, dtype=torch.float64).uniform_(-46 if dtype == torch.float32 else -324, top, generator=g)
    random = ((10 ** exponents) * torch.rand(n, dtype=torch.float64, generator=g)).to(dtype)
    info = torch.finfo(dtype)
    edges = [0.0, info.smallest_normal, info.tiny / 2**20, 1e-45, 1e-40, 1e-7, 1e-6, 9.9999997e-7, 0.999999, 1.0,
             1e30, 3e38, info.max]
    for k in range(-24, 41):
        edges += [2.0**k, 2.0**k + 1e-6, 2.0**k - 1e-6]
    edges = torch.tensor(edges, dtype=torch.float64).to(dtype)
    around = torch.cat([edges, torch.nextafter(edges, torch.full_like(edges, math.inf)),
                        torch.nextafter(edges, torch.zeros_like(edges))])
    values = torch.cat([random, around])
    return values[torch.isfinite(values)].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_host_clip_factor_is_the_devices_bit_for_bit(dtype):
    """The exact step takes the clip factor on the host from the norm it read
    (clip_coefficient_value): it must be the device's four operations' result (add 1e-6,
    reciprocal, times max_norm, clamp at 1) exactly, for every norm and threshold, vectorised and
    as the step's own 0-dim tensor."""
    from ampguard.clipping import clip_coefficient, clip_coefficient_value

    norms = _norms_for_the_factor(dtype, 20000, seed=54)
    pre = torch.tensor(norms, dtype=dtype)
    for max_norm in (1.0, 0.5, 1e-3, 3.3, 123.456, 1e30, 3.4e38, 1e39, 7e-39, 1e300):
        device = clip_coefficient(pre, max_norm).tolist()
        host = [clip_coefficient_value(v, max_norm, dtype) for v in norms]
        bad = [(v, d, h) for v, d, h in zip(norms, device, host) if d != h]
        assert not bad, (max_norm, len(bad), bad[:3])
        for v in norms[::97]:  # (0-dim, as the step computes it)
            assert clip_coefficient(torch.tensor(v, dtype=dtype), max_norm).item() == clip_coefficient_value(v, max_norm, dtype), (v, max_norm)


def test_the_host_clip_factor_refuses_a_dtype_it_cannot_round():
    from ampguard.clipping import clip_coefficient_value

    with pytest.raises(ValueError, match="bfloat16"):
        clip_coefficient_value(2.0, 1.0, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_float_factor_multiplies_the_gradients_as_its_tensor_does(dtype):
    """GradSet.scale_ takes the host's factor as a float: the gradients must come out as they do
    multiplied by the factor tensor the device would have made."""
    from ampguard.clipping import GradSet, clip_coefficient, clip_coefficient_value

    grads = [g.to(dtype) for g in random_grads(7.0, seed=3)]
    by_tensor, by_float = params_with_grads(*grads), params_with_grads(*grads)
    pre = GradSet(by_tensor).norm()
    GradSet(by_tensor).scale_(clip_coefficient(pre, 0.3))
    GradSet(by_float).scale_(clip_coefficient_value(pre.item(), 0.3, dtype))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(by_tensor, by_float))
    assert not torch.equal(by_float[0].grad, grads[0])  # (it clipped)
