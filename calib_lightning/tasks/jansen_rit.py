r"""The stochastic Jansen-Rit neural mass model, the real-model case study of the L-C2ST paper.

:class:`JansenRit` simulates the stochastic JR-NMM of Ableidinger, Buckwar and
Hinterleitner (2017) in torch, vectorized over the batch, with their Strang splitting;
:class:`LogPSD` is the log power spectral density summary the L-C2ST paper (Linhart,
Gramfort and Rodrigues 2023, section 4.2) feeds its NPE with.

The model has six states, three positions :math:`p = (X_1, X_2, X_3)` (mean membrane
potentials, in mV) and their velocities :math:`q = (X_4, X_5, X_6)`:

.. math::

    dp = q\,dt, \qquad
    dq = \big(N(p) - \Gamma^2 p - 2 \Gamma q\big)\,dt + \Sigma\,dW,

with :math:`\Gamma = \mathrm{diag}(a, a, b)`, :math:`\Sigma = \mathrm{diag}(\epsilon_4,
\sigma, \epsilon_6)`, the sigmoid :math:`S(v) = v_{max} / (1 + e^{r (v_0 - v)})` and

.. math::

    N(p) = \big(A a\, S(X_2 - X_3),\;
    A a\, (\mu + C_2 S(C_1 X_1)),\;
    B b\, C_4 S(C_3 X_1)\big),

:math:`C_1 = C`, :math:`C_2 = 0.8 C`, :math:`C_3 = C_4 = 0.25 C`. The observed signal is
:math:`Y = X_2 - X_3` scaled by the gain :math:`10^{g / 10}` (``g`` in dB). The splitting
solves the linear part (a critically damped oscillator per position, driven by noise)
exactly: its transition matrix is the matrix exponential and its noise the exact
Gaussian covariance of one step (Van Loan's block exponential, in float64); the
nonlinear part moves only the velocities, by :math:`h N(p)`, which is its exact flow.
One step is :math:`\psi^{N}_{h/2} \circ \psi^{lin}_h \circ \psi^{N}_{h/2}`.

References:
    Ableidinger, Buckwar, Hinterleitner. "A Stochastic Version of the Jansen and Rit
    Neural Mass Model: Analysis and Numerics." J. Math. Neurosci. 2017.

    Linhart, Gramfort, Rodrigues. "L-C2ST: Local Diagnostics for Posterior
    Approximations in Simulation-Based Inference." NeurIPS 2023.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from calib_lightning.tasks.images import _BoxTask

__all__ = ["JansenRit", "LogPSD"]

#: the fixed coefficients of the model (Jansen and Rit 1995; Ableidinger et al. 2017)
CONSTANTS = {
    "A": 3.25,  # mV, excitatory synaptic gain
    "B": 22.0,  # mV, inhibitory synaptic gain
    "a": 100.0,  # 1/s, excitatory time constant
    "b": 50.0,  # 1/s, inhibitory time constant
    "vmax": 5.0,  # 1/s, the sigmoid's maximum firing rate
    "v0": 6.0,  # mV, the sigmoid's midpoint
    "r": 0.56,  # 1/mV, the sigmoid's slope
    "eps4": 0.01,  # noise scale of X_4
    "eps6": 1.0,  # noise scale of X_6
}


def _check_theta(theta: Tensor) -> None:
    if not isinstance(theta, Tensor) or theta.ndim != 2 or theta.shape[-1] != 4:
        shape = tuple(theta.shape) if isinstance(theta, Tensor) else type(theta).__name__
        raise ValueError(f"theta must be a tensor of shape (N, 4) = (C, mu, sigma, g), got {shape}")
    if not theta.is_floating_point():
        raise ValueError(f"theta must be a floating tensor, got dtype {theta.dtype}")


def linear_step(step: float, rate: float) -> tuple[Tensor, Tensor]:
    r"""Transition matrix and noise covariance of one step of a critically damped oscillator.

    The linear SDE :math:`dx = v\,dt`, :math:`dv = (-\gamma^2 x - 2 \gamma v)\,dt + dW`
    (unit noise) moves :math:`(x, v)` over ``step`` seconds to :math:`E (x, v) + \xi`,
    :math:`\xi \sim N(0, Q)`, with :math:`E = e^{M h}` and
    :math:`Q = \int_0^h e^{M s} e_2 e_2^T e^{M^T s} ds`, both from one block matrix
    exponential (Van Loan 1978), in float64.

    Arguments:
        step: :math:`h`, seconds.
        rate: :math:`\gamma`, 1/s.

    Returns:
        ``E (2, 2)`` and ``Q (2, 2)``, float64.

    Example:
        >>> E, Q = linear_step(1 / 1024, 100.0)
        >>> E.shape, bool(torch.linalg.eigvalsh(Q).min() > 0)
        (torch.Size([2, 2]), True)
    """
    drift = torch.tensor([[0.0, 1.0], [-(rate**2), -2.0 * rate]], dtype=torch.float64)
    noise = torch.tensor([[0.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    block = torch.zeros(4, 4, dtype=torch.float64)
    block[:2, :2], block[:2, 2:], block[2:, 2:] = -drift, noise, drift.T
    exp = torch.linalg.matrix_exp(block * step)
    transition = exp[2:, 2:].T
    covariance = transition @ exp[:2, 2:]
    return transition, (covariance + covariance.T) / 2


class LogPSD(nn.Module):
    r"""The log power spectral density of a series: the L-C2ST paper's JR-NMM summary.

    Welch's average of periodograms without taper: the series is cut into windows of
    ``2 (nbins - 1) + 1`` samples with a hop of half a window (rounded down), each
    window's squared modulus of its real FFT is averaged over windows, and the result is
    taken in :math:`\log_{10}`. With ``nbins = 33`` and 1,024 samples at 128 Hz: 30
    windows of 65 samples, bins at :math:`k \cdot 128 / 65` Hz, :math:`k = 0..32`. A
    gain :math:`10^{g / 10}` on the series shifts every feature by :math:`g / 5`.

    Arguments:
        nbins: number of frequency bins (features).

    Shapes:
        ``(*, T)`` series to ``(*, nbins)`` features, in the series' dtype and device.

    Example:
        >>> LogPSD()(torch.randn(2, 1024)).shape
        torch.Size([2, 33])
    """

    def __init__(self, nbins: int = 33) -> None:
        super().__init__()
        if isinstance(nbins, bool) or not isinstance(nbins, int) or nbins < 2:
            raise ValueError(f"nbins must be an integer >= 2, got {nbins!r}")
        self.nbins = nbins
        self.window = 2 * (nbins - 1) + 1

    def frequencies(self, sampling_rate: float = 128.0) -> Tensor:
        """The bins' frequencies ``(nbins,)`` in Hz for a series sampled at ``sampling_rate``."""
        return torch.arange(self.nbins, dtype=torch.float64) * sampling_rate / self.window

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim < 1 or x.shape[-1] < self.window:
            raise ValueError(
                f"x must have shape (*, T) with T >= {self.window}, got {tuple(x.shape)}"
            )
        windows = x.unfold(-1, self.window, self.window // 2)
        power = torch.fft.rfft(windows, dim=-1).abs().square().mean(-2)
        return torch.log10(power)

    def extra_repr(self) -> str:
        return f"nbins={self.nbins}"


class JansenRit(_BoxTask):
    r"""The stochastic Jansen-Rit neural mass model of the L-C2ST paper (section 4.2).

    :math:`\theta = (C, \mu, \sigma, g)` with the uniform prior on
    :math:`[10, 250] \times [50, 500] \times [100, 5000] \times [-20, 20]`: the
    connectivity, the mean and the scale of the input firing rate (1/s) and the gain in
    dB. Each simulation starts from :math:`X_0 \sim N(0, I_6)`, runs the Strang splitting
    (module docstring) with step :math:`h = 1/1024` s for 2 s of burn-in and 8 s of
    recording, keeps every 8th sample of :math:`10^{g/10} (X_2 - X_3)` (1,024 samples at
    128 Hz) and removes its mean. ``simulate`` returns the :class:`LogPSD` summary
    (33 features) with ``summary=True`` (the paper's setting), else the series.

    Simulations run in float64 on ``theta``'s device, ``chunk_size`` at a time (memory
    grows with the chunk, not with ``N``); the noise is drawn from ``generator`` on the
    generator's device (the default one if none), so a seed gives the same output on a
    given device and chunk size.

    Arguments:
        summary: return the 33 log-PSD features (``True``) or the 1,024-sample series.
        chunk_size: simulations run together.
        dtype: dtype of sampled parameters and of the output.

    Example:
        >>> task = JansenRit()
        >>> theta, x = task.sample(2, torch.Generator().manual_seed(0))
        >>> theta.shape, x.shape
        (torch.Size([2, 4]), torch.Size([2, 33]))
    """

    theta_dim = 4
    labels = ("C", "mu", "sigma", "g")
    step = 1.0 / 1024
    burn_in = 2.0
    recording = 8.0
    thinning = 8

    def __init__(
        self, summary: bool = True, chunk_size: int = 4096, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__(dtype)
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
        self.summary, self.chunk_size = bool(summary), chunk_size
        self.log_psd = LogPSD(33)
        self.num_samples = round(self.recording / self.step) // self.thinning
        self.x_dim = self.log_psd.nbins if self.summary else self.num_samples

    def __repr__(self) -> str:
        return f"JansenRit(summary={self.summary}, chunk_size={self.chunk_size})"

    @property
    def box(self) -> tuple[Tensor, Tensor]:
        """Lower and upper corners ``(4,)`` of the box-uniform prior on ``(C, mu, sigma, g)``."""
        return (
            torch.tensor([10.0, 50.0, 100.0, -20.0], dtype=self.dtype),
            torch.tensor([250.0, 500.0, 5000.0, 20.0], dtype=self.dtype),
        )

    def simulate(self, theta: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Summaries ``(N, 33)`` (or series ``(N, 1024)``) for parameters ``(N, 4)``."""
        _check_theta(theta)
        if theta.shape[0] == 0:
            return theta.new_zeros(0, self.x_dim, dtype=self.dtype)
        out = [self._chunk(part, generator) for part in theta.split(self.chunk_size)]
        x = torch.cat(out)
        if self.summary:
            x = self.log_psd(x)
        return x.to(self.dtype)

    def _noise(
        self, shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device
    ) -> Tensor:
        source = generator.device if generator is not None else device
        z = torch.randn(shape, generator=generator, dtype=torch.float64, device=source)
        return z.to(device)

    def _chunk(self, theta: Tensor, generator: torch.Generator | None) -> Tensor:
        """Mean-removed series ``(n, 1024)`` in float64 for one chunk of parameters."""
        k, h, device = CONSTANTS, self.step, theta.device
        theta = theta.to(torch.float64)
        n = theta.shape[0]
        c, mu, sigma, gain = theta.unbind(-1)
        # linear part: per position, (x, v) -> E (x, v) + scale * L z with L L^T = Q
        rates = (k["a"], k["a"], k["b"])
        steps = [linear_step(h, rate) for rate in rates]
        e = torch.stack([E.reshape(4) for E, _ in steps]).T.to(device)  # (4, 3)
        chol = torch.stack([torch.linalg.cholesky(Q).reshape(4) for _, Q in steps]).T.to(device)
        scale = torch.stack(
            [torch.full_like(sigma, k["eps4"]), sigma, torch.full_like(sigma, k["eps6"])], -1
        )
        noise_x = scale * chol[0]  # (n, 3)
        noise_v1, noise_v2 = scale * chol[2], scale * chol[3]
        # nonlinear part: v += tau * (gain_v * S(arg) + offset), arg = (X2 - X3, C X1, C X1 / 4)
        a_gain, b_gain = k["A"] * k["a"], k["B"] * k["b"]
        weight = torch.stack([torch.zeros_like(c), c, 0.25 * c], -1)
        rate_out = k["vmax"] * torch.stack(
            [torch.full_like(c, a_gain), a_gain * 0.8 * c, b_gain * 0.25 * c], -1
        )
        offset = torch.stack([torch.zeros_like(mu), a_gain * mu, torch.zeros_like(mu)], -1)
        first = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64, device=device)

        def drift(x: Tensor) -> Tensor:
            arg = torch.addcmul(first * (x[:, 1:2] - x[:, 2:3]), x[:, :1], weight)
            return torch.sigmoid(arg.sub_(k["v0"]).mul_(k["r"])).mul_(rate_out).add_(offset)

        state = self._noise((n, 6), generator, device)
        x, v = state[:, :3].clone(), state[:, 3:].clone()
        v += (h / 2) * drift(x)
        first_kept = round(self.burn_in / h)
        total = first_kept + self.thinning * (self.num_samples - 1)
        out = torch.empty(self.num_samples, n, dtype=torch.float64, device=device)
        block = 256
        for start in range(0, total, block):
            z = self._noise((min(block, total - start), 2, n, 3), generator, device)
            for j in range(z.shape[0]):
                i = start + j + 1  # the step that ends at grid point i
                z1, z2 = z[j, 0], z[j, 1]
                x_new = torch.addcmul(e[0] * x, e[1], v).addcmul_(noise_x, z1)
                v = torch.addcmul(e[2] * x, e[3], v).addcmul_(noise_v1, z1).addcmul_(noise_v2, z2)
                x = x_new
                if i >= first_kept and (i - first_kept) % self.thinning == 0:
                    out[(i - first_kept) // self.thinning] = x[:, 1] - x[:, 2]
                # the half step closing this step and the half step opening the next:
                # one exact nonlinear step (it moves the velocities only)
                v += h * drift(x)
        series = out.T * torch.pow(10.0, gain / 10)[:, None]
        return series - series.mean(-1, keepdim=True)
