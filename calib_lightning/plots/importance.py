r"""The expected-coverage figure of an unnormalized posterior (importance-sampled HPD credibility).

:func:`plot_importance_coverage` draws the result of :class:`calib_lightning.ImportanceCoverage`
with the coverage figure of the rank checks (:func:`~calib_lightning.plots.plot_expected_coverage`):
the ECDF of the credibilities against the level, the simultaneous band of ``N`` uniform
values (:func:`~calib_lightning.functional.bands.simultaneous_band`), over- and
under-confident regions labelled by the package's sign convention, and the effective
sample size in the title. When the result cannot judge (median ESS below ``min_ess``)
the curve is still drawn, and the title says why it is not a verdict.

References:
    Hermans et al. "A trust crisis in simulation-based inference? Your posterior
    approximations can be unfaithful." TMLR (2022).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from matplotlib.figure import Figure
from matplotlib.text import Text

from calib_lightning._utils.validation import check_probability
from calib_lightning.functional.bands import simultaneous_band
from calib_lightning.functional.importance import ImportanceCoverageResult
from calib_lightning.plots.ranks import plot_expected_coverage

__all__ = ["plot_importance_coverage"]


def plot_importance_coverage(
    result: ImportanceCoverageResult,
    *,
    level: float = 0.05,
    figsize: tuple[float, float] = (4.8, 4.6),
) -> Figure:
    r"""Expected coverage of the HPD regions of an unnormalized posterior.

    The curve is ``result.coverage`` (fraction of pairs whose credibility
    :math:`c \le` level) at ``result.levels``; above the diagonal the regions cover more
    often than claimed (under-confident), below less often (over-confident). The grey
    band holds the whole curve of a calibrated posterior with probability at least
    ``1 - level``.

    Arguments:
        result: :class:`~calib_lightning.functional.importance.ImportanceCoverageResult`
            (``ImportanceCoverage.compute()``).
        level: :math:`\alpha` of the band.
        figsize: figure size in inches.

    Returns:
        The figure.
    """
    if not isinstance(result, ImportanceCoverageResult):
        raise ValueError(
            f"result must be an ImportanceCoverageResult (ImportanceCoverage.compute()), got "
            f"{type(result).__name__}"
        )
    check_probability("level", level)
    levels = result.levels.detach().cpu().double()
    lower, upper, _ = simultaneous_band(levels, int(result.num_pairs), level)
    error = result.coverage_error.detach().cpu()
    summary = SimpleNamespace(
        levels=levels,
        coverage=result.coverage.detach().cpu().double(),
        simultaneous_band=torch.stack([lower, upper]),
        coverage_error=error,
        level=torch.tensor(level),
        joint_statistic="energy",
    )
    figure = plot_expected_coverage(summary, figsize=figsize)  # type: ignore[arg-type]
    ess = (
        f"ESS median {float(result.ess_median):.0f}, min {float(result.ess_min):.0f}, "
        f"{int(result.num_pairs)} pairs"
    )
    judged = result.cannot_judge is None
    for text in figure.findobj(Text):
        value = text.get_text()
        if value.startswith("Expected coverage ("):
            verdict = (
                value.split("\n", 1)[1] if judged else ("cannot judge: the ESS is below min_ess")
            )
            value = f"Expected coverage (importance sampling)\n{verdict}\n{ess}"
        elif not judged and "signed area +nan" in value:
            value = value.replace("signed area +nan", "not judged")
        text.set_text(value)
    return figure
