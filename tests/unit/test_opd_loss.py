"""The rejected-draft stream's k3 term against a direct implementation (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.model.target import soft_cap
from dflash_train.opd_loss import K3_CAP, LOG_PROB_FLOOR, k3, rejected_k3


def direct(hidden, weight, bias, tokens, teacher, softcap):
    """min(exp(r) - 1 - r, 10), r = max(log p(y), -10) - max(log q(y), -10), with
    full-vocabulary log-softmaxes, through autograd's clamps."""
    log_q = torch.log_softmax(hidden @ weight.T + bias, -1).gather(1, tokens[:, None])[:, 0]
    t = soft_cap(teacher @ weight.T + bias, softcap)
    log_p = torch.log_softmax(t, -1).gather(1, tokens[:, None])[:, 0]
    r = log_p.clamp(min=-10.0) - log_q.clamp(min=-10.0)
    return (torch.exp(r) - 1 - r).clamp(max=10.0), log_q, log_p


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_rejected_k3_matches_a_direct_implementation_in_value_and_gradient(softcap):
    gen = torch.Generator().manual_seed(0)
    m, h, v = 7, 6, 11
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64)
    bias = torch.randn(v, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, v, (m,), generator=gen)
    teacher = torch.randn(m, h, generator=gen, dtype=torch.float64)
    w = torch.rand(m, generator=gen, dtype=torch.float64)
    hidden = torch.randn(m, h, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = hidden.detach().clone().requires_grad_()
    out = rejected_k3(hidden, weight, tokens, teacher, chunk_rows=3, bias=bias, softcap=softcap)
    value, log_q, log_p = direct(ref, weight, bias, tokens, teacher, softcap)
    torch.testing.assert_close(out.value, value)
    torch.testing.assert_close(out.log_q, log_q.detach())
    torch.testing.assert_close(out.log_p, log_p)
    (w * out.value).sum().backward()
    (w * value).sum().backward()
    assert hidden.grad.abs().sum() > 0
    torch.testing.assert_close(hidden.grad, ref.grad)


def test_k3_is_zero_only_where_the_two_agree_and_positive_elsewhere():
    r = torch.tensor([-3.0, -0.5, 0.0, 0.5, 2.0])
    values = k3(r)
    assert values[2] == 0 and (values[[0, 1, 3, 4]] > 0).all()


def test_the_bounds_bind_where_draft_opd_puts_them_and_take_the_gradient_there():
    """Rows built to land on each side of each bound: the drafter far below the target on y
    (k3 over its cap), the drafter below the log-prob floor, the target below it, and a row
    inside: values and gradients equal autograd's clamps, and a bound row gets no gradient."""
    assert (LOG_PROB_FLOOR, K3_CAP) == (-10.0, 10.0)
    v, h = 5, 5
    weight = torch.eye(v, h, dtype=torch.float64)  # logits = hidden: each row sets its own
    bias = torch.zeros(v, dtype=torch.float64)
    tokens = torch.zeros(4, dtype=torch.long)
    drafter = torch.tensor(
        [[-4.0, 0, 0, 0, 0], [-14.0, 0, 0, 0, 0], [2.0, 0, 0, 0, 0], [0.5, 0, 0, 0, 0]],
        dtype=torch.float64,
    )
    teacher = torch.tensor(
        [[3.0, 0, 0, 0, 0], [3.0, 0, 0, 0, 0], [-14.0, 0, 0, 0, 0], [0.0, 0, 0, 0, 0]],
        dtype=torch.float64,
    )
    hidden = drafter.clone().requires_grad_()
    ref = drafter.clone().requires_grad_()
    out = rejected_k3(hidden, weight, tokens, teacher, chunk_rows=2, bias=bias)
    value, log_q, log_p = direct(ref, weight, bias, tokens, teacher, None)
    r = log_p.clamp(min=-10) - log_q.clamp(min=-10)
    raw = torch.exp(r) - 1 - r
    assert raw[0] > K3_CAP and log_q[1] < LOG_PROB_FLOOR and log_p[2] < LOG_PROB_FLOOR
    assert raw[3] < K3_CAP and log_q[3] > LOG_PROB_FLOOR and log_p[3] > LOG_PROB_FLOOR
    torch.testing.assert_close(out.value, value.detach())
    assert out.value[0] == K3_CAP and out.value[1] == K3_CAP  # both rows capped
    torch.testing.assert_close(out.log_q, log_q.detach())  # the raw log-probs are reported
    out.value.sum().backward()
    value.sum().backward()
    torch.testing.assert_close(hidden.grad, ref.grad)
    assert (hidden.grad[:2] == 0).all()  # the cap and the drafter's floor take the gradient
    # The target below the floor: r is taken from the floor, the drafter keeps a gradient that
    # lowers q(y) (the factor e^r - 1 is near -1: a CE-sized step away from y).
    assert hidden.grad[2, 0] > 0 and hidden.grad[3].abs().sum() > 0
