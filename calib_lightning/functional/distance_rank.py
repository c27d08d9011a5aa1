r"""A joint rank statistic that needs no density: the distance rank.

For a posterior known through its samples only there is no energy
:math:`-\log q(\theta \mid x)` to rank the truth by. The distance rank ranks it by its
standardized distance to the centre of the ``M + 1`` points of the pair, the truth
:math:`y_0 = \theta^*` and the draws :math:`y_k = \theta_k`:

.. math::

    t(y_j) = -\frac{1}{2} \sum_{a=1}^{D} \left(\frac{y_{j,a} - \bar y_a}{s_a}\right)^2,
    \qquad \bar y = \frac{1}{M + 1} \sum_{j=0}^{M} y_j, \quad
    s_a^2 = \frac{1}{M} \sum_{j=0}^{M} (y_{j,a} - \bar y_a)^2,

and :math:`t` takes the place of :math:`\log q` in the joint rank
(:func:`~calib_lightning.functional.energy_ranks`): the truth ranks high when it lies
farther from the centre than the draws.

**Level.** :math:`\bar y` and :math:`s` are symmetric functions of the ``M + 1``
points, so :math:`t(y_j)` is the same function of :math:`y_j` and of the unordered set
for every ``j``. If :math:`q` is the true posterior, the ``M + 1`` points are i.i.d.
given :math:`x`, hence exchangeable, and the rank of :math:`t(y_0)` among the
:math:`t(y_k)` (ties broken at random) is exactly uniform on :math:`\{0, \dots, M\}`
for any ``M``, ``D`` and posterior. Using the draws' own mean and spread without the
truth would break the symmetry (the draws sit closer to their own mean) and bias the
rank up at small ``M``.

**Power.** Over-confident posteriors put the truth far out (high ranks), under-confident
ones too close (low ranks), and a shifted mean pushes it out: the same reading as the
energy rank of a Gaussian posterior. All ``M`` draws of a pair are needed at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["distance_log_prob"]


def distance_log_prob(samples: Tensor, theta: Tensor) -> tuple[Tensor, Tensor]:
    r"""The distance statistic :math:`t` (module docstring) of the draws and of the truth.

    Arguments:
        samples: all ``M >= 1`` posterior draws of each pair, ``(M, *, D)``.
        theta: true parameters ``(*, D)``.

    Returns:
        ``(t_samples (M, *), t_theta (*))``, in the promoted dtype of the inputs: pass them
        where the log-densities of the draws and of the truth go (e.g.
        :func:`~calib_lightning.functional.energy_ranks`).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> samples = torch.randn(99, 500, 2, generator=g)
        >>> t_samples, t_theta = distance_log_prob(samples, 3.0 * torch.randn(500, 2, generator=g))
        >>> ranks = (t_samples > t_theta).sum(0)  # the joint rank: the truth lies far out
        >>> t_samples.shape, bool(ranks.float().mean() > 70)
        (torch.Size([99, 500]), True)
    """
    if samples.ndim < 2 or samples.shape[1:] != theta.shape:
        raise ValueError(
            f"samples must have shape (M, *theta.shape) = (M, {', '.join(map(str, theta.shape))})"
            f", got {tuple(samples.shape)}"
        )
    dtype = torch.promote_types(samples.dtype, theta.dtype)
    samples, theta = samples.to(dtype), theta.to(dtype)
    m = samples.shape[0]
    centre = (samples.sum(0) + theta) / (m + 1)
    spread = ((samples - centre).square().sum(0) + (theta - centre).square()) / m
    scale = torch.where(spread > 0, spread, torch.ones_like(spread)).rsqrt()
    t_samples = -0.5 * ((samples - centre) * scale).square().sum(-1)
    t_theta = -0.5 * ((theta - centre) * scale).square().sum(-1)
    return t_samples, t_theta
