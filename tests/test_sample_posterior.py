"""Samples-only posteriors (``cl.SamplePosterior``) and the density-free distance rank.

What must hold: the distance rank is exactly uniform when the draws and the truth are
i.i.d. (any distribution, any small ``M``); on the exact posterior of ``GaussianToy``
wrapped as a samples-only callable, the rank check and TARP keep their level over fresh
data sets, and an over- and an under-confident posterior are rejected with the right sign;
L-C2ST, recovery, the reference distances, shared draws and the rank and TARP callbacks
work on it; the checks that need a density, a score or latents raise a ValueError naming
the missing capability, and ``cl.diagnose`` skips them with that reason.
"""

from __future__ import annotations

import pytest
import torch

import calib_lightning as cl
from calib_lightning.evaluation import draw_chunks, draws
from calib_lightning.evaluation._draw_cache import SharedDraws
from calib_lightning.functional import (
    compare_to_reference,
    distance_log_prob,
    rank_calibration,
    rank_histogram,
    recovery,
    sbc_ranks,
    uniformity_test,
)
from calib_lightning.posteriors import SbiPosterior, supports
from calib_lightning.tasks import GaussianToy

TOY = GaussianToy(dim=2)


def _samples_only(variance_scale: float = 1.0) -> cl.SamplePosterior:
    exact = TOY.posterior(variance_scale=variance_scale)
    return cl.SamplePosterior(lambda x, num_samples: exact(x).sample((num_samples,)))


def test_distance_rank_is_exactly_uniform_for_iid_draws_of_any_distribution():
    g = torch.Generator().manual_seed(0)
    m, n, d = 4, 100_000, 3  # small M, a skewed and correlated distribution
    points = torch.empty(m + 1, n, d).exponential_(generator=g)
    points[..., 1] += points[..., 0]
    t_samples, t_theta = distance_log_prob(points[1:], points[0])
    ranks = (t_samples > t_theta).sum(0)
    counts = torch.bincount(ranks, minlength=m + 1).double()
    expected = n / (m + 1)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5  # chi-square(4) 0.999 quantile: 18.47


def test_distance_rank_of_an_over_dispersed_truth_is_high():
    g = torch.Generator().manual_seed(1)
    samples = torch.randn(20, 2000, 2, generator=g)
    t_samples, t_theta = distance_log_prob(samples, 2.0 * torch.randn(2000, 2, generator=g))
    assert (t_samples > t_theta).sum(0).double().mean() > 15  # uniform would give 10


def test_distance_log_prob_checks_shapes():
    with pytest.raises(ValueError, match=r"samples must have shape \(M, \*theta.shape\)"):
        distance_log_prob(torch.zeros(5, 3, 2), torch.zeros(4, 2))


def test_functional_rank_calibration_without_log_probs_uses_the_distance_rank():
    g = torch.Generator().manual_seed(2)
    theta = torch.randn(300, 2, generator=g)
    samples = torch.randn(50, 300, 2, generator=g)
    out = rank_calibration(samples, None, theta, None, generator=g)
    assert out.joint_statistic == "distance"
    assert float(out.global_p_value) > 0.01
    ranks = sbc_ranks(samples, None, theta, None, generator=g)
    assert ranks.shape == (300, 3)
    p_joint = uniformity_test(rank_histogram(ranks, 50)[-1], num_bins=10)[0]
    assert float(p_joint) > 0.01


def test_rank_check_and_tarp_keep_their_level_on_the_exact_posterior_sampled_only():
    torch.manual_seed(0)  # posterior sampling uses the global generator
    rejected = {"ranks": 0, "joint": 0, "tarp": 0}
    sets = 40
    for seed in range(sets):
        theta, x = TOY.sample(200, torch.Generator().manual_seed(100 + seed))
        ranks = cl.RankCalibration(num_posterior_samples=49)
        ranks.update(_samples_only(), theta, x)
        out = ranks.compute()
        tarp = cl.TARP(num_posterior_samples=49, seed=seed)
        tarp.update(_samples_only(), theta, x)
        rejected["ranks"] += bool(out.global_p_value < 0.05)
        rejected["joint"] += bool(out.p_value < 0.05)
        rejected["tarp"] += bool(tarp.compute().p_value < 0.05)
        assert out.joint_statistic == "distance"
    # Binomial(40, 0.05): P(X > 6) = 0.014
    assert all(count <= 6 for count in rejected.values()), rejected


