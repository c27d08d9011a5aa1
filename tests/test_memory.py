"""The memory budget of the chunked checks, and the callbacks' warning on an expensive check.

What must hold: a bad budget is a ``ValueError`` naming it; ``set_memory_budget`` sets the
budget and, as a context manager, restores it; every sampling call of a check stays within
the budget at its measured peak, a smaller budget makes more calls, and the chunks add up
to the unchunked computation (identical ranks, TARP histogram and latents under a fixed
seed); a callback whose check costs much of an epoch warns once with both numbers.
"""

from __future__ import annotations

import time
import warnings

import lightning as L
import pytest
import torch
import zuko
from torch.utils.data import DataLoader, TensorDataset

import calib_lightning as cl
from calib_lightning.callbacks import CalibrationCallback
from calib_lightning.evaluation import base_scores, draws, latents, scores
from calib_lightning.evaluation._memory import (
    PROBE_MARGIN,
    ChunkSizer,
    TensorPeak,
    draw_blocks,
    measure_peak,
)
from calib_lightning.posteriors import Posterior
from calib_lightning.tasks import GaussianToy

MiB = 2**20


@pytest.mark.parametrize("bad", [0, -1, 1000, 2**20 - 1, 1.5e8, True, "256MB", None])
def test_a_bad_budget_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match=r"memory budget must be an int number of bytes"):
        cl.set_memory_budget(bad)
    if bad is not None:  # None: the sizer takes the global budget
        with pytest.raises(ValueError, match=r"memory budget must be"):
            ChunkSizer(budget=bad)
    assert cl.get_memory_budget() == 256 * MiB  # unchanged


def test_set_memory_budget_sets_it_and_restores_it_as_a_context():
    with cl.set_memory_budget(8 * MiB):
        assert cl.get_memory_budget() == 8 * MiB
        assert ChunkSizer().budget == 8 * MiB
    assert cl.get_memory_budget() == 256 * MiB
    cl.set_memory_budget(32 * MiB)  # as a plain call: stays
    try:
        assert cl.get_memory_budget() == 32 * MiB
    finally:
        cl.set_memory_budget(256 * MiB)


def test_draw_blocks_cover_every_draw_of_every_pair_once():
    for budget_units, n, m, whole in [(1, 7, 5, False), (3, 7, 5, False), (12, 7, 5, False),
                                      (3, 7, 5, True), (10**6, 7, 5, False)]:  # fmt: skip
        sizer = ChunkSizer(fixed_units=budget_units)
        seen = torch.zeros(m, n, dtype=torch.long)
        for rows, first, count in draw_blocks(n, m, sizer, whole_pairs=whole):
            seen[first : first + count, rows] += 1
            assert (rows.stop - rows.start) * count <= max(budget_units, m if whole else 1)
        assert bool((seen == 1).all())


class FakeAllocator:
    """``torch.cuda``'s allocator statistics for a device that is not there: the test
    allocates and frees bytes by hand."""

    def __init__(self, monkeypatch):
        self.now = self.peak = 0
        for name, fn in [("synchronize", lambda device=None: None),
                         ("memory_allocated", lambda device=None: self.now),
                         ("max_memory_allocated", lambda device=None: self.peak),
                         ("reset_peak_memory_stats", self.reset)]:  # fmt: skip
            monkeypatch.setattr(torch.cuda, name, fn)

    def reset(self, device=None):
        self.peak = self.now

    def allocate(self, nbytes):
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def free(self, nbytes):
        self.now -= nbytes


