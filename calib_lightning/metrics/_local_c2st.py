r"""Machinery shared by the L-C2ST metrics: settings, per-check seeds, typed results.

Every random stream of a check is keyed by the metric's ``seed``, a check counter
(``checks``, in the ``state_dict``, advanced by every ``compute()``) and the digest of the
data its classifiers are trained on (:mod:`calib_lightning.classifiers._seeds` says why:
the observed and null statistics must be exchangeable under :math:`H_0` at every check).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from calib_lightning._utils.validation import check_matrix, check_positive, check_probability
from calib_lightning.classifiers import make_ensemble
from calib_lightning.classifiers._make import NUM_EVALUATION_POINTS, local_test_kwargs
from calib_lightning.classifiers._seeds import digest_words, generator, stream_seed
from calib_lightning.evaluation import embed
from calib_lightning.functional.combine import combine_p_values
from calib_lightning.functional.lc2st import lc2st_p_value, lc2st_statistic, pp_band, pp_ecdf
from calib_lightning.metrics._shapes import KeepShapes
from calib_lightning.posteriors import Posterior, as_posterior
from calib_lightning.results import Result

__all__ = ["LC2STResult", "LocalC2ST", "ProbabilityMap", "check_observations"]


def _context_shape(posterior: Any, x: Tensor) -> tuple[int, ...] | None:
    """The shape of one observation the posterior was built for, when it tells (else
    ``None``: a plain callable, a module with an embedding net, samples); its error first
    when ``x (N, *X)`` is shaped for another reading of the model."""
    if posterior is None or isinstance(posterior, Tensor):
        return None
    try:
        post = as_posterior(posterior)
    except ValueError:  # the evaluation reports it
        return None
    post = getattr(post, "posterior", post)  # shared draws wrap the posterior
    if isinstance(post, Posterior):
        post.check_reading(None, x)
    shape = post.context_shape() if isinstance(post, Posterior) else None
    return None if shape is None else tuple(shape)


@dataclass(eq=False)
class LC2STResult(Result):
    r"""Result of :class:`~calib_lightning.LC2STNF` and :class:`~calib_lightning.LC2ST`.

    ``O`` reference observations, ``N_v`` evaluation points per observation, ``H`` null
    trials, ``G = 101`` levels of the PP-curves.

    Attributes:
        statistic: :math:`T(x_o) = \frac{1}{N_v} \sum_j (d(\theta_j, x_o) - \frac12)^2`,
            ``(O,)``.
        p_value: :math:`(1 + \#\{T_h \ge T\}) / (1 + H)` per observation, ``(O,)``.
        global_p_value: Cauchy combination of ``p_value`` (the verdict: calibrated at
            every observation), ``()``.
        probabilities: classifier outputs :math:`d(\theta_j, x_o)` at the evaluation
            points, ``(O, N_v)``.
        null_statistics: statistics of the null classifiers, ``(H, O)``.
        pp_grid: levels :math:`\alpha` of the PP-curves, ``(G,)``.
        pp_ecdf: empirical CDF of ``probabilities`` on ``pp_grid``, ``(O, G)``.
        pp_band: pointwise band of the null classifiers' PP-curves covering
            ``1 - level`` of them, lower and upper, ``(2, O, G)``.
        samples: L-C2ST only: the evaluation draws
            :math:`\theta_j \sim q(\cdot \mid x_o)`, ``(O, N_v, D)``; ``None`` for
            L-C2ST-NF (its evaluation points are normal draws in the latent space).

    ``smallest_p_value`` is the smallest attainable ``p_value`` (and ``global_p_value``),
    :math:`1 / (1 + H)`: with ``H = 100``, Holm's correction over more than five
    observations can reject none of them at 0.05.
    """

    logged = ("global_p_value", "statistic", "p_value")
    verdict = "global_p_value"

    statistic: Tensor
    p_value: Tensor
    global_p_value: Tensor
    probabilities: Tensor
    null_statistics: Tensor
    pp_grid: Tensor
    pp_ecdf: Tensor
    pp_band: Tensor
    samples: Tensor | None = None

    @property
    def smallest_p_value(self) -> float:
        """:math:`1 / (1 + H)`, the smallest p-value ``H`` null trials can give."""
        return 1.0 / (1 + self.null_statistics.shape[0])

    @property
    def p_value_error(self) -> Tensor:
        r"""``(O,)`` Monte Carlo standard error of each ``p_value`` from its ``H`` null
        classifiers, :math:`\sqrt{p (1 - p) / H}` (the observed classifier's own
        randomness comes on top: ``examples/benchmarks/results/seed_stability.md``)."""
        p = self.p_value.double()
        return (p * (1 - p) / self.null_statistics.shape[0]).sqrt()

    @property
    def global_p_value_error(self) -> Tensor:
        """``()`` the same for ``global_p_value``."""
        p = self.global_p_value.double()
        return (p * (1 - p) / self.null_statistics.shape[0]).sqrt()


@dataclass(eq=False)
class ProbabilityMap(Result):
    r"""The classifier's :math:`d` on posterior draws at each reference observation
    (:meth:`~calib_lightning.LC2STNF.probability_map`; the data of the paper's Figure 4).

    Attributes:
        samples: :math:`\theta_s \sim q(\cdot \mid x_o)`, ``(O, S, D)``.
        probabilities: :math:`d` at the samples' latents, ``(O, S)``.
    """

    samples: Tensor
    probabilities: Tensor


def check_observations(observations: Tensor, features: int | None = None) -> Tensor:
    """Reference observations ``(O, *X)`` (with ``X`` = ``features`` when given), as ``(O, X)``."""
    width = observations.shape[1:].numel() if isinstance(observations, Tensor) else None
    if width is None or observations.ndim < 2 or features not in (None, width):
        got = tuple(observations.shape) if isinstance(observations, Tensor) else observations
        expected = "(O, X) or (O, *X)" if features is None else f"(O, *X) with {features} features"
        raise ValueError(f"observations must have shape {expected}, got {got}")
    return check_matrix("observations", observations.reshape(observations.shape[0], width))


class LocalC2ST(KeepShapes):
    """Shared machinery: reference observations, classifier settings, PP-plot output."""

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(
        self,
        observations: Tensor,
        num_null: int = 100,
        num_posterior_samples: int = NUM_EVALUATION_POINTS,
        num_ensemble: int = 1,
        classifier: str | Any = "mlp",
        classifier_kwargs: dict[str, Any] | None = None,
        max_pairs: int = 100_000,
        level: float = 0.05,
        seed: int | None = 0,
        embedding: Callable[[Tensor], Tensor] | None = None,
        embedding_batch_size: int = 1024,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_observations(observations)
        check_positive("embedding_batch_size", embedding_batch_size, integer=True)
        self.embedding_batch_size = embedding_batch_size
        self.set_embedding(embedding)
        if seed is None:  # fresh entropy: valid, not reproducible
            seed = int(np.random.SeedSequence().entropy) % 2**63
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
        for name, value in (
            ("num_null", num_null),
            ("num_posterior_samples", num_posterior_samples),
            ("num_ensemble", num_ensemble),
            ("max_pairs", max_pairs),
        ):
            check_positive(name, value, integer=True)
        check_probability("level", level)
        self.num_null, self.num_ensemble = num_null, num_ensemble
        self.num_posterior_samples = num_posterior_samples
        self.classifier_spec = classifier
        self.classifier_kwargs = local_test_kwargs(classifier, classifier_kwargs)
        self.max_pairs, self.level, self.seed = max_pairs, level, seed
        make_ensemble(classifier, 1, **self.classifier_kwargs)  # validate the specification
        self.register_buffer("observations", observations.detach().clone())
        self.register_buffer(
            "pp_grid", torch.linspace(0, 1, 101, dtype=observations.dtype), persistent=False
        )
        # checks run so far: keys the random streams of the next one (saved and restored)
        self.register_buffer("checks", torch.zeros((), dtype=torch.long))
        self._warned = False

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        if prefix + "observations" in state_dict:  # set_observations may have changed O
            self.observations = torch.empty_like(state_dict[prefix + "observations"])
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _ensemble(self, members: int, stream: int, key: list[int] | None = None) -> Any:
        """``members`` classifiers seeded by stream ``stream`` and the data key ``key``."""
        seed = stream_seed(self.seed, stream, *(key or []))
        return make_ensemble(self.classifier_spec, members, seed, **self.classifier_kwargs)

    def _generator(self, stream: int, key: list[int]) -> torch.Generator:
        return generator(self.seed, stream, *key)

    def _check_key(self, *data: Tensor) -> list[int]:
        """Key of this check's random streams: the counter and the digest of ``data``."""
        return [int(self.checks), *digest_words(*data)]

    @property
    def embedding(self) -> Callable[[Tensor], Tensor] | None:
        """The embedding network applied to ``x`` and the observations (``None``: flatten)."""
        return self._embedding[0]

    def set_embedding(self, embedding: Callable[[Tensor], Tensor] | None) -> None:
        """Use ``embedding`` (``nn.Module`` or callable ``(n, *X) -> (n, F)``, or ``None``)
        from the next :meth:`update` on.

        The embedding is held by reference, not as a submodule: it is neither in the
        metric's ``state_dict`` nor moved by ``metric.to``. Features are computed once per
        ``x`` (:func:`~calib_lightning.evaluation.embed`), before any classifier trains.
        """
        if embedding is not None and not callable(embedding):
            raise ValueError(
                f"embedding must be an nn.Module, a callable x -> features or None, "
                f"got {embedding!r:.60}"
            )
        self._embedding = (embedding,)  # a tuple: not registered as a submodule

    @property
    def flat_observations(self) -> Tensor:
        """The reference observations flattened, ``(O, X)``."""
        return self.observations.reshape(self.observations.shape[0], -1)

    def observation_features(self) -> Tensor:
        """The classifier's features of the reference observations, ``(O, F)``:
        ``embedding(observations)``, or the observations flattened without an embedding."""
        return self._embed(self.observations, "observations")

    def _embed(self, x: Tensor, name: str) -> Tensor:
        return embed(self.embedding, x, self.embedding_batch_size, name=name)

    def _check_features(self, x: Tensor, stored: list[Tensor], posterior: Any = None) -> Tensor:
        """The classifier's features of ``x (N, *X)``, ``(N, F)``.

        Without an embedding, ``x`` flattened, with the observations' width; with one,
        ``x`` must have the observations' shape ``*X`` and the same width ``F`` as the
        features already stored. When the ``posterior`` tells the context shape it was
        built for, ``x`` is checked against it first, and a mismatch between ``x`` and the
        observations then names the observations.
        """
        context = _context_shape(posterior, x)
        if context is not None and tuple(x.shape[1:]) != context:
            raise ValueError(
                f"x must have shape (N, {', '.join(map(str, context))}) for this posterior's "
                f"context, got {tuple(x.shape)}"
            )
        if context is not None and tuple(self.observations.shape[1:]) != context:
            raise ValueError(
                f"observations must have shape (O, {', '.join(map(str, context))}) like x "
                f"and the posterior's context, got {tuple(self.observations.shape)}"
            )
        if self.embedding is None:
            flat = x.reshape(x.shape[0], -1)
            if flat.shape[1] != self.flat_observations.shape[1]:
                raise ValueError(
                    f"x must have X = {self.flat_observations.shape[1]} features like "
                    f"observations, got shape {tuple(x.shape)}"
                )
            return flat
        if x.shape[1:] != self.observations.shape[1:]:
            raise ValueError(
                f"x must have the observations' shape (N, "
                f"{', '.join(map(str, self.observations.shape[1:]))}) when an embedding is "
                f"given, got {tuple(x.shape)}"
            )
        features = self._embed(x, "x")
        if isinstance(stored, list) and stored and stored[0].shape[1] != features.shape[1]:
            raise ValueError(
                f"embedding(x) must keep its width F = {stored[0].shape[1]} across updates, "
                f"got F = {features.shape[1]}"
            )
        return features

    def reset(self) -> None:
        super().reset()
        self._warned = False

    def forward(self, *args: Any, **kwargs: Any) -> None:
        """Accumulate the batch (as :meth:`update`); a per-batch test would need its own null."""
        self.update(*args, **kwargs)

    def _result(
        self,
        probabilities: Tensor,
        null_statistics: Tensor,
        null_ecdf: Tensor,
        samples: Tensor | None = None,
    ) -> LC2STResult:
        statistic = lc2st_statistic(probabilities)
        p_value = lc2st_p_value(statistic, null_statistics)
        self.checks += 1  # the next check draws fresh classifier randomness
        return LC2STResult(
            statistic=statistic,
            p_value=p_value,
            global_p_value=combine_p_values(p_value, dim=-1).to(p_value.dtype),
            probabilities=probabilities,
            null_statistics=null_statistics,
            pp_grid=self.pp_grid,
            pp_ecdf=pp_ecdf(probabilities, self.pp_grid),
            pp_band=pp_band(null_ecdf, self.level),
            samples=samples,
        )
