r"""Compare a posterior with reference posterior samples at given observations.

The entry point for benchmarks and callbacks that hold reference samples (exact
samplers of benchmark tasks, long MCMC runs) at a few observations :math:`x_o`:
one call draws the approximation's samples at every :math:`x_o` and returns every
sample-based score of :mod:`calib_lightning.functional.samples`, one value per
observation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from calib_lightning._checks import check_finite, check_positive
from calib_lightning.evaluation import checked_samples
from calib_lightning.functional.samples import density_coverage, frechet_distance, mmd, vendi_score
from calib_lightning.kernels import median_bandwidth
from calib_lightning.posteriors import Posterior, as_posterior

__all__ = ["compare_to_reference"]


def compare_to_reference(
    posterior: Posterior | object | Tensor,
    observations: Tensor,
    reference_samples: Tensor,
    *,
    num_posterior_samples: int | None = None,
    num_permutations: int = 200,
    k: int = 5,
    vendi: bool = True,
    generator: torch.Generator | None = None,
) -> dict[str, Tensor]:
    r"""Sample-based scores of ``posterior`` against reference samples, per observation.

    For each observation :math:`x_o` (a loop, so memory is that of one comparison):
    :func:`~calib_lightning.functional.mmd` (statistic, permutation p-value, median
    bandwidth of the pooled sample), :func:`~calib_lightning.functional.frechet_distance`,
    :func:`~calib_lightning.functional.density_coverage`, and, if ``vendi``, the
    :func:`~calib_lightning.functional.vendi_score` of both sets at one bandwidth (the
    median heuristic of the reference), so that a too narrow or too wide approximation
    shows as a lower or higher diversity than the reference's.

    Arguments:
        posterior: anything :func:`calib_lightning.as_posterior` accepts, or samples
            ``(S, K, D)`` already drawn at ``observations``.
        observations: :math:`x_o`, shape ``(K, *X)``.
        reference_samples: ``(S_ref, K, D)``, the layout of ``Posterior.sample`` and of
            :meth:`calib_lightning.tasks.SBITask.reference_posterior_samples`.
        num_posterior_samples: ``S`` to draw; default ``S_ref``.
        num_permutations: permutations of the MMD test (``0``: no p-value).
        k: neighbour of density and coverage.
        vendi: also compute Vendi scores (one ``(S, S)`` eigendecomposition each).
        generator: random generator for the permutations.

    Returns:
        dict of ``(K,)`` tensors: ``mmd``, ``mmd_p_value``, ``mmd_bandwidth``,
        ``frechet_distance``, ``density``, ``coverage`` and, if ``vendi``, ``vendi``,
        ``reference_vendi``, ``vendi_bandwidth``.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy, g = GaussianToy(dim=2), torch.Generator().manual_seed(0)
        >>> x_o = toy.sample(3, g)[1]
        >>> reference = toy.posterior()(x_o).sample((500,))
        >>> out = compare_to_reference(toy.posterior(variance_scale=2.0), x_o, reference,
        ...                            generator=g)
        >>> out["mmd_p_value"] < 0.05, out["vendi"] > out["reference_vendi"]
        (tensor([True, True, True]), tensor([True, True, True]))
    """
    if not isinstance(observations, Tensor) or observations.ndim < 2:
        shape = tuple(observations.shape) if isinstance(observations, Tensor) else observations
        raise ValueError(f"observations must have shape (K, X), got {shape}")
    check_finite("observations", observations)
    num_obs = observations.shape[0]
    if not isinstance(reference_samples, Tensor) or reference_samples.ndim != 3 \
            or reference_samples.shape[1] != num_obs:
        shape = tuple(reference_samples.shape) if isinstance(reference_samples, Tensor) else None
        raise ValueError(
            f"reference_samples must have shape (S_ref, {num_obs}, D), one column per "
            f"observation, got {shape}"
        )
    check_finite("reference_samples", reference_samples.transpose(0, 1))
    if isinstance(posterior, Tensor):
        samples = posterior
        if samples.ndim != 3 or samples.shape[1:] != (num_obs, reference_samples.shape[2]):
            raise ValueError(
                f"posterior samples must have shape (S, {num_obs}, {reference_samples.shape[2]}),"
                f" got {tuple(samples.shape)}"
            )
    else:
        size = num_posterior_samples
        if size is None:
            size = reference_samples.shape[0]
        check_positive("num_posterior_samples", size, integer=True)
        samples = as_posterior(posterior).sample(observations, size)
    checked_samples(samples)
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
    return {key: torch.stack(values) for key, values in rows.items()}