def test_on_cuda_a_chunk_is_sized_by_its_peak_with_the_work_done_on_it(monkeypatch):
    """Sampling peaks at 2 MiB per unit, then the caller scores the chunk with 1 MiB per
    unit more on top of the 1 MiB per unit of draws it keeps: 2 MiB per unit in all, which
    the next chunk's size must reflect (it read 1 MiB before: the draws only)."""
    cuda = FakeAllocator(monkeypatch)
    sizer = ChunkSizer(torch.device("cuda"), budget=64 * MiB, probe_units=4)
    sizes = []

    def chunk(units):
        cuda.allocate(2 * units * MiB)  # the sampler's intermediates
        cuda.free(units * MiB)  # ... freed, the draws returned
        return units

    for _ in range(4):
        units = sizer.size(1000)
        sizes.append(units)
        sizer.run(units, lambda u=units: chunk(u))
        cuda.allocate(units * MiB)  # the caller's work on the draws
        cuda.free(2 * units * MiB)  # ... and the draws, freed
    assert sizes[0] == 4
    assert sizes[1] == 32  # the probe's own peak said 2 MiB per unit
    assert sizes[2] == 32  # the probe with its caller's work also peaks at 2 MiB per unit
    assert sizer.per_unit == 2 * MiB
    cuda.allocate(0)
    heavy = ChunkSizer(torch.device("cuda"), budget=64 * MiB, probe_units=4)
    units = heavy.size(1000)
    heavy.run(units, lambda: chunk(units))
    cuda.allocate(3 * units * MiB)  # heavier work on the draws: 4 MiB per unit at its peak
    cuda.free(4 * units * MiB)
    assert heavy.size(1000) == 16  # 64 MiB / 4 MiB: the chunk's own peak would give 32


def test_on_cuda_an_output_kept_after_the_probe_is_not_a_cost_per_unit(monkeypatch):
    """The caller allocates, after the probe, the output it fills chunk by chunk (TARP's
    draws) and keeps it: it comes off the budget once, and the later chunks are sized by
    the probe's 2 MiB per unit. Read as the probe's own cost (the peak since the probe
    began, 16 MiB over 4 units) it was 4 MiB per unit here, and on an H200 it made TARP's
    chunks one pair each, 20-30x slower than one call."""
    cuda = FakeAllocator(monkeypatch)
    for kept in (True, False):
        sizer = ChunkSizer(torch.device("cuda"), budget=64 * MiB, probe_units=4)
        units = sizer.size(1000)
        sizer.run(units, lambda u=units: cuda.allocate(2 * u * MiB))  # the probe: 8 MiB
        cuda.free(2 * units * MiB)
        cuda.allocate(16 * MiB)  # the output, kept until the check ends
        if kept:
            sizer.keep(16 * MiB)
            assert sizer.size(1000) == (64 - 16) // 2
            assert sizer.per_unit == 2 * MiB
        else:  # the output not declared: a cost per unit, as before the fix for all
            assert sizer.size(1000) == 64 // 4
        cuda.free(16 * MiB)


class Recording(Posterior):
    """A posterior that records the peak tensor memory and the size of each sampling call."""

    def __init__(self, posterior):
        self.inner = cl.as_posterior(posterior)
        super().__init__(self.inner.module)
        self.calls: list[tuple[int, int, int]] = []  # (rows, draws, peak bytes)

    @property
    def capabilities(self):
        return self.inner.capabilities

    def _record(self, method, x, num_posterior_samples):
        out, peak = measure_peak(lambda: method(x, num_posterior_samples))
        self.calls.append((x.shape[0], num_posterior_samples, peak))
        return out

    def sample(self, x, num_posterior_samples):
        return self._record(self.inner.sample, x, num_posterior_samples)

    def sample_and_log_prob(self, x, num_posterior_samples):
        return self._record(self.inner.sample_and_log_prob, x, num_posterior_samples)

    def log_prob(self, theta, x):
        return self.inner.log_prob(theta, x)

    def to_latent(self, theta, x):
        return self.inner.to_latent(theta, x)


