"""The local tests in ``cl.diagnose``: L-C2ST-NF (from the flow's latents) and L-C2ST (from
posterior draws, in L-C2ST-NF's place for a posterior without latents) at each
observation, Holm-corrected over the observations."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from calib_lightning.diagnosis._check import (
    Check,
    Direction,
    FigureInputs,
    Inputs,
    ObservationList,
    Outcome,
    observation_list,
    observations_phrase,
)
from calib_lightning.metrics import LC2ST, LC2STNF
from calib_lightning.metrics.lc2st import ProbabilityMap
from calib_lightning.posteriors.base import Posterior

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["MAP_NUM_POSTERIOR_SAMPLES", "LC2STCheck", "LC2STNFCheck", "local_num_null"]

#: posterior draws per observation of the probability maps
MAP_NUM_POSTERIOR_SAMPLES = 2000


def local_num_null(num_observations: int, level: float, default: int = 100) -> int:
    """Null classifiers for the local tests in ``diagnose``: enough for Holm to name one.

    The verdict lists observations by Holm-adjusted p-values; with ``H`` null
    classifiers the smallest is ``O / (1 + H)``. ``H = max(default, ceil(2 O / level))``
    keeps it at most ``level / 2``, so every observation can be named (100 up to
    ``O = 2.5`` at level 0.05; 200 for 5 observations, 400 for 10).

    Example:
        >>> local_num_null(3, 0.05), local_num_null(10, 0.05)
        (120, 400)
    """
    return max(default, math.ceil(2 * num_observations / level))


class LC2STNFCheck(Check):
    """:class:`~calib_lightning.LC2STNF` at the observations with :func:`local_num_null`
    null classifiers; keeps the classifier's probability maps on posterior draws."""

    name = "lc2st_nf"
    title = "L-C2ST-NF (local test at each observation)"
    words = "L-C2ST-NF"
    figure_words = "the PP-plots and probability maps"
    stream = 6
    needs = "to_latent"
    at_observations = True
    local = True
    metric = LC2STNF

    def run(self, posterior: Posterior, inputs: Inputs, common: Any, outcome: Outcome) -> Any:
        assert inputs.observations is not None
        metric = self.metric(
            observations=inputs.observations,
            level=inputs.level,
            seed=inputs.seed,
            embedding=inputs.embedding,
            num_null=local_num_null(inputs.observations.shape[0], inputs.level),
        )
        metric.update(posterior, inputs.theta, inputs.x)
        result = metric.compute()
        if outcome.maps is None:  # the classifier's output on posterior draws there
            outcome.maps = self._maps(metric, posterior, result)
        return result

    def _maps(self, metric: Any, posterior: Posterior, result: Any) -> ProbabilityMap:
        return metric.probability_map(posterior, MAP_NUM_POSTERIOR_SAMPLES)

    def observation_list(self, result: Any, level: float, gate: bool) -> ObservationList:
        return observation_list(self.name, result, level, gate)

    def finding(self, result: Any, observations: ObservationList | None, level: float) -> str:
        assert observations is not None
        if observations.named:
            return (
                f"wrong at {observations_phrase(observations.named)} "
                f"({_statistics(result, observations.named, level)})"
            )
        why = (
            ""
            if observations.can_reject
            else (
                f"; with {len(observations.p_value)} observations the smallest Holm-adjusted "
                f"p-value is {observations.smallest_adjusted:.2g}"
            )
        )
        return (
            f"{self.words} rejects over the observations together, at no single one "
            f"after Holm's correction{why}"
        )

    def cannot_reject(self, result: Any, smallest: float, level: float) -> str:
        return (
            f"{self.words} cannot reject with {result.null_statistics.shape[0]} null "
            f"classifiers: smallest p-value {smallest:.2g}, not below {level:g}"
        )

    def size(self, result: Any, directions: Sequence[Direction], level: float) -> str:
        null = torch.quantile(result.null_statistics.double(), 1 - level, dim=0).tolist()
        ratio = [float(t) / max(q, 1e-300) for t, q in zip(result.statistic, null, strict=True)]
        worst = max(range(len(ratio)), key=ratio.__getitem__)
        return (
            f"L-C2ST statistic {float(result.statistic[worst]):.3g} at observation "
            f"{worst}, {ratio[worst]:.2g} times its null {1 - level:.0%} quantile "
            f"{null[worst]:.3g} (the largest ratio)"
        )

    def figures(self, result: Any, inputs: FigureInputs) -> dict[str, Figure]:
        from calib_lightning.plots.lc2st import MAX_MAP_PARAMETERS, plot_pp, plot_probability_map

        adjusted = inputs.adjusted_p_values  # each panel judged as the verdict judges it
        out = {
            "lc2st_pp": plot_pp(result, level=inputs.level)
            if adjusted is None
            else plot_pp(result, level=inputs.level, adjusted_p_values=adjusted)
        }
        maps = inputs.probability_maps
        if maps is None:
            return out
        chosen = None if inputs.parameters is None else list(inputs.parameters)[:MAX_MAP_PARAMETERS]
        for o, (samples, probs) in enumerate(zip(maps.samples, maps.probabilities, strict=True)):
            title = f"{self.words} at observation {o}: p = {float(result.p_value[o]):.3g}"
            if adjusted is not None:
                title += f", Holm-adjusted p = {adjusted[o]:.3g}"
            pp = (result.pp_grid, result.pp_ecdf[o], result.pp_band[:, o])
            out[f"lc2st_probability_map_{o}"] = plot_probability_map(
                samples, probs, labels=inputs.labels, parameters=chosen, pp=pp, title=title
            )
        return out

    def caption(self, key: str) -> str | None:
        if key == "lc2st_pp":
            return (
                f"{self.words}: PP-plot at each observation (panels judged by "
                "Holm-adjusted p-values, as the verdict)"
            )
        if key.startswith("lc2st_probability_map_"):
            o = key.rsplit("_", 1)[1]
            return (
                f"{self.words} at observation {o}: where the estimator puts too much (red) or "
                "too little (blue) mass (white: consistent; hatched grey: no posterior draws; "
                "contours: the posterior's 50 % and 90 % HPD regions), and its PP-plot"
            )
        return None


class LC2STCheck(LC2STNFCheck):
    """:class:`~calib_lightning.LC2ST` at the observations: the same question from
    posterior draws (its null trained anew on them at every call); by default only where
    L-C2ST-NF gives no result (no latents)."""

    name = "lc2st"
    title = "L-C2ST (local test at each observation, from posterior draws)"
    words = "L-C2ST"
    stream = 12
    needs = None
    metric = LC2ST

    def _maps(self, metric: Any, posterior: Posterior, result: Any) -> ProbabilityMap:
        return ProbabilityMap(samples=result.samples, probabilities=result.probabilities)


def _statistics(result: Any, named: Sequence[int], level: float) -> str:
    values = ", ".join(f"{float(result.statistic[o]):.2g}" for o in named)
    null = torch.quantile(result.null_statistics.double(), 1 - level, dim=0)
    chance = max(float(null[o]) for o in named)
    return f"L-C2ST statistic {values}; null {1 - level:.0%} quantile at most {chance:.2g}"
