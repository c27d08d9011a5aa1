"""Misspecification test: exact level on simulator outputs, power, hand-counted p-values.

Level: ``misspecification_test`` with its default arguments and seed, called once per
observation with a fresh simulated set each time, rejects observations drawn from the
simulator at 0.05 at a rate inside the 99 % binomial band (two simulators: Two Moons
``(N, 2)`` and blob images ``(N, 1, 8, 8)``). Power: observations shifted by several
standard deviations are rejected at >= 0.95.
"""

import math

import pytest
import torch
from matplotlib.figure import Figure
from scipy import stats
from torch import nn

import calib_lightning as cl
from calib_lightning.functional import (
    combine_p_values,
    conformal_p_value,
    knn_distance,
    misspecification_scores,
    standardization,
)
from calib_lightning.plots import plot_misspecification
from calib_lightning.tasks import GaussianToy, TwoMoons

F64 = torch.float64
REPS = 200
LEVEL = 0.05


def gen(seed):
    return torch.Generator().manual_seed(seed)


def blob_images(n, generator):
    """A Gaussian bump at a random position on an 8 x 8 grid plus noise: ``(n, 1, 8, 8)``."""
    center = 1.0 + 5.0 * torch.rand(n, 2, 1, 1, generator=generator)
    grid = torch.arange(8.0)
    bump = torch.exp(-((grid[:, None] - center[:, 0]) ** 2 + (grid - center[:, 1]) ** 2) / 4)
    return (bump + 0.1 * torch.randn(n, 8, 8, generator=generator))[:, None]


def band(reps=REPS, level=LEVEL):
    return stats.binom.ppf([0.005, 0.995], reps, level) / reps


def rejection_rate(simulate, num_simulations, seed):
    """Share of ``REPS`` simulator outputs rejected, each tested against fresh simulations."""
    g = gen(seed)
    p = [cl.misspecification_test(simulate(1, g), simulate(num_simulations, g)).p_value
         for _ in range(REPS)]  # fmt: skip
    return float((torch.cat(p) < LEVEL).double().mean())


def test_level_two_moons():
    moons = TwoMoons()
    rate = rejection_rate(lambda n, g: moons.sample(n, g)[1], 600, seed=0)
    low, high = band()
    assert low <= rate <= high, rate


def test_level_images():
    rate = rejection_rate(blob_images, 300, seed=1)
    low, high = band()
    assert low <= rate <= high, rate


def test_level_exact_at_every_level_vectorized():
    """4000 fresh (simulations, observation) sets at once through the functional core:
    P(p <= j / (n + 1)) = j / (n + 1) for every j, inside a 99 % binomial band."""
    reps, n = 4000, 99
    g = gen(2)
    x = GaussianToy(dim=3).sample(reps * (2 * n + 1), g)[1].reshape(reps, 2 * n + 1, 3)
    score, calibration = misspecification_scores(x[:, :1], x[:, 1 : n + 1], x[:, n + 1 :])
    p = conformal_p_value(score, calibration)[:, 0]
    for j in (1, 5, 10, 50, 90):
        rate = float((p <= j / (n + 1) + 1e-9).double().mean())
        low, high = stats.binom.ppf([0.005, 0.995], reps, j / (n + 1)) / reps
        assert low <= rate <= high, (j, rate)


def test_power_against_shifted_observations():
    g = gen(3)
    toy = GaussianToy(dim=2)
    std = math.sqrt(1 + toy.noise_std**2)
    p = []
    for _ in range(20):  # 20 fresh simulated sets, 10 observations each
        x_o = toy.sample(10, g)[1] + torch.tensor([5 * std, 0.0])
        p.append(cl.misspecification_test(x_o, toy.sample(600, g)[1]).p_value)
    assert float((torch.cat(p) < LEVEL).double().mean()) >= 0.95


def test_power_images_and_time_series():
    g = gen(4)
    result = cl.misspecification_test(blob_images(50, g) + 0.5, blob_images(600, g))
    assert float((result.p_value < LEVEL).double().mean()) >= 0.95
    walk = torch.randn(650, 32, generator=g).cumsum(-1) / 4  # time series (N, T)
    spiked = walk[600:].clone()
    spiked[:, 16] += 8.0
    result = cl.misspecification_test(torch.cat([walk[600:], spiked]), walk[:600])
    assert float((result.p_value[50:] < LEVEL).double().mean()) >= 0.95
    assert float((result.p_value[:50] < LEVEL).double().mean()) <= 0.2
    assert float(result.global_p_value) < LEVEL