def test_every_sampling_call_of_a_spline_flow_check_stays_within_the_budget():
    """Issue 24: an untrained NSF(5, 5) took gigabytes for its rank check. Each sampling
    call now peaks within the budget (the first chunks measured it), a smaller budget
    makes more, smaller calls, and every draw is made once."""
    torch.manual_seed(0)
    flow = zuko.flows.NSF(5, 5)
    theta, x = torch.randn(20, 5), torch.randn(20, 5)
    calls = {}
    for budget in (2, 8):
        posterior = Recording(flow)
        with cl.set_memory_budget(budget * MiB):
            cl.RankCalibration(500).update(posterior, theta, x)
        calls[budget] = posterior.calls
        assert sum(rows * draws for rows, draws, _ in posterior.calls) == 20 * 500
        # the measured peak per draw varies by about 25 % between calls (_memory's docstring)
        assert max(peak for *_, peak in posterior.calls) <= 1.4 * budget * MiB
    assert len(calls[2]) > len(calls[8]) > 2
    # the old chunking (2**20 numbers, one call here) peaks far above the small budget
    # (its size depends on torch's version: 62 MiB with torch 2.13, 16 MiB with 2.11)
    old = Recording(flow)
    cl.RankCalibration(500, max_chunk_elements=2**20).update(old, theta, x)
    assert len(old.calls) == 1
    assert old.calls[0][2] > 4 * 2 * MiB


def test_draws_kept_for_the_whole_check_count_against_the_budget():
    """draws() fills one (S, N, D) output chunk by chunk (JointC2ST, TARP keep it): the
    sampling calls get the budget less that output, so the two together stay within it."""
    torch.manual_seed(0)
    flow = zuko.flows.NSF(5, 5)
    x = torch.randn(200, 5)
    posterior = Recording(flow)
    with cl.set_memory_budget(4 * MiB):
        samples = draws(posterior, x, 500)  # 200 * 500 * 5 float32: 1.9 MiB kept
    held = samples.numel() * samples.element_size()
    assert held > 1.5 * MiB
    assert sum(rows * n for rows, n, _ in posterior.calls) == 200 * 500
    # the calls after the probe were sized for 4 MiB - 1.9 MiB at the CPU's margin (with
    # the 25 % variation between calls of _memory's docstring), not for 4 MiB
    largest = max(peak for *_, peak in posterior.calls[1:]) * PROBE_MARGIN
    assert 0.5 * (4 * MiB - held) <= largest <= 1.3 * (4 * MiB - held)


def _per_row_sampler(x, num_samples):
    """Samples-only: draws that depend on each row of x alone (one generator per row), so
    any chunking of the rows gives the same draws."""
    out = torch.empty(num_samples, *x.shape)
    for i, row in enumerate(x):
        seed = int((row * 1e6).round().abs().sum()) % 2**31
        noise = torch.randn(num_samples, x.shape[1], generator=torch.Generator().manual_seed(seed))
        out[:, i] = 0.8 * row + 0.6 * noise
    return out


def test_a_small_budget_gives_more_chunks_and_the_same_results():
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(300, torch.Generator().manual_seed(3))
    results = {}
    for budget in (1, 256):
        posterior = Recording(cl.SamplePosterior(_per_row_sampler))
        with cl.set_memory_budget(budget * MiB):
            ranks, tarp = cl.RankCalibration(1000), cl.TARP(1000, seed=2)
            torch.manual_seed(5)
            ranks.update(posterior, theta, x)
            tarp.update(posterior, theta, x)
            results[budget] = (ranks.compute(), tarp.compute(), len(posterior.calls))
    (r1, t1, calls1), (r256, t256, calls256) = results[1], results[256]
    assert calls1 > calls256
    assert torch.equal(r1.histogram, r256.histogram)
    assert torch.equal(r1.global_p_value, r256.global_p_value)
    assert torch.equal(t1.coverage, t256.coverage)
    assert torch.equal(t1.p_value, t256.p_value)


def test_latents_in_chunks_equal_one_call():
    torch.manual_seed(1)
    flow = zuko.flows.NSF(3, 4)
    theta, x = torch.randn(3000, 3), torch.randn(3000, 4)
    with torch.no_grad():
        whole = cl.as_posterior(flow).to_latent(theta, x)
    with cl.set_memory_budget(MiB), TensorPeak() as tracker:
        chunked = latents(flow, theta, x)
    assert torch.allclose(chunked, whole, atol=1e-6)
    assert tracker.peak < 3 * MiB  # one call would hold about 3000 * 4 KB


