"""DDP where one process receives no batch (the callback's sharding allows it).

``update`` makes no collective call in any metric, so the process without data reaches
``compute`` (where all communication happens) and the run neither hangs nor fails;
its result equals one process fed all the batches.
"""

import os
import time

import pytest
import torch

import calib_lightning as cl
from calib_lightning.metrics import FrechetDistance
from calib_lightning.tasks import MGM, GaussianToy
from calib_lightning.testing import run_distributed

F64 = torch.float64


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.forks
def test_a_process_without_batches_neither_hangs_nor_changes_the_result():
    toy = GaussianToy(dim=2)
    theta, x = toy.sample(300, gen(0))
    theta, x = theta.double() + 1e6, x.double()  # far from the origin, in float64
    # (the toy's posterior mean is x / 2 in the toy's units; _shifted moves it by 1e6)
    torch.manual_seed(4)
    tarp_samples = toy.posterior(variance_scale=2.0)(x.float()).sample((40,)).double() + 1e6
    mgm = MGM(delta=0.0)
    k_theta, k_x = mgm.sample(120, gen(1))
    points = 1e6 + 0.01 * torch.randn(2, 400, 2, generator=gen(2), dtype=F64)
    bound = float((theta - 1e6).abs().max()) + 1e-3  # a box prior around the offset theta
    box = torch.distributions.Independent(torch.distributions.Uniform(
        torch.full((2,), 1e6 - bound, dtype=F64), torch.full((2,), 1e6 + bound, dtype=F64)), 1)

    def feed(metrics, rank_with_data, rank):
        """Every metric gets all batches on ``rank_with_data`` and none elsewhere."""
        ranks, frechet, tarp, kccsd, support = metrics
        if rank == rank_with_data:
            torch.manual_seed(3)  # posterior sampling in RankCalibration and PriorSupport
            for rows in (slice(0, 120), slice(120, 300)):
                ranks.update(_shifted(toy), theta[rows], x[rows])
                tarp.update(tarp_samples[:, rows], theta[rows], x[rows])
                support.update(_shifted(toy), theta[rows], x[rows])
            for rows in (slice(0, 150), slice(150, 400)):
                frechet.update(samples=points[0, rows], reference=points[1, rows])
            for rows in (slice(0, 50), slice(50, 120)):
                kccsd.update(mgm, k_theta[rows], k_x[rows])
        return {
            "ranks": ranks.compute(),
            "frechet": frechet.compute(),
            "tarp": tarp.compute(),
            "kccsd": kccsd.compute(),
            "support": support.compute(),
        }

    def make():
        return (cl.RankCalibration(30), FrechetDistance(dim=2),
                cl.TARP(num_posterior_samples=40, num_null=200),
                cl.KCCSD(distribution_kernel="kgfd", num_null=100), cl.PriorSupport(box, 50))

    expected = feed(make(), 0, 0)
    for rank_with_data in (0, 1):
        def fn(rank, _world_size, rank_with_data=rank_with_data):
            return feed(make(), rank_with_data, rank)

        results = run_distributed(fn, world_size=2, timeout=90.0)
        for result in results:
            ranks, want = result["ranks"], expected["ranks"]
            assert torch.equal(ranks.histogram, want.histogram)
            assert torch.equal(ranks.p_value, want.p_value)
            torch.testing.assert_close(ranks.contraction, want.contraction,
                                       rtol=1e-12, atol=0)
            torch.testing.assert_close(result["frechet"].frechet_distance,
                                       expected["frechet"].frechet_distance,
                                       rtol=1e-12, atol=0)
            for key in ("statistic", "p_value", "coverage", "num_pairs"):
                assert torch.equal(getattr(result["tarp"], key),
                                   getattr(expected["tarp"], key)), key
            for key in ("statistic", "p_value", "num_pairs"):
                torch.testing.assert_close(getattr(result["kccsd"], key),
                                           getattr(expected["kccsd"], key))
            for key in ("num_outside", "num_draws", "p_value", "leakage"):
                assert torch.equal(getattr(result["support"], key),
                                   getattr(expected["support"], key)), key
    # the data were not degenerate: the metrics see what they should
    assert int(expected["ranks"].num_pairs) == 300
    assert float(expected["tarp"].p_value) <= 0.05  # doubled variance detected
    assert int(expected["kccsd"].num_pairs) == 120
    assert int(expected["support"].num_draws) == 300 * 50
    assert int(expected["support"].num_outside) > 0  # the box cuts the draws near its edges


def _shifted(toy):
    """The toy's exact posterior moved by the 1e6 offset of the parameters."""
    def posterior(obs):
        inner = toy.posterior()(obs.float())
        return torch.distributions.Independent(
            torch.distributions.Normal(inner.mean.double() + 1e6, inner.stddev.double()), 1
        )

    return posterior


@pytest.mark.forks
def test_run_distributed_names_a_rank_that_sent_nothing():
    """A rank that dies without a word (here ``os._exit``; a deadlock after the fork looks
    the same, with no exit code) is named with its exit code, not a bare ``queue.Empty``."""

    def rank_fn(rank, world_size):
        if rank == 1:
            os._exit(3)
        return rank

    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] sent no result within 3 s; "
                       r"exit codes \{1: 3\}"):  # fmt: skip
        run_distributed(rank_fn, world_size=2, timeout=3)


def test_run_distributed_refuses_to_fork_once_cuda_is_initialised(monkeypatch):
    """On a GPU machine, a worker that ran CUDA tests cannot fork ranks: run_distributed
    says so before forking (and the ``forks`` tests skip there, tests/conftest.py)."""
    import calib_lightning.testing as testing

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert not testing.fork_is_safe()
    with pytest.raises(RuntimeError, match="CUDA is initialised in it"):
        run_distributed(lambda rank, world_size: rank)


def test_fork_is_safe_asks_a_fork_to_run_a_backward_pass(monkeypatch):
    """On a GPU machine, autograd's device threads start at a process's first backward
    pass (CPU tensors too) and a fork made after it cannot run one: ``fork_is_safe`` tries
    a backward in a fork. Seen on an H200: the two-rank KCCSD test failed there with
    "Unable to handle autograd's threading in combination with fork-based
    multiprocessing" after other tests of its worker had run a backward."""
    import calib_lightning.testing as testing

    torch.ones(1, requires_grad=True).sum().backward()
    assert testing.fork_is_safe() == (not torch.cuda.is_available())  # safe without a GPU

    def refused(*args, **kwargs):  # what autograd does in such a fork
        raise RuntimeError("Unable to handle autograd's threading in combination with fork")

    monkeypatch.setattr(torch.autograd, "backward", refused)
    assert not testing.fork_is_safe()
    with pytest.raises(RuntimeError, match="autograd's device threads"):
        run_distributed(lambda rank, world_size: rank)
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: time.sleep(30))
    assert not testing.fork_is_safe(timeout=0.5)  # a fork that hangs is no safer