def test_closed_form_hand_counted():
    fit = torch.tensor([[0.0], [2.0]], dtype=F64)  # mean 1, std 1: standardized -1, 1
    calibration = torch.tensor([[1.0], [3.0], [6.0]], dtype=F64)  # standardized 0, 2, 5
    observations = torch.tensor([[4.0], [1.0], [9.0], [3.0]], dtype=F64)  # 3, 0, 8, 2
    score, cal = misspecification_scores(observations, fit, calibration, k=1)
    torch.testing.assert_close(cal, torch.tensor([1.0, 1.0, 4.0], dtype=F64))
    torch.testing.assert_close(score, torch.tensor([2.0, 1.0, 7.0, 1.0], dtype=F64))
    # p = (1 + #{cal >= score}) / 4; ties with the calibration scores count against x_o
    p = conformal_p_value(score, cal)
    torch.testing.assert_close(p, torch.tensor([2 / 4, 4 / 4, 1 / 4, 4 / 4], dtype=F64))
    score2, cal2 = misspecification_scores(observations, fit, calibration, k=2)
    torch.testing.assert_close(cal2, torch.tensor([1.0, 3.0, 6.0], dtype=F64))
    torch.testing.assert_close(score2, torch.tensor([4.0, 1.0, 9.0, 3.0], dtype=F64))
    mean, scale = standardization(torch.tensor([[1.0, 5.0], [3.0, 5.0]]))
    torch.testing.assert_close(scale, torch.tensor([[1.0, 1.0]]))  # constant feature: 1
    torch.testing.assert_close(mean, torch.tensor([[2.0, 5.0]]))


def test_knn_distance_matches_sorting_and_is_block_invariant():
    g = gen(5)
    points, reference = torch.randn(2, 37, 4, generator=g), torch.randn(2, 23, 4, generator=g)
    naive = (points[:, :, None] - reference[:, None]).norm(dim=-1).sort(-1).values[..., 6]
    torch.testing.assert_close(knn_distance(points, reference, k=7), naive)
    assert torch.equal(knn_distance(points, reference, 7, block_size=5),
                       knn_distance(points, reference, 7, block_size=1000))  # fmt: skip


def test_result_fields_and_p_value_range():
    g = gen(6)
    x = TwoMoons().sample(400, g)[1]
    x_o = torch.cat([TwoMoons().sample(5, g)[1], torch.tensor([[9.0, 9.0], [0.0, 0.0]])])
    result = cl.misspecification_test(x_o, x)
    n = result.num_calibration
    assert (result.num_simulations, result.num_fit, n, result.k) == (400, 200, 200, 5)
    assert result.p_value.shape == result.score.shape == (7,)
    assert result.calibration_scores.shape == (n,)
    assert result.global_p_value.shape == ()
    assert bool((result.p_value >= 1 / (1 + n)).all() and (result.p_value <= 1).all())
    assert float(result.p_value[5]) == 1 / (1 + n)  # far outside: the smallest p-value
    counted = (1 + (result.calibration_scores >= result.score[:, None]).sum(-1)) / (1 + n)
    torch.testing.assert_close(result.p_value, counted.double())
    torch.testing.assert_close(result.global_p_value, combine_p_values(result.p_value))
    holm = cl.misspecification_test(x_o, x, global_method="holm").global_p_value
    torch.testing.assert_close(holm, (7 * result.p_value.min()).clamp(max=1))
    single = cl.misspecification_test(x_o[:1], x)
    assert float(single.global_p_value) == float(single.p_value[0]) == float(result.p_value[0])
    assert set(result.scalars()) == {"global_p_value", *(f"p_value/{i}" for i in range(7))}
    assert type(result).verdict == "global_p_value"
    assert not torch.equal(cl.misspecification_test(x_o, x, seed=1).calibration_scores,
                           result.calibration_scores)  # fmt: skip


def test_identity_embedding_equals_raw_path():
    g = gen(7)
    x, x_o = blob_images(300, g), blob_images(4, g) + 0.3
    raw = cl.misspecification_test(x_o, x)
    for embedding in (nn.Identity(), lambda v: v.flatten(1)):
        embedded = cl.misspecification_test(x_o, x, embedding, batch_size=64)
        assert torch.equal(embedded.p_value, raw.p_value)
        assert torch.equal(embedded.calibration_scores, raw.calibration_scores)


def test_module_embedding_runs_in_eval_mode_without_gradients():
    g = gen(8)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten())
    x, x_o = blob_images(200, g), blob_images(3, g)
    net[1].eval()  # a frozen batch norm inside a training model
    first = cl.misspecification_test(x_o, x, net, batch_size=7)
    assert [m.training for m in net] == [True, False, True]  # every mode restored
    # eval mode: a point's features do not depend on its batch
    assert torch.equal(first.p_value, cl.misspecification_test(x_o, x, net).p_value)
    assert not first.calibration_scores.requires_grad


