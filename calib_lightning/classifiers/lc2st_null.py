r"""The null of L-C2ST-NF: null classifiers of one calibration set, trained once and kept.

Under :math:`H_0` the flow's latents of the calibration pairs are :math:`N(0, I_D)` given
:math:`x_i`, so the L-C2ST-NF null classifiers see fresh normal draws in both classes and
depend on the calibration observations :math:`x_1..x_N` (and the settings) only. One
:class:`LC2STNFNull` trains them in one batched fit and serves every later check of every
posterior on the same calibration set, across runs through its ``state_dict``.

References:
    Linhart, Gramfort, Rodrigues. "L-C2ST: Local Diagnostics for Posterior
    Approximations in Simulation-Based Inference." NeurIPS 2023, section 3.1.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

from calib_lightning._utils.distributed import canonical_order
from calib_lightning._utils.validation import check_matrix, check_positive
from calib_lightning.classifiers._make import (
    NUM_EVALUATION_POINTS,
    Ensemble,
    local_test_kwargs,
    make_ensemble,
)
from calib_lightning.classifiers._seeds import (
    digest,
    digest_words,
    fingerprint,
    generator,
    stream_seed,
)
from calib_lightning.classifiers.local_c2st import (
    latent_features,
    lc2st_nf_null,
    lc2st_probabilities,
)
from calib_lightning.functional.lc2st import lc2st_statistic, pp_ecdf

__all__ = ["LC2STNFNull"]

_DTYPES = {"x_fingerprint": torch.uint8, "settings": torch.uint8, "observations_key": torch.long}
_BUFFERS = (*_DTYPES, "eval_points", "null_statistics", "null_ecdf")


class LC2STNFNull(nn.Module):
    r"""``H`` L-C2ST-NF null classifiers for one calibration set, their evaluation points
    and their statistics at the reference observations.

    :meth:`fit` draws the :math:`N_v` evaluation points :math:`z_j \sim N(0, I_D)` and
    trains the ``H * E`` null classifiers (both classes normal draws, with the calibration
    :math:`x_i`) in one batched fit. :meth:`statistics` evaluates them at reference
    observations and caches the result, keyed by the observations. Everything is seeded
    by ``seed`` and the SHA-256 digest of the calibration ``x`` (no check counter): the
    null is a function of ``(seed, x, settings)``.

    A fitted null carries its fingerprint: the digest of the calibration ``x`` it was
    trained on (:attr:`x_fingerprint`) and of its settings (:attr:`settings`);
    :meth:`check` refuses other data or settings.

    Saving: ``state_dict`` holds the fingerprint, the evaluation points, the cached
    statistics and, for the default ``"mlp"`` classifiers, the classifiers themselves
    (scikit-learn classifiers are not saved: the loaded null then serves its cached
    observations only). :meth:`save` / :meth:`load` write and read it with
    ``torch.load(..., weights_only=True)``.

    Arguments:
        num_null: null trials ``H``.
        num_posterior_samples: evaluation points :math:`N_v` per observation.
        num_ensemble: classifiers ``E`` averaged per trial.
        classifier: ``"mlp"``, ``"sbibm"`` or a scikit-learn classifier
            (:func:`~calib_lightning.classifiers.make_ensemble`).
        classifier_kwargs: :class:`~calib_lightning.classifiers.MLPEnsemble` settings.
        seed: seeds the evaluation points, the normal draws and the classifiers.
        norm_feature: the classifiers also see the latent's squared norm
            (:func:`~calib_lightning.classifiers.local_c2st.latent_features`).

    Attributes:
        eval_points: :math:`z_j`, ``(N_v, D)`` (empty before :meth:`fit`).
        x_fingerprint: SHA-256 of the calibration ``x``, ``(32,)`` ``uint8`` (empty
            before :meth:`fit`).
        settings: SHA-256 of the settings the null was trained with, ``(32,)`` ``uint8``.
        null_statistics: the cached ``(H, O)`` statistics of :meth:`statistics`, and
        null_ecdf: the cached ``(H, O, G)`` PP-curves, for the observations and grid whose
            digest is ``observations_key``.

    Example:
        >>> from calib_lightning.tasks import GaussianToy
        >>> _, x = GaussianToy(dim=2).sample(200, torch.Generator().manual_seed(0))
        >>> null = LC2STNFNull(num_null=10, num_posterior_samples=100).fit(x, dim=2)
        >>> statistics, ecdf = null.statistics(x[:3], torch.linspace(0, 1, 11))
        >>> statistics.shape, ecdf.shape
        (torch.Size([10, 3]), torch.Size([10, 3, 11]))
    """

    def __init__(
        self,
        num_null: int = 100,
        num_posterior_samples: int = NUM_EVALUATION_POINTS,
        num_ensemble: int = 1,
        classifier: str | Any = "mlp",
        classifier_kwargs: dict[str, Any] | None = None,
        seed: int = 0,
        norm_feature: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_null", num_null),
            ("num_posterior_samples", num_posterior_samples),
            ("num_ensemble", num_ensemble),
        ):
            check_positive(name, value, integer=True)
        self.num_null, self.num_posterior_samples = num_null, num_posterior_samples
        if not isinstance(norm_feature, bool):
            raise ValueError(f"norm_feature must be True or False, got {norm_feature!r}")
        self.num_ensemble, self.seed, self.norm_feature = num_ensemble, seed, norm_feature
        self.classifier_spec = classifier
        self.classifier_kwargs = local_test_kwargs(classifier, classifier_kwargs)
        for name in _BUFFERS:
            self.register_buffer(name, torch.empty(0, dtype=_DTYPES.get(name)))
        self.classifier: Ensemble = self._ensemble()

    def _ensemble(self, key: list[int] | None = None) -> Ensemble:
        seed = stream_seed(self.seed, 3, *(key or []))
        members = self.num_null * self.num_ensemble
        return make_ensemble(self.classifier_spec, members, seed, **self.classifier_kwargs)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        for name in _BUFFERS:  # a fitted null's buffers have other shapes than empty ones
            if prefix + name in state_dict:
                setattr(self, name, torch.empty_like(state_dict[prefix + name]))
        super()._load_from_state_dict(state_dict, prefix, *args)

    @property
    def fitted(self) -> bool:
        """Whether the null was trained (or a trained null's state was loaded)."""
        return self.x_fingerprint.numel() > 0

    def settings_fingerprint(self) -> Tensor:
        """SHA-256 of the settings, ``(32,)`` ``uint8``: what a null must share with the
        checks it serves (not the seed)."""
        kwargs = sorted(self.classifier_kwargs.items())
        text = (
            f"{self.classifier_spec!r}|{kwargs}|{self.num_ensemble}|"
            f"{self.num_posterior_samples}|{self.num_null}"
        ) + ("|norm" if self.norm_feature else "")  # (without it: the digests saved before)
        return digest(text.encode())

    def fit(self, x: Tensor, dim: int) -> LC2STNFNull:
        """Train the null for calibration observations ``x (N, *X)`` and ``D = dim``.

        ``x`` are the classifier's features: the observations flattened, or their
        embedding when the metric has one (then the fingerprint is of the features, and
        a changed embedding needs a new null).

        Replaces any previous null. ``x`` must be the full calibration set later tested
        (in any order, split in any batches or processes).
        """
        x = check_matrix("x", x.reshape(x.shape[0], -1), min_rows=2)
        check_positive("dim", dim, integer=True)
        x = x[canonical_order(x)]
        key = digest_words(x)
        points = torch.randn(
            self.num_posterior_samples, dim, generator=generator(self.seed, 1, *key), dtype=x.dtype
        )
        self.eval_points = points.to(x.device)
        self.classifier = self._ensemble(key)
        lc2st_nf_null(
            x, dim, self.num_null, self.classifier, generator(self.seed, 4, *key), self.norm_feature
        )
        self.x_fingerprint = fingerprint(x).to(x.device)
        self.settings = self.settings_fingerprint().to(x.device)
        self._forget_statistics()
        return self

    def reset(self) -> None:
        """Forget the null (classifiers, evaluation points, cache)."""
        self.x_fingerprint = self.x_fingerprint.new_empty(0)
        self.eval_points = self.eval_points.new_empty(0)
        self.classifier = self._ensemble()
        self._forget_statistics()

    def _forget_statistics(self) -> None:
        self.observations_key = self.observations_key.new_empty(0)
        self.null_statistics = self.null_statistics.new_empty(0)
        self.null_ecdf = self.null_ecdf.new_empty(0)

    def trained_on(self, x: Tensor) -> bool:
        """Whether the null was trained on calibration observations (or features) ``x``
        (any row order): their fingerprint equals :attr:`x_fingerprint`."""
        return self.fitted and torch.equal(
            fingerprint(x).to(self.x_fingerprint), self.x_fingerprint
        )

    def check(self, x: Tensor, dim: int) -> None:
        """Raise unless the null was trained on calibration observations ``x (N, *X)``, for
        ``D = dim`` and with this null's settings."""
        if not self.fitted:
            raise ValueError("the null is not trained: call fit(x, dim) first")
        if not self.trained_on(x):
            raise ValueError(
                "the calibration x passed to update() differ from the x the null classifiers "
                f"were trained on (N = {x.shape[0]} rows now); pass the same calibration set, "
                "or call metric.null.fit(x, dim) / metric.null.reset() to train a null for "
                "the new one"
            )
        if not torch.equal(self.settings_fingerprint().to(self.settings), self.settings):
            raise ValueError(
                "the null classifiers were trained with other classifier, classifier_kwargs, "
                "num_ensemble, num_posterior_samples, num_null or norm_feature settings than "
                "this metric's; "
                "the test needs the same procedure for both: build the metric with the null's "
                "settings or call metric.null.fit(x, dim)"
            )
        if self.eval_points.shape[1] != dim:
            raise ValueError(
                f"the null was trained for D = {self.eval_points.shape[1]} parameters, "
                f"got D = {dim}"
            )

    def statistics(self, observations: Tensor, grid: Tensor) -> tuple[Tensor, Tensor]:
        """The null statistics and PP-curves at reference observations, cached.

        Arguments:
            observations: :math:`x_o`, ``(O, X)`` (flattened features).
            grid: levels of the PP-curves, ``(G,)``.

        Returns:
            ``(H, O)`` null statistics and ``(H, O, G)`` null PP-curves
            (:func:`~calib_lightning.functional.pp_ecdf`).
        """
        words = digest_words(observations, grid[:, None])
        key = torch.tensor(words, dtype=torch.long, device=self.observations_key.device)
        if self.null_statistics.numel() and torch.equal(key, self.observations_key):
            return self.null_statistics.to(observations), self.null_ecdf.to(observations)
        if not self.fitted:
            raise ValueError("the null is not trained: call fit(x, dim) first")
        if not getattr(self.classifier, "fitted", False):
            raise ValueError(
                "new observations need the null classifiers themselves, but only their cached "
                "statistics were loaded (scikit-learn classifiers are not saved); call "
                "metric.null.fit(x, dim)"
            )
        points = latent_features(self.eval_points.to(observations), self.norm_feature)
        proba = lc2st_probabilities(self.classifier, points, observations, self.num_ensemble)
        self.null_statistics, self.null_ecdf = lc2st_statistic(proba), pp_ecdf(proba, grid)
        self.observations_key = key
        return self.null_statistics, self.null_ecdf

    def save(self, path: str | os.PathLike) -> None:
        """Write the ``state_dict`` to ``path`` (``torch.save``)."""
        torch.save(self.state_dict(), path)

    def load(self, path: str | os.PathLike) -> LC2STNFNull:
        """Load a ``state_dict`` written by :meth:`save` (``weights_only=True``), onto this
        null's device; the settings are checked when the null is used (:meth:`check`)."""
        device = self.x_fingerprint.device
        self.load_state_dict(torch.load(path, map_location=device, weights_only=True))
        return self
