"""ImportanceCoverage's credibility vs Hermans et al.'s plain importance-sampled one.

D = 1, prior N(0, 1), x ~ N(theta, sigma^2), the prior as proposal, M draws per pair; the
model's log-likelihood is tau times the true one (tau = 1: the exact posterior). For each
setting, R datasets of N pairs: the rejection rate of ``importance_coverage``'s
``global_p_value`` at 0.05 (guard off, ``min_ess=0``), the median ESS and the mean coverage
error. "plain": sum of normalized weights of the draws more probable than the truth;
"exact": the truth's own weight in the sample, randomized (the package's).

Run: ``PYTHONPATH=. python examples/benchmarks/importance_coverage_level.py 500``
(result: results/importance_coverage_level.md); ``--smoke``: two tiny rows, seconds.
"""

import sys

import torch

from calib_lightning.functional.importance import importance_coverage, importance_credibility

g = torch.Generator().manual_seed(0)
SMOKE = "--smoke" in sys.argv
R, N = (2, 20) if SMOKE else (100, 200)
M = 50 if SMOKE else int(sys.argv[1]) if len(sys.argv) > 1 else 500


def run(s, tau, plain):
    rej = 0
    ess_med, errs = [], []
    for _ in range(R):
        th = torch.randn(N, generator=g, dtype=torch.float64)
        x = th + s * torch.randn(N, generator=g, dtype=torch.float64)
        draws = torch.randn(M, N, generator=g, dtype=torch.float64)

        def f(t, x=x):
            return -0.5 * tau * ((x - t) / s) ** 2

        def prior(t):
            return -0.5 * t**2

        lt, lt0 = f(draws) + prior(draws), f(th) + prior(th)
        lp, lp0 = prior(draws), prior(th)
        c, ess = importance_credibility(lt, lp, lt0, lp0, generator=g)
        if plain:
            w = lt - lp
            w = (w - w.amax(0)).exp()
            c = (w * (lt > lt0)).sum(0) / w.sum(0)
        out = importance_coverage(c, ess, min_ess=0)
        rej += float(out.global_p_value) < 0.05
        ess_med.append(float(out.ess_median))
        errs.append(float(out.coverage_error))
    return rej / R, sum(ess_med) / R, sum(errs) / R


if __name__ == "__main__":
    settings = [(0.1, 1.0, True), (0.03, 1.0, True), (0.03, 1.0, False), (0.3, 1.5, False),
                (0.1, 1.5, False), (0.03, 1.5, False), (0.015, 1.5, False)]  # fmt: skip
    for s, tau, plain in settings[:2] if SMOKE else settings:
        rate, ess, err = run(s, tau, plain)
        kind = "plain" if plain else "exact"
        print(f"M={M} sigma={s} tau={tau} {kind}: reject={rate:.3f} median_ess={ess:.1f} "
              f"mean_cov_err={err:+.3f}", flush=True)  # fmt: skip
