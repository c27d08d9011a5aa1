r"""L-C2ST-NF and L-C2ST as torchmetrics metrics: local tests at reference observations.

``update(posterior, theta, x)`` stores what the test needs from each calibration batch;
``compute()`` trains the classifier and returns one statistic and p-value per reference
observation, with the predicted probabilities and PP-plot data for
:mod:`calib_lightning.plots.lc2st`.

:class:`LC2STNF` keeps its null classifiers. They depend only on the calibration
observations, so they are trained once (one batched fit) and reused by every later
check of every posterior, also after ``state_dict`` / ``load_state_dict``. The metric
records a fingerprint (SHA-256) of the calibration ``x`` they were trained on and
refuses, with a :class:`ValueError`, to test data with other ``x``.

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

from calib_lightning._checks import check_matrix, check_pairs, check_positive
from calib_lightning._distributed import canonical_order, room_for_rows
from calib_lightning.evaluation import check_event_size, checked_samples
from calib_lightning.functional.lc2st import (
    lc2st_nf_null,
    lc2st_nf_train,
    lc2st_probabilities,
    lc2st_statistic,
    lc2st_train,
    pp_ecdf,
)
from calib_lightning.metrics._local_c2st import (
    LocalC2ST,
    check_observations,
    digest_words,
    fingerprint,
)
from calib_lightning.posteriors import Posterior, as_posterior

__all__ = ["LC2ST", "LC2STNF"]

_BUFFERS = (
    "observations",
    "eval_points",
    "null_fingerprint",
    "null_settings",
    "null_statistics",
    "null_ecdf",
)


class LC2STNF(LocalC2ST):
    r"""L-C2ST-NF: local test of a normalizing-flow posterior in its latent space, reusable null.

    ``update(posterior, theta, x)`` maps the true parameters to the flow's latent space,
    :math:`z^*_i = T_\phi^{-1}(\theta^*_i; x_i)` (``posterior.to_latent``), and stores them
    with ``x``. ``compute()`` trains one classifier (``num_ensemble`` members) between
    :math:`(z^*_i, x_i)` and :math:`(z_i, x_i)`, :math:`z_i \sim N(0, I)`, and evaluates
    :math:`T(x_o) = \frac{1}{N_v}\sum_j (d(z_j, x_o) - \frac12)^2` at fixed
    :math:`z_j \sim N(0, I)` for every reference observation.

    The ``num_null`` null classifiers (both classes normal draws) are trained by
    :meth:`fit_null`, or by the first ``compute()`` on its calibration ``x``, in one
    batched fit, and kept: their statistics at the reference observations are cached,
    so a later check costs one classifier fit and one inverse pass of the flow.

    Memory: per process at most ``max_samples`` pairs of ``D + X`` numbers; the null is
    ``num_null * num_ensemble`` small MLPs plus ``num_null x O x 101`` PP-curve values.
    Under DDP the pairs of all processes are gathered in a canonical order; every
    process then trains the same classifiers. :meth:`fit_null` takes the full
    calibration ``x`` (all processes' together).

    Arguments:
        observations: reference observations :math:`x_o`, shape ``(O, X)``.
        num_null: null classifiers ``H``.
        num_eval: evaluation points :math:`N_v`.
        num_ensemble: classifiers averaged per statistic (the null's trials likewise).
            Averaging removes classifier noise that the data did not cause. Measured
            (GaussianToy, N = 300, D = 2), power at 0.05 against twice the posterior
            variance: L-C2ST-NF 0.87 with 1 member, 1.00 with 5 (200 datasets, 100 null
            trials); L-C2ST 0.48 and 0.92 (60 datasets, 19 null trials); the same level.
            Five times the cost: for L-C2ST-NF the null (once) and a cheap check, for
            L-C2ST every check.
        classifier: ``"mlp"`` (batched :class:`~calib_lightning.classifiers.MLPEnsemble`),
            ``"sbibm"`` or a scikit-learn classifier (then ``state_dict`` holds the null's
            cached statistics but not the classifiers themselves).
        classifier_kwargs: :class:`~calib_lightning.classifiers.MLPEnsemble` settings.
        max_samples: per-process bound on stored pairs.
        confidence: coverage of the PP-plot's null band.
        seed: with the data, keys every random stream: evaluation points, normal draws,
            classifier initialisations, splits and batch orders. ``None`` draws it from
            fresh entropy (valid, not reproducible).

    Randomness and validity: the observed classifier is trained exactly as one null trial
    (same procedure, per-member early stopping, initialisation from the same law) and with
    randomness of its own, seeded by ``seed``, a check counter (``checks``, in the
    ``state_dict``; every ``compute()`` advances it) and the SHA-256 digest of the pairs
    it is trained on. Under :math:`H_0` the observed and null statistics are then
    exchangeable and the p-value is uniform at every check, over datasets too: two
    datasets never share classifier randomness, even through fresh metrics with the
    default seed, while the same data, seed and counter give the same result. (A fixed
    seed alone would freeze the observed classifier's randomness: the p-value would be
    conditional on one initialisation and split and not uniform.) The null classifiers
    depend on ``seed`` and the calibration ``x`` only.

    ``global_p_value``: one p-value for "calibrated at every observation", the Cauchy
    combination (:func:`~calib_lightning.functional.combine_p_values`) of ``p_value``.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(500, torch.Generator().manual_seed(0))
        >>> metric = LC2STNF(observations=x[:2], num_null=20, num_eval=1000)
        >>> metric.update(toy.posterior(variance_scale=3.0), theta, x)
        >>> out = metric.compute()
        >>> out["p_value"], out["global_p_value"]
        (tensor([0.0476, 0.0476]), tensor(0.0476))

    References:
        Linhart, Gramfort, Rodrigues. "L-C2ST: Local Diagnostics for Posterior
        Approximations in Simulation-Based Inference." NeurIPS 2023, section 3.1.
    """

    latent: list[Tensor]
    x: list[Tensor]

    def __init__(self, observations: Tensor, *args: Any, **kwargs: Any) -> None:
        super().__init__(observations, *args, **kwargs)
        for name in _BUFFERS[1:]:
            dtype = torch.uint8 if name in ("null_fingerprint", "null_settings") else None
            dtype = dtype or self.observations.dtype
            self.register_buffer(name, torch.empty(0, dtype=dtype))
        self.null_classifier = self._ensemble(self.num_null * self.num_ensemble, stream=3)
        self.classifier = self._ensemble(self.num_ensemble, stream=2)
        self.add_state("latent", default=[], dist_reduce_fx="cat")
        self.add_state("x", default=[], dist_reduce_fx="cat")

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        for name in _BUFFERS:
            if prefix + name in state_dict:
                setattr(self, name, torch.empty_like(state_dict[prefix + name]))
        super()._load_from_state_dict(state_dict, prefix, *args)

    @property
    def null_fitted(self) -> bool:
        """Whether null classifiers (or their cached statistics) are available."""
        return self.null_fingerprint.numel() > 0

    def update(self, posterior: Posterior | object, theta: Tensor, x: Tensor) -> None:
        """Store :math:`z^* = T^{-1}(\\theta; x)` for pairs ``theta (N, D)``, ``x (N, *X)``."""
        theta, x = check_pairs(theta, x)
        flat = self._check_features(x)
        with torch.no_grad():
            latent = as_posterior(posterior).to_latent(theta, x)
        checked_samples(latent.unsqueeze(0))
        keep = room_for_rows(self, theta.shape[0], self.latent)
        if keep:
            self.latent.append(latent[:keep].detach())
            self.x.append(flat[:keep].detach())

    def fit_null(self, x: Tensor, dim: int) -> LC2STNF:
        """Train the null classifiers for calibration observations ``x (N, *X)``, ``D = dim``.

        Replaces any previous null. ``x`` must be the full calibration set later passed to
        :meth:`update` (in any order, split in any batches or processes).
        """
        x = check_matrix("x", x.reshape(x.shape[0], -1), min_rows=2)
        check_positive("dim", dim, integer=True)
        x = x[canonical_order(x)]
        key = digest_words(x)  # the null is a function of (seed, x): no check counter
        self.eval_points = torch.randn(
            self.num_eval, dim, generator=self._generator(1, key), dtype=x.dtype
        ).to(x.device)
        self.null_classifier = self._ensemble(self.num_null * self.num_ensemble, 3, key)
        lc2st_nf_null(x, dim, self.num_null, self.null_classifier, self._generator(4, key))
        self.null_fingerprint = fingerprint(x).to(x.device)
        self.null_settings = self.settings_fingerprint().to(x.device)
        self._cache_null()
        self._computed = None  # a cached compute() result used the old null
        return self

    def reset_null(self) -> None:
        """Forget the null; the next ``compute()`` trains a new one on its calibration ``x``."""
        self.null_fingerprint = self.null_fingerprint.new_empty(0)
        self.null_classifier = self._ensemble(self.num_null * self.num_ensemble, stream=3)
        self._computed = None

    def _cache_null(self) -> None:
        observations = self.flat_observations
        proba = lc2st_probabilities(
            self.null_classifier, self.eval_points.to(observations), observations, self.num_ensemble
        )
        self.null_statistics = lc2st_statistic(proba)
        self.null_ecdf = pp_ecdf(proba, self.pp_grid)

    def set_observations(self, observations: Tensor) -> None:
        """Test at new reference observations ``(O, *X)``, reusing the trained null classifiers."""
        check_observations(observations, self.flat_observations.shape[1])
        if self.null_fitted and not getattr(self.null_classifier, "fitted", False):
            raise ValueError(
                "set_observations needs the null classifiers themselves, but only their cached "
                "statistics were loaded (scikit-learn classifiers are not saved); call fit_null"
            )
        self.observations = observations.detach().clone().to(self.observations.device)
        if self.null_fitted:
            self._cache_null()
        self._computed = None

    def compute(self) -> dict[str, Tensor]:
        """Statistic, p-value, probabilities and PP-plot data, one row per observation."""
        if isinstance(self.latent, list) and not self.latent:
            raise ValueError("LC2STNF.compute() needs at least one update, got none")
        latent, x = dim_zero_cat(self.latent), dim_zero_cat(self.x)
        order = canonical_order(torch.cat([x, latent], 1))
        latent, x = latent[order], x[order]
        if x.shape[0] < 2:
            raise ValueError(f"LC2STNF needs at least N >= 2 calibration pairs, got N = {len(x)}")
        if not self.null_fitted:
            self.fit_null(x, latent.shape[1])
        elif not torch.equal(fingerprint(x).to(self.null_fingerprint), self.null_fingerprint):
            raise ValueError(
                "the calibration x passed to update() differ from the x the null classifiers "
                f"were trained on (N = {x.shape[0]} rows now); pass the same calibration set, "
                "or call fit_null(x, dim) / reset_null() to train a null for the new one"
            )
        elif not torch.equal(
            self.settings_fingerprint().to(self.null_settings), self.null_settings
        ):
            raise ValueError(
                "the null classifiers were trained with other classifier, classifier_kwargs, "
                "num_ensemble or num_eval settings than this metric's; the test needs the same "
                "procedure for both: build the metric with the null's settings or call fit_null"
            )
        elif latent.shape[1] != self.eval_points.shape[1] or len(self.null_statistics) != (
            self.num_null
        ):
            raise ValueError(
                f"the null was trained for D = {self.eval_points.shape[1]} parameters and "
                f"{len(self.null_statistics)} trials, got D = {latent.shape[1]} and "
                f"num_null = {self.num_null}"
            )
        # trained exactly as one null trial, with its own fresh randomness (see the class doc)
        key = self._check_key(torch.cat([x, latent], 1))
        self.classifier = self._ensemble(self.num_ensemble, 2, key)
        lc2st_nf_train(latent, x, self.classifier, self._generator(5, key))
        eval_points = self.eval_points.to(latent)
        proba = lc2st_probabilities(
            self.classifier, eval_points, self.flat_observations.to(latent), self.num_ensemble
        )[0]
        return self._result(proba, self.null_statistics, self.null_ecdf)

    @torch.no_grad()
    def probability_map(
        self, posterior: Posterior | object, num_samples: int = 10_000
    ) -> dict[str, Tensor]:
        r"""The last classifier's :math:`d` on posterior samples at each observation.

        Draws :math:`\theta_s \sim q(\cdot \mid x_o)` and evaluates :math:`d` at their latents
        :math:`T_\phi^{-1}(\theta_s; x_o)`: the data of the paper's Figure 4.

        Returns:
            ``"samples"`` ``(O, S, D)`` and ``"probabilities"`` ``(O, S)``.
        """
        if not getattr(self.classifier, "fitted", False):
            raise ValueError("probability_map needs a trained classifier; call compute() first")
        post = as_posterior(posterior)
        theta = post.sample(self.observations, num_samples)  # (S, O, D)
        latent = post.to_latent(theta, self.observations)
        proba = lc2st_probabilities(
            self.classifier, latent.transpose(0, 1), self.flat_observations, self.num_ensemble
        )[0]
        return {"samples": theta.transpose(0, 1), "probabilities": proba}


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

    Arguments: as :class:`LC2STNF`.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> toy = GaussianToy(dim=2)
        >>> theta, x = toy.sample(500, torch.Generator().manual_seed(0))
        >>> metric = LC2ST(observations=x[:2], num_null=20, num_eval=1000)
        >>> _ = torch.manual_seed(0)
        >>> metric.update(toy.posterior(shift=1.0), theta, x)
        >>> metric.compute()["p_value"]
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
        flat = self._check_features(x)
        post = as_posterior(posterior)
        check_event_size(post, theta, x)
        keep = room_for_rows(self, theta.shape[0], self.theta)
        with torch.no_grad():
            if not self.eval_theta:
                samples = post.sample(self.observations.to(x), self.num_eval)  # (N_v, O, D)
                checked_samples(samples)
                self.eval_theta.append(samples)
            if keep:
                drawn = post.sample(x[:keep], 1)
                checked_samples(drawn)
                self.theta.append(theta[:keep].detach())
                self.posterior_theta.append(drawn[0])
                self.x.append(flat[:keep].detach())

    def compute(self) -> dict[str, Tensor]:
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
            classifier, samples, self.flat_observations.to(x), self.num_ensemble
        )
        out = self._result(proba[0], lc2st_statistic(proba[1:]), pp_ecdf(proba[1:], self.pp_grid))
        out["samples"] = samples
        return out
