r"""L-C2ST-NF and L-C2ST as torchmetrics metrics: local tests at reference observations.

``update(posterior, theta, x)`` stores what the test needs from each calibration batch
(evaluating the model through :mod:`calib_lightning.evaluation`); ``compute()`` trains
the classifier (:mod:`calib_lightning.classifiers.local_c2st`) and returns an
:class:`LC2STResult`: one statistic and p-value per reference observation, with the
predicted probabilities and PP-plot data for :mod:`calib_lightning.plots.lc2st`.

:class:`LC2STNF` holds its null, an :class:`~calib_lightning.classifiers.LC2STNFNull`
(``metric.null``). The null classifiers depend only on the calibration observations, so
they are trained once (one batched fit) and reused by every later check of every
posterior, also after ``state_dict`` / ``load_state_dict``. The null records a
fingerprint (SHA-256) of the calibration features (``x`` flattened, or its embedding)
and of the settings it was trained with and refuses, with a :class:`ValueError`, to test
data with other ``x``; with an embedding whose features changed, it is retrained.

Both take an ``embedding`` (an ``nn.Module`` or callable ``(n, *X) -> (n, F)``): the
classifiers then see ``(embedding(x), theta)`` instead of ``(x flattened, theta)``. It is
applied once per ``x`` (at ``update``, and to the observations at ``compute``) by
:func:`calib_lightning.evaluation.embed`: without gradients, in chunks of
``embedding_batch_size`` rows, in eval mode (each submodule's mode restored), so it stays
frozen while the classifiers train.

:class:`LC2ST` needs no flow, but its permutation null depends on the posterior and is
retrained at every ``compute()``: ``H + 1`` classifiers per check instead of one.

References:
    Linhart, Gramfort, Rodrigues. "L-C2ST: Local Diagnostics for Posterior
    Approximations in Simulation-Based Inference." NeurIPS 2023.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics.utilities.data import dim_zero_cat

from calib_lightning._utils.distributed import canonical_order, room_for_rows
from calib_lightning._utils.validation import check_pairs, check_positive
from calib_lightning.classifiers import (
    LC2STNFNull,
    latent_features,
    lc2st_nf_train,
    lc2st_probabilities,
    lc2st_train,
)
from calib_lightning.evaluation import check_event_size, draws, latents
from calib_lightning.functional.lc2st import lc2st_statistic, pp_ecdf
from calib_lightning.metrics._local_c2st import (
    LC2STResult,
    LocalC2ST,
    ProbabilityMap,
    check_observations,
)
from calib_lightning.posteriors import Posterior

__all__ = ["LC2ST", "LC2STNF"]


class LC2STNF(LocalC2ST):
    r"""L-C2ST-NF: local test of a normalizing-flow posterior in its latent space, reusable null.

    ``update(posterior, theta, x)`` maps the true parameters to the flow's latent space,
    :math:`z^*_i = T_\phi^{-1}(\theta^*_i; x_i)` (``posterior.to_latent``), and stores them
    with ``x``. ``compute()`` trains one classifier (``num_ensemble`` members) between
    :math:`(z^*_i, x_i)` and :math:`(z_i, x_i)`, :math:`z_i \sim N(0, I)`, and evaluates
    :math:`T(x_o) = \frac{1}{N_v}\sum_j (d(z_j, x_o) - \frac12)^2` at fixed
    :math:`z_j \sim N(0, I)` for every reference observation. It returns an
    :class:`LC2STResult` (``samples`` is ``None``); its ``global_p_value`` is the Cauchy
    combination (:func:`~calib_lightning.functional.combine_p_values`) of ``p_value``.

    The null, ``metric.null`` (an :class:`~calib_lightning.classifiers.LC2STNFNull`): the
    ``num_null`` null classifiers (both classes normal draws) are trained by
    ``metric.null.fit(x, dim)``, or by the first ``compute()`` on its calibration ``x``, in
    one batched fit, and kept with their statistics at the reference observations; a
    later check is one classifier fit and one inverse pass of the flow.
    ``metric.null.reset()`` forgets it; :meth:`set_observations` moves the test to other
    observations with the same null. The null is fingerprinted by the calibration
    features: when ``compute()`` finds other features and an embedding is set, it
    retrains the null; without an embedding, other ``x`` raise a ``ValueError``.
    Every ``compute()`` is a check (a classifier fit; the counter advances): the metric
    runs with ``compute_with_cache=False``.

    The observed classifier is trained as one null trial, with randomness keyed by
    ``seed``, the check counter (``checks``, in the ``state_dict``) and the SHA-256
    digest of its pairs; the null classifiers depend on ``seed`` and the calibration
    ``x`` only (why: ``docs/design.md``, "L-C2ST-NF: randomness and defaults").

    Memory: per process at most ``max_pairs`` pairs of ``D + X`` numbers; the null is
    ``num_null * num_ensemble`` small MLPs plus ``num_null x O x 101`` PP-curve values.
    Under DDP the pairs of all processes are gathered in a canonical order; every
    process then trains the same classifiers. ``metric.null.fit`` takes the full
    calibration ``x`` (all processes' together).

    Arguments:
        observations: reference observations :math:`x_o`, shape ``(O, *X)``, as ``x``
            (raw, before any embedding).

    Keyword Arguments:
        num_null: null classifiers ``H``.
        num_posterior_samples: evaluation points :math:`N_v` per observation (normal
            draws in the latent space for L-C2ST-NF, posterior draws for L-C2ST).
        num_ensemble: classifiers averaged per statistic (the null's trials likewise), at
            ``num_ensemble`` times the cost.
        classifier: ``"mlp"`` (batched :class:`~calib_lightning.classifiers.MLPEnsemble`),
            ``"sbibm"`` or a scikit-learn classifier (then ``state_dict`` holds the null's
            cached statistics but not the classifiers themselves).
        classifier_kwargs: :class:`~calib_lightning.classifiers.MLPEnsemble` settings,
            over the local tests' own
            (:data:`~calib_lightning.classifiers.LOCAL_TEST_SETTINGS`: patience 2, hidden
            layers of ``min(10 * F, 96)`` units).
        max_pairs: per-process bound on stored pairs.
        level: the PP-plot's null band covers ``1 - level`` of the null curves.
        seed: with the data, keys every random stream: evaluation points, normal draws,
            classifier initialisations, splits and batch orders. ``None`` draws it from
            fresh entropy (valid, not reproducible).
        embedding: ``nn.Module`` or callable mapping ``x (n, *X)`` to features
            ``(n, F)`` (any trailing shape is flattened), or ``None`` (``x`` flattened).
            Held by reference, outside the ``state_dict``; :meth:`set_embedding`
            replaces it. A frozen embedding (``copy.deepcopy(net)``) keeps one null.
        embedding_batch_size: rows per call of ``embedding``.
        norm_feature: (:class:`LC2STNF` only) the classifiers, the null's too, also see
            the latent's standardised squared norm
            (:func:`~calib_lightning.classifiers.local_c2st.latent_features`); off by
            default (its power: ``examples/benchmarks/results/lc2st_norm_feature.md``).

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(500, torch.Generator().manual_seed(0))
        >>> metric = LC2STNF(observations=x[:2], num_null=20, num_posterior_samples=1000)
        >>> metric.update(toy.posterior(variance_scale=3.0), theta, x)
        >>> out = metric.compute()
        >>> out.p_value, out.global_p_value
        (tensor([0.0476, 0.0476]), tensor(0.0476))

    References:
        Linhart, Gramfort, Rodrigues. "L-C2ST: Local Diagnostics for Posterior
        Approximations in Simulation-Based Inference." NeurIPS 2023, section 3.1.
    """

    latent: list[Tensor]
    x: list[Tensor]

    def __init__(
        self, observations: Tensor, *args: Any, norm_feature: bool = False, **kwargs: Any
    ) -> None:
        if kwargs.setdefault("compute_with_cache", False):
            raise ValueError(
                "LC2STNF needs compute_with_cache=False: every compute() is a check (and the "
                "null or the observations may change in between), got True"
            )
        super().__init__(observations, *args, **kwargs)
        self.norm_feature = norm_feature
        self.null = LC2STNFNull(
            self.num_null,
            self.num_posterior_samples,
            self.num_ensemble,
            self.classifier_spec,
            self.classifier_kwargs,
            self.seed,
            norm_feature,
        )
        self.classifier = self._ensemble(self.num_ensemble, stream=2)
        self.add_state("latent", default=[], dist_reduce_fx="cat")
        self.add_state("x", default=[], dist_reduce_fx="cat")

    def update(self, posterior: Posterior | object, theta: Tensor, x: Tensor) -> None:
        """Store :math:`z^* = T^{-1}(\\theta; x)` for pairs ``theta (N, D)``, ``x (N, *X)``."""
        theta, x = check_pairs(theta, x)
        flat = self._check_features(x, self.x, posterior)
        latent = latents(posterior, theta, x)
        keep = room_for_rows(self, theta.shape[0], self.latent)
        if keep:
            self.latent.append(latent[:keep].detach())
            self.x.append(flat[:keep].detach())

    def set_observations(self, observations: Tensor) -> None:
        """Test at new reference observations ``(O, *X)``, reusing the trained null classifiers."""
        check_observations(observations, self.flat_observations.shape[1])
        if self.embedding is not None and observations.shape[1:] != self.observations.shape[1:]:
            raise ValueError(
                f"observations must have shape (O, *X) with *X = "
                f"{tuple(self.observations.shape[1:])} like x, got {tuple(observations.shape)}"
            )
        observations = observations.detach().clone().to(self.observations)
        if self.null.fitted:  # evaluate the null there now: fails early without its classifiers
            self.null.statistics(self._embed(observations, "observations"), self.pp_grid)
        self.observations = observations

    def compute(self) -> LC2STResult:
        """Statistic, p-value, probabilities and PP-plot data, one row per observation."""
        if isinstance(self.latent, list) and not self.latent:
            raise ValueError("LC2STNF.compute() needs at least one update, got none")
        latent, x = dim_zero_cat(self.latent), dim_zero_cat(self.x)
        order = canonical_order(torch.cat([x, latent], 1))
        latent, x = latent[order], x[order]
        if x.shape[0] < 2:
            raise ValueError(f"LC2STNF needs at least N >= 2 calibration pairs, got N = {len(x)}")
        if not self.null.fitted or (self.embedding is not None and not self.null.trained_on(x)):
            self.null.fit(x, latent.shape[1])  # first check, or the embedding's features changed
        else:
            self.null.check(x, latent.shape[1])
        observations = self.observation_features().to(latent)
        null_statistics, null_ecdf = self.null.statistics(observations, self.pp_grid)
        # trained exactly as one null trial, with its own fresh randomness (see the class doc)
        key = self._check_key(torch.cat([x, latent], 1))
        self.classifier = self._ensemble(self.num_ensemble, 2, key)
        lc2st_nf_train(latent, x, self.classifier, self._generator(5, key), self.norm_feature)
        eval_points = latent_features(self.null.eval_points.to(latent), self.norm_feature)
        proba = lc2st_probabilities(self.classifier, eval_points, observations, self.num_ensemble)
        return self._result(proba[0], null_statistics, null_ecdf)

    @torch.no_grad()
    def probability_map(
        self, posterior: Posterior | object, num_posterior_samples: int = 10_000
    ) -> ProbabilityMap:
        r"""The last classifier's :math:`d` on posterior samples at each observation.

        Draws :math:`\theta_s \sim q(\cdot \mid x_o)`, ``S = num_posterior_samples`` per
        observation, and evaluates :math:`d` at their latents
        :math:`T_\phi^{-1}(\theta_s; x_o)`: the data of the paper's Figure 4.
        """
        if not getattr(self.classifier, "fitted", False):
            raise ValueError("probability_map needs a trained classifier; call compute() first")
        check_positive("num_posterior_samples", num_posterior_samples, integer=True)
        theta = draws(posterior, self.observations, num_posterior_samples)  # (S, O, D)
        x = self.observations.repeat(num_posterior_samples, *[1] * (self.observations.ndim - 1))
        latent = latents(posterior, theta.reshape(-1, theta.shape[-1]), x).reshape(theta.shape)
        features = self.observation_features().to(latent)
        points = latent_features(latent.transpose(0, 1), self.norm_feature)
        proba = lc2st_probabilities(self.classifier, points, features, self.num_ensemble)[0]
        return ProbabilityMap(samples=theta.transpose(0, 1), probabilities=proba)


class LC2ST(LocalC2ST):
    r"""L-C2ST: local test of any posterior estimator, with a permutation null.

    ``update(posterior, theta, x)`` stores the pairs with one posterior draw
    :math:`\tilde\theta_i \sim q(\cdot \mid x_i)` each; the first update after ``reset()``
    also draws the :math:`N_v` evaluation samples :math:`\theta_j \sim q(\cdot \mid x_o)`
    at every reference observation (under DDP, each process draws its own and they are
    pooled). ``compute()`` trains, in one batched fit, the classifier between
    :math:`(\theta^*_i, x_i)` and :math:`(\tilde\theta_i, x_i)` and ``num_null`` classifiers
    on the same rows with labels swapped at random within pairs.

    Cost: the null depends on the posterior, so every check trains
    ``(num_null + 1) * num_ensemble`` classifiers (L-C2ST-NF: ``num_ensemble``).
    Posterior draws use torch's global random state: seed it for reproducible draws.
    The classifiers and label swaps of a check are seeded by ``seed``, the check counter
    and the digest of its pairs (see :class:`LC2STNF`): the observed classifier and the
    ``num_null`` null classifiers have i.i.d. randomness, fresh at every check.

    Arguments: as :class:`LC2STNF`, ``embedding`` included (the classifiers see
    ``(embedding(x), theta)``; the null is retrained at every check anyway).
    ``compute()`` returns an :class:`LC2STResult` whose ``samples`` are the evaluation
    draws.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(500, torch.Generator().manual_seed(0))
        >>> metric = LC2ST(observations=x[:2], num_null=20, num_posterior_samples=1000)
        >>> _ = torch.manual_seed(0)
        >>> metric.update(toy.posterior(shift=1.0), theta, x)
        >>> metric.compute().p_value
        tensor([0.0476, 0.0476])

    References:
        Linhart, Gramfort, Rodrigues. "L-C2ST: Local Diagnostics for Posterior
        Approximations in Simulation-Based Inference." NeurIPS 2023, section 3.
    """

    theta: list[Tensor]
    posterior_theta: list[Tensor]
    x: list[Tensor]
    eval_theta: list[Tensor]

    def __init__(self, observations: Tensor, *args: Any, **kwargs: Any) -> None:
        super().__init__(observations, *args, **kwargs)
        for name in ("theta", "posterior_theta", "x", "eval_theta"):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(self, posterior: Posterior | object, theta: Tensor, x: Tensor) -> None:
        """Store pairs ``theta (N, D)``, ``x (N, *X)`` with one posterior draw per pair."""
        theta, x = check_pairs(theta, x)
        flat = self._check_features(x, self.x, posterior)
        check_event_size(posterior, theta, x)
        keep = room_for_rows(self, theta.shape[0], self.theta)
        if not self.eval_theta:  # (N_v, O, D)
            observations = self.observations.to(x)
            self.eval_theta.append(draws(posterior, observations, self.num_posterior_samples))
        if keep:
            self.theta.append(theta[:keep].detach())
            self.posterior_theta.append(draws(posterior, x[:keep], 1)[0])
            self.x.append(flat[:keep].detach())

    def compute(self) -> LC2STResult:
        """Statistic, p-value, probabilities, evaluation ``samples`` and PP-plot data."""
        if isinstance(self.theta, list) and not self.theta:
            raise ValueError("LC2ST.compute() needs at least one update, got none")
        theta, drawn = dim_zero_cat(self.theta), dim_zero_cat(self.posterior_theta)
        x, samples = dim_zero_cat(self.x), dim_zero_cat(self.eval_theta).transpose(0, 1)
        order = canonical_order(torch.cat([x, theta, drawn], 1))
        theta, drawn, x = theta[order], drawn[order], x[order]
        if x.shape[0] < 2:
            raise ValueError(f"LC2ST needs at least N >= 2 calibration pairs, got N = {len(x)}")
        key = self._check_key(torch.cat([x, theta, drawn], 1))
        classifier = self._ensemble((1 + self.num_null) * self.num_ensemble, 2, key)
        lc2st_train(theta, drawn, x, classifier, self.num_null, self._generator(6, key))
        proba = lc2st_probabilities(
            classifier, samples, self.observation_features().to(x), self.num_ensemble
        )
        null_statistics, null_ecdf = lc2st_statistic(proba[1:]), pp_ecdf(proba[1:], self.pp_grid)
        return self._result(proba[0], null_statistics, null_ecdf, samples=samples)
