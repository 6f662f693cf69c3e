"""The rejected-draft stream's k3 term against a direct implementation (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.model.target import soft_cap
from dflash_train.opd_loss import k3, rejected_k3


def direct(hidden, weight, bias, tokens, teacher, softcap):
    """exp(r) - 1 - r, r = log p(y) - log q(y), with full-vocabulary log-softmaxes."""
    log_q = torch.log_softmax(hidden @ weight.T + bias, -1).gather(1, tokens[:, None])[:, 0]
    t = soft_cap(teacher @ weight.T + bias, softcap)
    log_p = torch.log_softmax(t, -1).gather(1, tokens[:, None])[:, 0]
    r = log_p - log_q
    return torch.exp(r) - 1 - r, log_q, log_p


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
