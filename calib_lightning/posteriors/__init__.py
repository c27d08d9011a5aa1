r"""One interface over conditional density estimators :math:`q(\theta \mid x)`.

Every diagnostic in the package talks to a :class:`Posterior`, never to zuko,
nflows, sbi or torch.distributions directly. :func:`as_posterior` picks the adapter,
one module per estimator family:

* :mod:`~calib_lightning.posteriors.base`: the :class:`Posterior` interface and the
  input checks every adapter shares;
* :mod:`~calib_lightning.posteriors.distributions`: any callable ``x -> Distribution``
  (zuko flows, Gaussians);
* :mod:`~calib_lightning.posteriors.flows`: nflows ``Flow`` s;
* :mod:`~calib_lightning.posteriors.sbi`: sbi's density estimators;
* :mod:`~calib_lightning.posteriors.vector_fields`: sbi's flow-matching and score
  estimators (``FMPE``, ``NPSE``) through their probability-flow ODE;
* :mod:`~calib_lightning.posteriors.samples`: samples-only posteriors
  (:class:`SamplePosterior`);
* :mod:`~calib_lightning.posteriors.unnormalized`: posteriors known up to a constant,
  :math:`\exp f(\theta, x)\, p(\theta)` (:class:`UnnormalizedPosterior`: sbi's ratio and
  likelihood estimators and MCMC posteriors, given the prior), scores only.

An adapter lists what it can compute in ``capabilities`` (:data:`CAPABILITIES`: sample,
log_prob, score, to_latent); a method it cannot support raises an
:class:`UnsupportedError` (a ``ValueError``) naming the missing capability and the checks
that need it; so does a score whose log-density has no gradient in ``theta``
(:class:`NotDifferentiableError`) and a latent map without a normal base.

Shape convention, identical for every backend:

* ``x``: observations, shape ``(N, *X)`` (usually ``(N, X)``);
* ``sample(x, S)`` -> ``(S, N, D)``;
* ``log_prob(theta, x)``: ``theta`` of shape ``(*, N, D)`` -> ``(*, N)``;
* ``score(theta, x)``: :math:`\nabla_\theta \log q(\theta \mid x)`, ``(*, N, D)``;
* ``to_latent(theta, x)``: the flow's base-space point :math:`z = T^{-1}(\theta; x)`,
  ``(*, N, D)``, standard normal when ``theta ~ q(. | x)``.

Inputs are checked against the model before it runs: ``theta``'s width against the
event size ``D`` and ``x``'s feature shape against the context the estimator was built
for, wherever the adapter can read them (zuko MAF/NSF, nflows, sbi; the event shape of
any returned distribution). A mismatch raises a :class:`ValueError` naming the argument,
the expected and the received shape; torch's own shape errors from inside the model are
translated the same way.

Dtypes: the model is evaluated in its own dtype (that of its parameters). ``theta`` and
``x`` are cast to it, so float64 pairs work with a float32 flow and the reverse; integer
or boolean ``x`` is cast the same way (to torch's default dtype when the model has no
parameters). Results come back in the caller's dtype: that of ``theta`` for
``log_prob``, ``score`` and ``to_latent``, that of ``x`` (floating) for ``sample``, else
the model's. Metrics thus accumulate in the dtype of the data they are given, with the
model's precision.

Example:
    >>> import torch
    >>> from torch.distributions import Independent, Normal
    >>> post = as_posterior(lambda x: Independent(Normal(0.5 * x, 1.0), 1))
    >>> x = torch.zeros(4, 2)
    >>> post.sample(x, 3).shape
    torch.Size([3, 4, 2])
    >>> post.score(torch.ones(4, 2), x)[0]
    tensor([-1., -1.])
"""

from __future__ import annotations

from calib_lightning.posteriors._adapt import as_posterior
from calib_lightning.posteriors._dispatch import recognize
from calib_lightning.posteriors.base import (
    CAPABILITIES,
    NotDifferentiableError,
    Posterior,
    Recognized,
    UnsupportedError,
    check_width,
    density_draws,
    supports,
    unsupported,
)
from calib_lightning.posteriors.bayesflow import BayesFlowPosterior
from calib_lightning.posteriors.distributions import DistributionPosterior
from calib_lightning.posteriors.flows import NflowsPosterior
from calib_lightning.posteriors.samples import SamplePosterior
from calib_lightning.posteriors.sbi import SbiPosterior
from calib_lightning.posteriors.unnormalized import UnnormalizedPosterior
from calib_lightning.posteriors.vector_fields import VectorFieldPosterior
from calib_lightning.posteriors.wrapped import WrappedPosterior

__all__ = [
    "CAPABILITIES",
    "BayesFlowPosterior",
    "DistributionPosterior",
    "NflowsPosterior",
    "NotDifferentiableError",
    "Posterior",
    "Recognized",
    "SamplePosterior",
    "SbiPosterior",
    "UnnormalizedPosterior",
    "UnsupportedError",
    "VectorFieldPosterior",
    "WrappedPosterior",
    "as_posterior",
    "check_width",
    "density_draws",
    "recognize",
    "supports",
    "unsupported",
]
