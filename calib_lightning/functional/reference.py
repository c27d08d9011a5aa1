r"""Compare posterior samples with reference posterior samples at given observations.

The entry point for benchmarks and callbacks that hold reference samples (exact
samplers of benchmark tasks, long MCMC runs) at a few observations :math:`x_o`: given
the approximation's samples at every :math:`x_o` (drawn by the caller, e.g. with
:func:`calib_lightning.evaluation.draws`), one call returns every sample-based score of
:mod:`calib_lightning.functional.samples`, one value per observation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from calib_lightning._utils.validation import check_finite
from calib_lightning.functional.samples import density_coverage, frechet_distance, mmd, vendi_score
from calib_lightning.kernels import median_bandwidth
from calib_lightning.results import Result

__all__ = ["ReferenceComparison", "compare_to_reference"]


@dataclass(eq=False)
class ReferenceComparison(Result):
    """Sample-based scores against reference samples, one entry per observation ``(O,)``.

    Attributes:
        mmd: squared MMD (Gaussian kernel, median bandwidth of the pooled sample).
        mmd_p_value: its permutation p-value (``nan`` with ``num_permutations=0``).
        mmd_bandwidth: the kernel bandwidth used.
        frechet_distance: Fréchet distance of Gaussian fits.
        density, coverage: Naeem et al. (2020), 1 for samples like the reference.
        vendi, reference_vendi, vendi_bandwidth: Vendi scores of both sets at one
            bandwidth (``None`` without ``vendi``).
    """

    logged: ClassVar[tuple[str, ...]] = (
        "mmd",
        "mmd_p_value",
        "frechet_distance",
        "density",
        "coverage",
    )

    mmd: Tensor
    mmd_p_value: Tensor
    mmd_bandwidth: Tensor
    frechet_distance: Tensor
    density: Tensor
    coverage: Tensor
    vendi: Tensor | None = None
    reference_vendi: Tensor | None = None
    vendi_bandwidth: Tensor | None = None


def compare_to_reference(
    samples: Tensor,
    reference_samples: Tensor,
    *,
    num_permutations: int = 200,
    k: int = 5,
    vendi: bool = True,
    generator: torch.Generator | None = None,
) -> ReferenceComparison:
    r"""Sample-based scores of posterior samples against reference samples, per observation.

    For each observation :math:`x_o` (a loop, so memory is that of one comparison):
    :func:`~calib_lightning.functional.mmd` (statistic, permutation p-value, median
    bandwidth of the pooled sample), :func:`~calib_lightning.functional.frechet_distance`,
    :func:`~calib_lightning.functional.density_coverage`, and, if ``vendi``, the
    :func:`~calib_lightning.functional.vendi_score` of both sets at one bandwidth (the
    median heuristic of the reference), so that a too narrow or too wide approximation
    shows as a lower or higher diversity than the reference's.

    Arguments:
        samples: posterior samples ``(S, O, D)`` at the ``O`` observations, the layout
            of ``Posterior.sample`` and :func:`calib_lightning.evaluation.draws`.
        reference_samples: ``(S_ref, O, D)``, the same layout (e.g.
            :meth:`calib_lightning.tasks.SBITask.reference_posterior_samples`).
        num_permutations: permutations of the MMD test (``0``: no p-value).
        k: neighbour of density and coverage.
        vendi: also compute Vendi scores (one ``(S, S)`` eigendecomposition each).
        generator: random generator for the permutations.

    Returns:
        :class:`ReferenceComparison`: each score ``(O,)``, one entry per observation.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy, g = GaussianToy(dim=2), torch.Generator().manual_seed(0)
        >>> x_o = toy.sample(3, g)[1]
        >>> reference = toy.posterior()(x_o).sample((500,))
        >>> samples = toy.posterior(variance_scale=2.0)(x_o).sample((500,))
        >>> out = compare_to_reference(samples, reference, generator=g)
        >>> out.mmd_p_value < 0.05, out.vendi > out.reference_vendi
        (tensor([True, True, True]), tensor([True, True, True]))
    """
    if not isinstance(reference_samples, Tensor) or reference_samples.ndim != 3:
        shape = tuple(reference_samples.shape) if isinstance(reference_samples, Tensor) else None
        raise ValueError(f"reference_samples must have shape (S_ref, O, D), got {shape}")
    num_obs, dim = reference_samples.shape[1:]
    check_finite("reference_samples", reference_samples.transpose(0, 1))
    if not isinstance(samples, Tensor) or samples.ndim != 3 or samples.shape[1:] != (num_obs, dim):
        shape = tuple(samples.shape) if isinstance(samples, Tensor) else type(samples).__name__
        raise ValueError(
            f"samples must have shape (S, {num_obs}, {dim}) like reference_samples, got {shape}"
        )
    check_finite("posterior samples", samples.transpose(0, 1))
    samples = samples.to(reference_samples.dtype)
    rows: dict[str, list[Tensor]] = {}
    for o in range(num_obs):
        ours, ref = samples[:, o], reference_samples[:, o]
        test = mmd(ours, ref, num_permutations=num_permutations, generator=generator)
        scores = {
            "mmd": test["statistic"],
            "mmd_p_value": test["p_value"],
            "mmd_bandwidth": test["bandwidth"],
            "frechet_distance": frechet_distance(ours, ref),
            **density_coverage(ours, ref, k=k),
        }
        if vendi:
            bandwidth = median_bandwidth(ref)
            scores["vendi"] = vendi_score(ours, bandwidth)
            scores["reference_vendi"] = vendi_score(ref, bandwidth)
            scores["vendi_bandwidth"] = bandwidth
        for key, value in scores.items():
            rows.setdefault(key, []).append(value.detach())
    return ReferenceComparison(**{key: torch.stack(values) for key, values in rows.items()})