@pytest.mark.parametrize(("variance_scale", "sign"), [(0.5, -1.0), (2.0, 1.0)])
def test_over_and_under_confident_posteriors_are_rejected_with_the_right_sign(
    variance_scale, sign
):
    torch.manual_seed(3)
    theta, x = TOY.sample(500, torch.Generator().manual_seed(3))
    ranks = cl.RankCalibration(num_posterior_samples=99)
    ranks.update(_samples_only(variance_scale), theta, x)
    out = ranks.compute()
    assert float(out.global_p_value) < 1e-6
    assert float(out.p_value) < 1e-3  # the distance rank alone sees it
    assert float(out.coverage_error) * sign > 0.05  # negative = over-confident
    tarp = cl.TARP(num_posterior_samples=99)
    tarp.update(_samples_only(variance_scale), theta, x)
    result = tarp.compute()
    assert float(result.p_value) < 0.01
    assert float(result.coverage_error) * sign > 0


def test_checks_that_need_a_density_score_or_latents_say_which_capability_is_missing():
    post = _samples_only()
    theta, x = TOY.sample(20, torch.Generator().manual_seed(4))
    assert supports(post, "sample")
    assert not supports(post, "log_prob")
    for method, missing in [(post.log_prob, "log_prob"), (post.to_latent, "to_latent"),
                            (post.score, "score"), (post.log_prob_and_latent, "log_prob")]:
        with pytest.raises(ValueError, match=f"SamplePosterior does not provide {missing}"):
            method(theta, x)
    with pytest.raises(ValueError, match="does not provide log_prob, which KCCSD"):
        post.sample_and_log_prob(x, 3)
    metrics = [(cl.KCCSD(), "score, which KCCSD"),
               (cl.LatentCalibration(), "to_latent, which LatentCalibration"),
               (cl.LC2STNF(observations=x[:2]), "to_latent, which LatentCalibration, LC2STNF")]
    for metric, message in metrics:
        with pytest.raises(ValueError, match=message):
            metric.update(post, theta, x)
    with pytest.raises(ValueError, match="SamplePosterior does not provide"):
        cl.KCCSDLoss()(post, theta, x)


def test_as_posterior_keeps_it_and_bad_callables_or_draws_are_refused():
    post = _samples_only()
    assert cl.as_posterior(post) is post
    x = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="fn must be a callable"):
        cl.SamplePosterior(3)
    with pytest.raises(ValueError, match="num_dims must be a positive integer"):
        cl.SamplePosterior(lambda x, s: x, num_dims=0)
    with pytest.raises(ValueError, match=r"\(S, N, D\) with \(S, N\) = \(3, 4\), got \(4, 2\)"):
        cl.SamplePosterior(lambda x, s: x).sample(x, 3)
    with pytest.raises(ValueError, match=r"floating draws, got torch\.int64"):
        cl.SamplePosterior(lambda x, s: torch.zeros(s, 4, 2, dtype=torch.long)).sample(x, 3)
    with pytest.raises(ValueError, match="D = num_dims = 3 columns"):
        cl.SamplePosterior(lambda x, s: torch.zeros(s, 4, 2), num_dims=3).sample(x, 3)
    with pytest.raises(ValueError, match="num_posterior_samples"):
        post.sample(x, 0)
    with pytest.raises(ValueError, match=r"x must have shape \(N, X\)"):
        post.sample(torch.zeros(4), 3)


def test_draws_come_back_in_the_dtype_of_x():
    post = _samples_only()
    assert post.sample(torch.zeros(3, 2, dtype=torch.float64), 2).dtype == torch.float64
    assert post.sample(torch.zeros(3, 2, dtype=torch.long), 2).dtype == torch.float32