def test_kccsd_scores_in_chunks_equal_one_call_and_stay_within_the_budget():
    """Issue 24: KCCSD scored all pairs at 16 base points per call (autograd through the
    flow at N * 16 points: 332 MiB on an NSF(5, 5) at N = 2,000). The scores now come in
    blocks of pairs and base points sized from the budget, equal to one call."""
    torch.manual_seed(2)
    flow = zuko.flows.NSF(3, 4)
    theta, x, base = torch.randn(1500, 3), torch.randn(1500, 4), torch.randn(32, 3)
    whole_pairs = scores(flow, theta, x, create_graph=True).detach()
    whole_base = base_scores(flow, x, base, chunk_size=32)
    with cl.set_memory_budget(MiB), TensorPeak() as tracker:
        pairs = scores(flow, theta, x)
        at_base = base_scores(flow, x, base)
    assert at_base.shape == (1500, 32, 3)
    # float32 sums in other block shapes: equal to rounding
    assert torch.allclose(pairs, whole_pairs, rtol=1e-4, atol=1e-5)
    assert torch.allclose(at_base, whole_base, rtol=1e-4, atol=1e-5)
    # one call at 32 base points holds the graphs of 48,000 evaluations (tens of MiB)
    assert tracker.peak < 4 * MiB
    # the metric, from its defaults, gives the statistic of the explicit chunking
    results = []
    for chunk in (None, 16):
        metric = cl.KCCSD(score_chunk_size=chunk)
        metric.update(flow, theta[:300], x[:300])
        results.append(metric.compute())
    assert torch.allclose(results[0].statistic, results[1].statistic, rtol=1e-5)


class Slow(torch.nn.Module):
    """A metric whose check costs much more than the tiny epoch around it."""

    def __init__(self):
        super().__init__()
        self.updates = 0

    def update(self, posterior, theta, x):
        self.updates += 1
        time.sleep(0.6)

    def compute(self):
        return {"p_value": torch.tensor(0.5)}

    def reset(self):
        pass


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.flow = zuko.flows.MAF(2, 2)

    def training_step(self, batch, batch_idx):
        return -self.flow(batch[1]).log_prob(batch[0]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_an_expensive_check_warns_once_with_its_seconds_and_the_epoch_fraction(tmp_path):
    theta, x = GaussianToy(dim=2).sample(16, torch.Generator().manual_seed(0))
    callback = CalibrationCallback(Slow(), theta, x, log_figures=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=[callback],
                        default_root_dir=tmp_path)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Module(), DataLoader(TensorDataset(theta, x), batch_size=16))
    cost = [str(w.message) for w in caught if "one check took" in str(w.message)]
    assert len(cost) == 1, cost  # three checks, one warning
    assert "CalibrationCallback" in cost[0]
    assert "x an epoch's training" in cost[0]
    assert callback.epochs == [0, 1, 2]


def test_the_cost_warning_compares_the_check_with_its_epoch():
    callback = CalibrationCallback(Slow(), *GaussianToy(dim=2).sample(4, torch.Generator()))
    callback._epoch_start = 100.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.warn_cost(110.0, 2.0, "fit")  # 0.2 of a 10 s epoch: quiet
        callback.warn_cost(110.0, 9.0, "validate")  # not in fit: quiet
    with pytest.warns(RuntimeWarning, match=r"took 5 s, 50% of an epoch's training \(10 s"):
        callback.warn_cost(110.0, 5.0, "fit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.warn_cost(110.0, 50.0, "fit")  # once only
    fresh = CalibrationCallback(Slow(), *GaussianToy(dim=2).sample(4, torch.Generator()))
    fresh._epoch_start = 100.0
    with pytest.warns(RuntimeWarning, match=r"took 30 s, 3x an epoch's training \(10 s"):
        fresh.warn_cost(110.0, 30.0, "fit")