def test_integer_simulations_are_cast():
    g = gen(9)
    counts = torch.poisson(torch.full((300, 3), 4.0), generator=g).long()
    result = cl.misspecification_test(counts[:2], counts[2:])
    assert result.score.dtype == torch.get_default_dtype()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"observations": torch.zeros(2, 3)}, r"observations must have shape \(O, \*X\) = \(O, 2"),
        ({"observations": torch.zeros(2)}, r"observations must have shape \(O, \*X\)"),
        ({"x": torch.zeros(100)}, r"x must have shape \(N, \*X\)"),
        ({"x": torch.zeros(9, 2)}, r"x must hold enough simulations .* got N = 9 \(4 fit"),
        ({"x": torch.zeros(100, 2).index_fill(0, torch.tensor([3]), math.nan)},
         r"x must be finite, got 2 NaN/inf entries in 1 of 100 rows"),
        ({"observations": torch.tensor([[0.0, math.inf]])}, r"observations must be finite"),
        ({"embedding": lambda v: v[:1]}, r"embedding must map x of shape \(n, \*X\) to .* n = 100"),
        ({"embedding": lambda v: v * math.nan}, r"embedding\(x\) must be finite"),
        ({"fit_fraction": 1.0}, r"fit_fraction must lie in \(0, 1\), got 1.0"),
        ({"k": 0}, r"k must be a positive integer, got 0"),
        ({"global_method": "fisher"}, r"global_method must be one of"),
    ],
)  # fmt: skip
def test_input_errors(kwargs, match):
    arguments = {"observations": torch.zeros(1, 2), "x": torch.randn(100, 2, generator=gen(0))}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=match):
        cl.misspecification_test(**arguments)


def test_functional_input_errors():
    with pytest.raises(ValueError, match=r"reference must have at least 5 points"):
        knn_distance(torch.zeros(3, 2), torch.zeros(4, 2), k=5)
    with pytest.raises(ValueError, match=r"observations must have shape \(\*, N, 2\)"):
        misspecification_scores(torch.zeros(3, 3), torch.zeros(6, 2), torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"calibration_scores \(\*, n\) with n >= 1"):
        conformal_p_value(torch.zeros(3), torch.zeros(0))


def test_plot_marks_each_observation_and_switches_to_log_axis():
    g = gen(10)
    toy = GaussianToy(dim=2)
    x = toy.sample(400, g)[1]
    near = cl.misspecification_test(toy.sample(3, g)[1], x)
    fig = plot_misspecification(near)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert ax.get_xscale() == "linear"
    assert len(ax.get_lines()) == 3
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(label.startswith("$x_o$ 0: conformal p = ") for label in labels)
    far = cl.misspecification_test(torch.tensor([[0.0, 0.0], [40.0, 40.0]]), x)
    ax = plot_misspecification(far, max_legend=1).axes[0]
    assert ax.get_xscale() == "log"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(label.startswith("$x_o$ 1: conformal p = ") for label in labels)  # smallest p
    assert not any(label.startswith("$x_o$ 0") for label in labels)
    assert any("1 more" in label for label in labels)
    with pytest.raises(ValueError, match="result must contain 'score'"):
        plot_misspecification({"p_value": torch.zeros(1)})


def test_at_30_simulations_it_says_it_cannot_reject():
    """N = 30: 15 calibration simulations, smallest p-value 1/16 > 0.05, even for an
    observation 10 standard deviations away. The result, the table and the sentence say
    so instead of "not rejected"; at N = 400 the same observation is rejected."""
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(30, gen(0))
    far = torch.tensor([[0.0, 0.0], [10.0, 10.0]])
    result = cl.misspecification_test(far, x)
    assert result.smallest_p_value == 1 / 16 == float(result.p_value[1])
    assert not result.can_reject(LEVEL)
    assert result.can_reject(0.1)
    report = cl.diagnose(toy.posterior(), theta, x, observations=far,
                         checks=("misspecification",))  # fmt: skip
    row = report.rows()[0]
    assert row["verdict"] == "cannot reject at this size (smallest p 0.12)"  # 2 x 1/16, Holm
    assert "cannot reject" in report.table()
    assert ("the misspecification test cannot reject with 30 simulations (15 for calibration) "
            "and 2 observations: smallest p-value 1/16 = 0.062, 0.12 after Holm's correction"
            ) in report.verdict  # fmt: skip
    theta, x = toy.sample(400, gen(0))
    report = cl.diagnose(toy.posterior(), theta, x, observations=far,
                         checks=("misspecification",))  # fmt: skip
    assert report.rows()[0]["verdict"] == "rejected"
    assert "observation 1 looks outside the simulator" in report.verdict
    assert cl.misspecification_test(far, x).can_reject(LEVEL, holm=True)
