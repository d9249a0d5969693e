"""The distillation losses against sums written out by hand (math on python floats)."""
import math

import pytest
import torch

from bertdist.distill import losses
from bertdist.model import IGNORE_INDEX


def _softmax(xs, t=1.0):
    e = [math.exp(x / t) for x in xs]
    return [v / sum(e) for v in e]


def _kl(t_logits, s_logits, temp):
    p, q = _softmax(t_logits, temp), _softmax(s_logits, temp)
    return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q))


def _ce(logits, gold):
    return -math.log(_softmax(logits)[gold])


S = [[1.0, -0.5, 0.25], [0.3, 0.2, -1.0]]
T = [[2.0, 0.0, -1.0], [-0.5, 1.5, 0.5]]


def test_classification_loss_is_t2_kl_plus_alpha_ce_on_labelled_rows():
    temp, alpha = 2.0, 0.7
    gold = [2, IGNORE_INDEX]  # the second row is pseudo-labelled only
    got = losses.classification_loss(torch.tensor(S), torch.tensor(T), torch.tensor(gold), temp, alpha)
    kl = (_kl(T[0], S[0], temp) + _kl(T[1], S[1], temp)) / 2 * temp ** 2
    want = kl + alpha * _ce(S[0], 2)
    assert got.item() == pytest.approx(want, rel=1e-5)


def test_classification_loss_without_gold_rows_is_the_kl_alone():
    got = losses.classification_loss(torch.tensor(S), torch.tensor(T), torch.tensor([IGNORE_INDEX] * 2), 1.0, 0.5)
    want = (_kl(T[0], S[0], 1.0) + _kl(T[1], S[1], 1.0)) / 2
    assert got.item() == pytest.approx(want, rel=1e-5)


def test_kl_is_zero_when_student_equals_teacher_and_grows_with_t2():
    x = torch.tensor(T)
    assert losses.soft_kl(x, x, 3.0).item() == pytest.approx(0.0, abs=1e-7)
    # scaled by T^2: the same softened KL times 4 at T=2
    raw = (_kl(T[0], S[0], 2.0) + _kl(T[1], S[1], 2.0)) / 2
    assert losses.soft_kl(torch.tensor(S), x, 2.0).item() == pytest.approx(4 * raw, rel=1e-5)


def test_regression_loss_is_mse_to_teacher_plus_alpha_mse_to_gold_where_present():
    s, t, gold = [1.0, 2.0, 3.0], [1.5, 1.0, 3.0], [2.0, float("nan"), 2.0]
    got = losses.regression_loss(torch.tensor(s), torch.tensor(t), torch.tensor(gold), 0.5)
    mse_t = sum((a - b) ** 2 for a, b in zip(s, t)) / 3
    mse_g = ((1.0 - 2.0) ** 2 + (3.0 - 2.0) ** 2) / 2
    assert got.item() == pytest.approx(mse_t + 0.5 * mse_g, rel=1e-6)


def test_token_loss_averages_over_masked_tokens_only():
    temp, alpha = 2.0, 0.3
    st = torch.tensor([[S[0], S[1], [9.0, -9.0, 0.0]]])  # [1, 3, 3]; the third token is padding
    tt = torch.tensor([[T[0], T[1], [-9.0, 9.0, 0.0]]])
    mask = torch.tensor([[1, 1, 0]])
    gold = torch.tensor([[1, IGNORE_INDEX, IGNORE_INDEX]])
    got = losses.token_loss(st, tt, mask, gold, temp, alpha)
    want = (_kl(T[0], S[0], temp) + _kl(T[1], S[1], temp)) / 2 * temp ** 2 + alpha * _ce(S[0], 1)
    assert got.item() == pytest.approx(want, rel=1e-5)


def test_span_loss_softmaxes_over_real_positions_for_start_and_end():
    temp, alpha = 1.5, 0.5
    s_start, s_end = [0.1, 2.0, -1.0, 50.0], [1.0, 0.0, 0.5, -50.0]
    t_start, t_end = [0.5, 1.0, 0.0, -50.0], [0.0, 2.0, 1.0, 50.0]
    student = torch.tensor([list(zip(s_start, s_end))])  # [1, 4, 2]
    teacher = torch.tensor([list(zip(t_start, t_end))])
    mask = torch.tensor([[1, 1, 1, 0]])  # the last position is padding: its huge logits must not count
    got = losses.span_loss(student, teacher, mask, torch.tensor([1]), torch.tensor([2]), temp, alpha)
    kl = (_kl(t_start[:3], s_start[:3], temp) + _kl(t_end[:3], s_end[:3], temp)) / 2 * temp ** 2
    ce = (_ce(s_start[:3], 1) + _ce(s_end[:3], 2)) / 2
    assert got.item() == pytest.approx(kl + alpha * ce, rel=1e-5)


def test_default_layer_map_spreads_first_to_last():
    assert losses.default_layer_map(6, 12) == [0, 2, 4, 7, 9, 11]  # DistilBERT's layers
    assert losses.default_layer_map(3, 6) == [0, 2, 5]
    assert losses.default_layer_map(1, 4) == [3]
    with pytest.raises(ValueError, match="7 layers.*6"):
        losses.default_layer_map(7, 6)
    with pytest.raises(ValueError, match=r"teacher layers \[6\]"):
        losses.check_layer_map([0, 6], 2, 6)


def test_hidden_mse_projects_the_student_width_and_skips_padding():
    torch.manual_seed(0)
    proj = losses.HiddenProjection(2, 3)
    with torch.no_grad():
        proj.proj.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    s_h = [torch.tensor([[[1.0, 2.0], [100.0, 100.0]]])]  # [1, 2, 2]; token 2 is padding
    t_h = [torch.zeros(1, 2, 3), torch.tensor([[[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]])]
    got = losses.hidden_mse(s_h, t_h, [1], torch.tensor([[1, 0]]), proj)
    # projected student token: (1, 2, 3); teacher (1, 1, 1): squared errors 0, 1, 4 -> mean 5/3
    assert got.item() == pytest.approx(5 / 3, rel=1e-6)
    assert losses.HiddenProjection(4, 4).proj is None


def test_attention_kl_by_hand_on_one_head():
    a_t = torch.tensor([[[[0.5, 0.5], [0.9, 0.1]]]])  # [1, 1, 2, 2]
    a_s = torch.tensor([[[[0.25, 0.75], [0.1, 0.9]]]])
    got = losses.attention_kl([a_s], [a_t], [0], torch.tensor([[1, 0]]))  # only query row 0 is real
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert got.item() == pytest.approx(want, rel=1e-5)