def test_one_rank_metric_does_not_mix_energy_and_distance_ranks():
    theta, x = TOY.sample(50, torch.Generator().manual_seed(5))
    metric = cl.RankCalibration(num_posterior_samples=9)
    metric.update(TOY.posterior(), theta, x)
    assert metric.compute().joint_statistic == "energy"
    with pytest.raises(ValueError, match="holds energy ranks; this posterior gives distance"):
        metric.update(_samples_only(), theta, x)
    metric.reset()
    metric.update(_samples_only(), theta, x)
    assert metric.compute().joint_statistic == "distance"


def test_the_joint_rank_can_be_chosen_and_energy_needs_a_log_prob():
    theta, x = TOY.sample(50, torch.Generator().manual_seed(5))
    metric = cl.RankCalibration(num_posterior_samples=9, joint="distance")
    metric.update(TOY.posterior(), theta, x)  # a density, ranked by distance as asked
    metric.update(_samples_only(), theta, x)  # one kind of rank: they mix
    assert metric.compute().joint_statistic == "distance"
    with pytest.raises(ValueError, match="does not provide log_prob"):
        cl.RankCalibration(num_posterior_samples=9, joint="energy").update(
            _samples_only(), theta, x)  # fmt: skip
    with pytest.raises(ValueError, match="joint must be one of"):
        cl.RankCalibration(joint="surprisal")


def test_chunks_hold_every_draw_of_a_pair_and_no_log_probs():
    theta, x = TOY.sample(30, torch.Generator().manual_seed(6))
    chunks = list(draw_chunks(_samples_only(), theta, x, 40, max_chunk_elements=200))
    assert all(c.log_prob is None and c.log_prob_theta is None for c in chunks)
    assert all(c.first_draw == 0 and c.samples.shape == (40, c.theta.shape[0], 2) for c in chunks)
    assert sum(c.theta.shape[0] for c in chunks) == 30


def test_shared_draws_serve_samples_only_posteriors():
    torch.manual_seed(7)
    theta, x = TOY.sample(40, torch.Generator().manual_seed(7))
    shared = SharedDraws(_samples_only())
    assert not supports(shared, "log_prob")
    first = torch.cat([c.samples for c in draw_chunks(shared, theta, x, 20)], 1)
    again = list(draw_chunks(shared, theta, x, 20, max_chunk_elements=100))
    assert all(c.log_prob is None and c.first_draw == 0 for c in again)
    assert torch.equal(torch.cat([c.samples for c in again], 1), first)
    more = draws(shared, x, 30)  # ten more drawn, the first twenty served
    assert torch.equal(more[:20], first)
    assert shared.drawn == 30 * 40
    rows = list(draw_chunks(shared, theta[:10], x[:10], 30))
    assert rows[0].log_prob is None
    assert torch.equal(rows[0].samples, more[:, :10])


def test_lc2st_recovery_and_reference_distances_run_on_samples_only():
    torch.manual_seed(8)
    theta, x = TOY.sample(300, torch.Generator().manual_seed(8))
    post, x_o = _samples_only(), x[:2]
    metric = cl.LC2ST(observations=x_o, num_null=5, num_posterior_samples=200)
    metric.update(post, theta, x)
    out = metric.compute()
    assert out.p_value.shape == (2,)
    assert bool(((out.p_value > 0) & (out.p_value <= 1)).all())
    samples = draws(post, x, 100)
    assert recovery(samples, theta).z_scores.shape == (300, 2)
    reference = TOY.posterior()(x_o).sample((200,))
    compared = compare_to_reference(draws(post, x_o, 200), reference, vendi=False)
    assert float(compared.mmd_p_value.min()) > 0.001


def test_other_adapters_declare_every_capability():
    assert supports(cl.as_posterior(TOY.posterior()), "to_latent")
    assert SbiPosterior.capabilities == frozenset({"sample", "log_prob", "score", "to_latent"})
    with pytest.raises(ValueError, match="capability must be one of"):
        supports(cl.as_posterior(TOY.posterior()), "density")


