r"""A posterior restricted to the prior's support: what fixes the leakage ``cl.diagnose`` finds.

A flow puts mass wherever its base does, so on a bounded prior (sbi's ``BoxUniform``)
part of :math:`q(\theta \mid x)` can fall where the true posterior has none (the check
``support`` of ``cl.diagnose``). :class:`TruncatedPosterior` keeps the part inside the
support :math:`S` and renormalizes it:

.. math::
    q_S(\theta \mid x) = \frac{q(\theta \mid x)\, 1[\theta \in S]}{Z(x)}, \qquad
    Z(x) = q(S \mid x).

**Guarantee.** The true posterior :math:`p(\cdot \mid x)` lives in :math:`S`, so for
every :math:`x`, :math:`\mathrm{KL}(p \,\|\, q_S) = \mathrm{KL}(p \,\|\, q) + \log Z(x)
\le \mathrm{KL}(p \,\|\, q)`: the expected held-out NLL falls by exactly
:math:`-\mathbb{E}[\log Z(x)] \ge 0`, and the total variation to the truth does not grow.
Nothing is fitted, so no held-out pair is spent.

Sampling rejects the draws outside :math:`S` (sbi's ``DirectPosterior`` does the same).
:math:`Z(x)` is estimated per observation as the share of ``num_normalizer_samples`` draws
inside :math:`S` (more where fewer than 100 fall inside), once per row of ``x``
and cached by the row's values, so that ``log_prob`` of a parameter and of the draws at the
same observation share one normalizer (the ranks compare them). The truncated posterior
has no latent space (it is not the push-forward of a normal by the flow), so the latent
checks (``LatentCalibration``, ``LC2STNF``) do not apply to it; every sampling and
density check does.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from calib_lightning._utils.chunks import pair_blocks
from calib_lightning._utils.prior import not_a_prior, outside_support
from calib_lightning._utils.validation import check_positive
from calib_lightning.evaluation import draws as budgeted_draws
from calib_lightning.evaluation import draws_and_log_probs
from calib_lightning.posteriors import supports, unsupported
from calib_lightning.posteriors.base import UnsupportedError
from calib_lightning.recalibration._module import PosteriorModule

__all__ = ["NoMassInsideError", "TruncatedPosterior"]

#: rows of ``x`` whose normalizer is kept (about 100 bytes each)
CACHE_ROWS = 200_000
#: draws inside the support the normalizer of a row is estimated from, at least
MIN_INSIDE = 100
#: a row whose share inside is below half of ``min_acceptance`` after this many times
#: ``1 / min_acceptance`` draws is given up (at exactly ``min_acceptance``, 30 draws
#: inside are expected and fewer than 15 come with probability 0.001)
GIVE_UP_COUNT = 30
#: candidate numbers drawn per round of rejection sampling or of the normalizer's
#: draws, at most (but one draw a row)
ROUND_NUMBERS = 2**24


class NoMassInsideError(UnsupportedError):
    """The posterior puts less than ``min_acceptance`` of its mass inside the support at
    an ``x``, so its restriction cannot be sampled there (an observation the prior cannot
    produce, say); a ``ValueError``, and ``cl.diagnose`` skips the check that asked for
    draws there with this message."""


class TruncatedPosterior(PosteriorModule):
    r"""``posterior`` restricted to ``prior``'s support and renormalized.

    Built by ``cl.recalibrate(..., prior=prior)`` (after its latent map), or directly;
    accepted by every metric, callback and ``cl.diagnose`` (the latent checks excepted).
    An ``nn.Module`` (:class:`~._module.PosteriorModule`): ``fixed(x)`` is the restricted
    distribution at ``x`` (a :class:`~._module.ConditionalDistribution`: ``log_prob``
    and ``sample``), and ``state_dict`` is the wrapped posterior's (``inner.*`` for a
    recalibrated one, else ``estimator.*``); the prior is not in it (give it again to
    the ``TruncatedPosterior`` you load into). The normalizers cached per ``x`` assume
    fixed weights: loading a state or switching between ``train()`` and ``eval()``
    clears them.

    Arguments:
        posterior: anything :func:`calib_lightning.as_posterior` accepts, with ``sample``
            (``log_prob`` and ``score`` are passed on when it has them).
        prior: a torch ``Distribution`` (its ``support``, e.g. sbi's ``BoxUniform``) or
            anything with ``log_prob`` (outside where it is not finite).
        num_normalizer_samples: draws per observation that estimate :math:`Z(x)`.
        min_acceptance: sampling stops with a :class:`NoMassInsideError` (a
            ``ValueError``) at an observation whose share of draws inside the support is
            below this after ``1 / min_acceptance`` draws per requested sample, or below
            half of it after :data:`GIVE_UP_COUNT` ``/ min_acceptance`` draws (a row with
            no mass inside is found after that many, whatever the number requested).

    Attributes:
        inner: the wrapped :class:`~calib_lightning.posteriors.Posterior`.
        prior: the prior.
        method: ``inner.method + "+support"`` for a recalibrated posterior, else
            ``"support"``.
        selection: ``inner.selection`` (what ``method="auto"`` scored), or ``None``.
        is_identity: always ``False``: the restriction changes the posterior wherever it
            puts mass outside the support (``inner.is_identity`` says whether the map
            before it changed anything).

    Example:
        >>> from torch.distributions import Independent, Normal, Uniform
        >>> box = Independent(Uniform(-torch.ones(2), torch.ones(2)), 1)
        >>> post = TruncatedPosterior(lambda x: Independent(Normal(x, 1.0), 1), box)
        >>> draws = post.sample(torch.zeros(3, 2), 500)
        >>> bool(draws.abs().max() <= 1)
        True
    """

    def __init__(
        self,
        posterior: Any,
        prior: Any,
        *,
        num_normalizer_samples: int = 1000,
        min_acceptance: float = 1e-5,
    ) -> None:
        check_positive("num_normalizer_samples", num_normalizer_samples, integer=True)
        if not 0 < min_acceptance < 1:
            raise ValueError(f"min_acceptance must be in (0, 1), got {min_acceptance!r}")
        if prior is None or not (hasattr(prior, "support") or hasattr(prior, "log_prob")):
            raise not_a_prior(prior)
        super().__init__(posterior)
        if not supports(self.inner, "sample"):
            raise unsupported(self.inner, "sample")
        self.prior, self.num_normalizer_samples = prior, num_normalizer_samples
        self.min_acceptance = min_acceptance
        self._log_z: OrderedDict[tuple, float] = OrderedDict()

    @property
    def method(self) -> str:
        """``inner.method + "+support"``, or ``"support"``."""
        inner_method = getattr(self.inner, "method", "")
        return f"{inner_method}+support" if inner_method else "support"

    @property
    def selection(self) -> Any:
        """``inner.selection``: what ``method="auto"`` scored, or ``None``."""
        return getattr(self.inner, "selection", None)

    @property
    def is_identity(self) -> bool:
        """``False``: restricted to the support, the posterior loses (and renormalizes)
        whatever mass it had outside; ``inner.is_identity`` is the map's."""
        return False

    def __repr__(self) -> str:
        return (
            f"TruncatedPosterior({self.inner!r}, prior={type(self.prior).__name__}; "
            "restricted to the prior's support)"
        )

    def clear_normalizer_cache(self) -> None:
        r"""Forget the cached :math:`\log \hat Z(x)` (after the wrapped weights changed)."""
        self._log_z.clear()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        self.clear_normalizer_cache()
        super()._load_from_state_dict(state_dict, prefix, *args)

    def train(self, mode: bool = True) -> TruncatedPosterior:
        self.clear_normalizer_cache()
        return super().train(mode)

    @property
    def capabilities(self) -> frozenset[str]:  # type: ignore[override]
        return self.inner.capabilities - {"to_latent"}

    def _outside(self, theta: Tensor) -> Tensor:
        return outside_support(self.prior, theta)

    def log_normalizer(self, x: Tensor) -> Tensor:
        r""":math:`\log \hat Z(x_i)` ``(N,)`` (float64, on the CPU), estimated once per row's
        values and cached: the log-share of the draws at the row inside the support, from
        ``num_normalizer_samples`` draws, doubled while fewer than :data:`MIN_INSIDE` are
        inside (relative standard error about :math:`1/\sqrt{100}`), up to
        ``num_normalizer_samples / min_acceptance``, or until a row is found below half of
        ``min_acceptance`` as sampling gives it up (a row with none inside then gets one
        count)."""
        values = x.detach().cpu().reshape(x.shape[0], -1).double().numpy()
        keys = [(str(x.dtype), hash(row.tobytes())) for row in values]
        missing = [i for i, key in enumerate(keys) if key not in self._log_z]
        m, cap = self.num_normalizer_samples, self.num_normalizer_samples / self.min_acceptance
        for block in pair_blocks(len(missing), m * (self.event_size() or 1)):
            rows = torch.as_tensor(missing[block])
            drawn, inside = torch.zeros(rows.numel()), torch.zeros(rows.numel())
            short, size = torch.arange(rows.numel()), m
            while short.numel():
                draws = budgeted_draws(self.inner, x[rows[short].to(x.device)], size)
                inside[short] += (~self._outside(draws)).sum(0).cpu().float()
                drawn[short] += size
                rare = self._given_up(drawn[short], inside[short])
                short = short[(inside[short] < MIN_INSIDE) & (drawn[short] * 2 <= cap) & ~rare]
                # doubling the draws, at most ROUND_NUMBERS numbers a round
                limit = ROUND_NUMBERS // max(1, short.numel() * (self.event_size() or 1))
                size = min(int(drawn[short].max()), max(1, limit)) if short.numel() else 0
            log_z = (inside.clamp_min(1) / drawn).log().tolist()
            self._log_z.update((keys[i], v) for i, v in zip(rows.tolist(), log_z, strict=True))
        out = torch.tensor([self._log_z[key] for key in keys], dtype=torch.float64)
        for key in keys:
            self._log_z.move_to_end(key)
        while len(self._log_z) > CACHE_ROWS:
            self._log_z.popitem(last=False)
        return out

    def log_prob(self, theta: Tensor, x: Tensor) -> Tensor:
        log_q = self.inner.log_prob(theta, x)
        log_z = self.log_normalizer(x).to(device=log_q.device, dtype=log_q.dtype)
        outside = self._outside(theta).to(log_q.device)
        return torch.where(outside, torch.full_like(log_q, -math.inf), log_q - log_z)

    def to_latent(self, theta: Tensor, x: Tensor) -> Tensor:
        raise unsupported(self, "to_latent")

    def log_prob_and_latent(self, theta: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        raise unsupported(self, "to_latent")

    def score(self, theta: Tensor, x: Tensor, *, create_graph: bool = False) -> Tensor:
        """The wrapped posterior's score: :math:`Z(x)` does not depend on ``theta``."""
        return self.inner.score(theta, x, create_graph=create_graph)

    def sample(self, x: Tensor, num_posterior_samples: int) -> Tensor:
        return self._draw(x, num_posterior_samples, with_log_prob=False)[0]

    def sample_and_log_prob(self, x: Tensor, num_posterior_samples: int) -> tuple[Tensor, Tensor]:
        theta, log_q = self._draw(x, num_posterior_samples, with_log_prob=True)
        log_z = self.log_normalizer(x).to(device=log_q.device, dtype=log_q.dtype)
        return theta, log_q - log_z

    def _draw(self, x: Tensor, num: int, with_log_prob: bool) -> tuple[Tensor, Tensor | None]:
        """``num`` draws per row inside the support by rejection ``(S, N, D)``, and the
        wrapped posterior's log-density of each (``with_log_prob``). Each round draws for
        the rows still short, grouped by their acceptance so far (within a factor 2), as
        many as each group's rows need at its lowest acceptance."""
        check_positive("num_posterior_samples", num, integer=True)
        n = x.shape[0]
        if n == 0:
            return (
                self.inner.sample_and_log_prob(x, num)
                if with_log_prob
                else (self.inner.sample(x, num), None)
            )
        state = {
            "filled": torch.zeros(n, dtype=torch.long),
            "drawn": torch.zeros(n),
            "accepted": torch.zeros(n),
            "theta": None,
            "log_q": None,
        }
        active = torch.arange(n)
        with torch.no_grad():
            while active.numel():
                rate = (state["accepted"][active] + 1) / (state["drawn"][active] + 1)
                group = rate.log2().floor()
                for level in group.unique():
                    self._round(x, active[group == level], num, with_log_prob, state)
                self._check_acceptance(x, active, num, state)
                active = active[state["filled"][active] < num]
        return state["theta"], state["log_q"]

    def _round(
        self, x: Tensor, rows: Tensor, num: int, with_log_prob: bool, state: dict[str, Any]
    ) -> None:
        """One batch of candidates at ``rows`` of ``x``; the first ones inside the support
        fill each row's next free slots of ``state``."""
        filled, drawn, accepted = state["filled"], state["drawn"], state["accepted"]
        rate = float(((accepted[rows] + 1) / (drawn[rows] + 1)).min())
        need = int((num - filled[rows]).max())
        width = rows.numel() * (self.event_size() or 1)
        size = min(
            math.ceil(1.2 * need / rate) + 8,
            math.ceil(num / self.min_acceptance),
            max(need, ROUND_NUMBERS // width),
        )
        draws, lp = self._inner_draws(x[rows.to(x.device)], size, with_log_prob)
        if state["theta"] is None:
            state["theta"] = draws.new_empty(num, x.shape[0], draws.shape[-1])
            state["log_q"] = None if lp is None else lp.new_empty(num, x.shape[0])
        inside = ~self._outside(draws)  # (size, rows)
        count = inside.sum(0).cpu()
        drawn[rows] += size
        accepted[rows] += count
        take = torch.minimum(count, num - filled[rows])
        device = inside.device
        order = torch.argsort((~inside).to(torch.int8), dim=0, stable=True)  # inside first
        j = torch.arange(size, device=device)[:, None]
        keep = j < take.to(device)[None]
        cols = torch.arange(rows.numel(), device=device).expand(size, -1)[keep]
        slot = (filled[rows].to(device)[None] + j)[keep]
        out_rows = rows.to(device)[cols]
        state["theta"][slot, out_rows] = draws[order[keep], cols]
        if lp is not None:
            state["log_q"][slot, out_rows] = lp[order[keep], cols]
        filled[rows] += take

    def _inner_draws(
        self, x: Tensor, num: int, with_log_prob: bool
    ) -> tuple[Tensor, Tensor | None]:
        """``num`` draws of the wrapped posterior at each row ``(S, N, D)`` (and their
        log-densities), in calls sized by the memory budget: a round's candidates can
        number millions, and a flow's activations are many times its draws."""
        if with_log_prob:
            return draws_and_log_probs(self.inner, x, num)
        return budgeted_draws(self.inner, x, num), None

    def _given_up(self, drawn: Tensor, inside: Tensor) -> Tensor:
        """Rows whose share inside is below half of ``min_acceptance`` after
        :data:`GIVE_UP_COUNT` ``/ min_acceptance`` draws."""
        return (drawn >= GIVE_UP_COUNT / self.min_acceptance) & (
            inside < 0.5 * self.min_acceptance * drawn
        )

    def _check_acceptance(self, x: Tensor, active: Tensor, num: int, state: dict[str, Any]) -> None:
        filled, drawn, accepted = state["filled"], state["drawn"], state["accepted"]
        short = (drawn >= num / self.min_acceptance) | self._given_up(drawn, accepted)
        stuck = active[(filled[active] < num) & short[active]]
        if stuck.numel():
            row = int(stuck[0])
            values = x[row].reshape(-1)
            shown = ", ".join(f"{float(v):.3g}" for v in values[:4])
            raise NoMassInsideError(
                f"posterior must put at least min_acceptance = {self.min_acceptance:g} of its "
                f"mass inside the prior's support to be sampled by rejection, got "
                f"{float(accepted[row] / drawn[row]):.2g} at x = [{shown}"
                f"{', ...' if values.numel() > 4 else ''}]"
                + ("" if stuck.numel() == 1 else f" and {stuck.numel() - 1} other rows")
            )