def test_diagnose_runs_what_a_sampler_supports_and_lists_the_skipped_checks(tmp_path):
    theta, x = TOY.sample(300, torch.Generator().manual_seed(9))
    x_o = TOY.sample(2, torch.Generator().manual_seed(10))[1]
    reference = TOY.posterior()(x_o).sample((100,))
    report = cl.diagnose(_samples_only(), theta, x, observations=x_o,
                         reference_samples=reference, seed=0)
    assert set(report.checks) == {"ranks", "tarp", "joint_c2st", "recovery", "lc2st",
                                 "misspecification", "reference"}  # fmt: skip
    assert report.checks["lc2st"].p_value.shape == (2,)  # in L-C2ST-NF's place
    assert report.checks["ranks"].joint_statistic == "distance"
    assert set(report.skipped) == {"kccsd", "lc2st_nf"}
    assert "does not provide score" in report.skipped["kccsd"]
    assert "does not provide to_latent" in report.skipped["lc2st_nf"]
    assert report.verdict.startswith("calibrated")
    table = report.table()
    assert "skipped kccsd: SamplePosterior does not provide score" in table
    report.save(tmp_path)
    html = (tmp_path / "report.html").read_text()
    assert "skipped: SamplePosterior does not provide to_latent" in html
    again = cl.diagnose(_samples_only(), theta, x, observations=x_o,
                        reference_samples=reference, seed=0)
    assert again.table() == table  # seeded: the sampler's draws too


def test_diagnose_skips_a_requested_check_instead_of_failing():
    theta, x = TOY.sample(200, torch.Generator().manual_seed(11))
    report = cl.diagnose(_samples_only(0.5), theta, x, checks=("kccsd", "ranks"), seed=0)
    assert list(report.checks) == ["ranks"]
    assert list(report.skipped) == ["kccsd"]
    assert report.verdict.startswith("miscalibrated: over-confident")  # the distance rank


class _Sampler(torch.nn.Module):
    """A LightningModule's samples-only estimator: draws from the toy's posterior moved by a
    trained shift, counting its calls."""

    def __init__(self):
        super().__init__()
        self.shift = torch.nn.Parameter(torch.zeros(()))
        self.calls: list[tuple[int, int]] = []

    def forward(self, x, num_samples):
        self.calls.append((x.shape[0], num_samples))
        return TOY.posterior(shift=float(self.shift))(x).sample((num_samples,))


def test_rank_and_tarp_callbacks_share_a_samplers_draws(tmp_path, monkeypatch):
    """The estimator attribute holds the SamplePosterior: the draws are shared by object."""
    monkeypatch.chdir(tmp_path)  # the callbacks write their figures to the working directory
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from calib_lightning.callbacks import RankCalibrationCallback, TARPCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.sampler = _Sampler()
            self.posterior = cl.SamplePosterior(self.sampler)

        def training_step(self, batch, batch_idx):
            return (self.sampler.shift - 1.0) ** 2

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    theta, x = TOY.sample(100, torch.Generator().manual_seed(12))
    estimator = "posterior"
    callbacks = [
        RankCalibrationCallback(theta, x, metric=cl.RankCalibration(20), estimator=estimator),
        TARPCallback(theta, x, metric=cl.TARP(20, num_null=100), estimator=estimator),
    ]
    train = DataLoader(TensorDataset(theta, x), batch_size=100)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=callbacks)  # fmt: skip
    module = Module()
    trainer.fit(module, train)
    for callback in callbacks:
        assert callback.epochs == [0, 1]
        assert not callback.errors
    assert callbacks[0].last_result.joint_statistic == "distance"
    # fit's setup check draws once at two pairs per callback; then one pass per epoch (in
    # chunks sized from the memory budget: the first a probe of at most 256 draws)
    calls = module.sampler.calls
    assert calls[:2] == [(2, 1), (2, 1)]
    assert {draws for _, draws in calls[2:]} == {20}
    assert sum(rows for rows, _ in calls[2:]) == 2 * 100  # one pass per epoch
