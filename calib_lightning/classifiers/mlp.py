r"""A batched ensemble of ReLU MLP classifiers: ``K`` networks trained as one.

Every weight carries a leading member dimension; layers are batched matrix products,
the backward pass is written out by hand and Adam updates one flat ``(K, P)`` tensor, so
a step costs a few large tensor operations whatever ``K`` is.

References:
    Lopez-Paz, Oquab. "Revisiting Classifier Two-Sample Tests." ICLR 2017.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torch.optim.adam as torch_adam
from torch import Tensor, nn

from calib_lightning._utils.validation import check_positive, check_probability
from calib_lightning.classifiers._blocks import (
    Features,
    as_blocks,
    as_labels,
    gather,
    gather_labels,
    standardize,
    threads,
)

__all__ = ["MLPEnsemble"]

_CHUNK_ELEMENTS = 1 << 19  # hidden activations held at once when predicting
#: the default hidden width is ``min(10 * F, max_width)`` for ``F`` input features, and
#: ``max_width`` defaults to this
MAX_DEFAULT_WIDTH = 128


class _Adam:
    """Adam on lists of tensors (no autograd): torch's public functional Adam with its fused
    kernel where the device has one (one pass over the weights; CPU since torch 2.4), else
    the same update written out."""

    betas, eps = (0.9, 0.999), 1e-8

    def __init__(self, learning_rate: float, dtype: torch.dtype, fused: bool = True) -> None:
        self.learning_rate, self.count = learning_rate, 0
        self.fused = fused and dtype in (torch.float32, torch.float64)
        self.steps: list[Tensor] = []  # torch's step counters, one per tensor

    def step(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        moments: list[Tensor],
        squares: list[Tensor],
    ) -> None:
        self.count += 1
        beta1, beta2 = self.betas
        if self.fused:
            # the functional Adam adds one to each counter before the update
            self.steps = [torch.tensor(float(self.count - 1), device=p.device) for p in params]
            try:
                torch_adam.adam(
                    params,
                    grads,
                    moments,
                    squares,
                    [],
                    self.steps,
                    fused=True,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=self.learning_rate,
                    weight_decay=0.0,
                    eps=self.eps,
                    maximize=False,
                )
                return
            except (RuntimeError, NotImplementedError):  # no fused kernel for this device
                self.fused = False
        size = -self.learning_rate / (1 - beta1**self.count)
        for param, grad, moment, square in zip(params, grads, moments, squares, strict=True):
            moment.lerp_(grad, 1 - beta1)
            square.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (square / (1 - beta2**self.count)).sqrt_().add_(self.eps)
            param.addcdiv_(moment, denom, value=size)


class MLPEnsemble(nn.Module):
    r"""``K`` independent ReLU MLP classifiers trained at once as one batched network.

    Every weight carries a leading member dimension and layers are batched matrix
    products (:func:`torch.baddbmm`), so ``K`` small networks cost about as much as one
    wide one. Each member: standardizes its inputs (mean and standard deviation of its
    own ``M`` rows), holds out ``validation_fraction`` of its rows, trains with Adam on
    the binary cross-entropy in mini-batches of ``batch_size``, and keeps the weights of
    its lowest held-out loss; it stops after ``patience`` epochs without an improvement
    larger than ``tol``. Stopped members leave the batch, so the rest run faster.

    The trained weights are buffers (not parameters): an ensemble stored inside a metric
    is saved by ``state_dict`` and never seen by an optimizer.

    Arguments:
        num_members: ``K``.
        hidden_features: widths of the hidden layers; ``None``: two layers of
            ``min(10 * F, max_width)`` units for ``F`` input features (sbibm's C2ST
            architecture, ``10 * F``, bounded; why: ``docs/design.md``, "Classifiers:
            the batched MLP's defaults").
            Embed high-dimensional ``x`` such as images first
            (``LC2STNF(..., embedding=...)``).
        max_width: the bound of the default width (the local tests use 96: see
            :data:`~calib_lightning.classifiers.LOCAL_TEST_SETTINGS`).
        learning_rate: Adam step size.
        batch_size: rows per mini-batch.
        max_epochs: passes over the training rows at most.
        patience: epochs without improvement of the held-out loss before a member stops.
        validation_fraction: held-out share of each member's rows; ``0`` monitors the
            training loss instead.
        tol: improvement of the monitored loss that resets ``patience``.
        weight_decay: L2 penalty on the weights (added to the gradient).
        seed: member ``k`` draws its initialisation, split and batch order from
            ``torch.Generator().manual_seed(seed + k)``.
        num_threads: intra-op threads while fitting and predicting (restored after);
            ``None`` keeps torch's setting. One by default: these matrices are small.
    """

    def __init__(
        self,
        num_members: int = 1,
        hidden_features: Sequence[int] | None = None,
        *,
        max_width: int = MAX_DEFAULT_WIDTH,
        learning_rate: float = 1e-2,
        batch_size: int = 64,
        max_epochs: int = 200,
        patience: int = 3,
        validation_fraction: float = 0.1,
        tol: float = 1e-4,
        weight_decay: float = 0.0,
        seed: int = 0,
        num_threads: int | None = 1,
    ) -> None:
        super().__init__()
        check_positive("num_members", num_members, integer=True)
        if num_threads is not None:
            check_positive("num_threads", num_threads, integer=True)
        self.num_threads = num_threads
        for name, value in (
            ("batch_size", batch_size),
            ("max_epochs", max_epochs),
            ("patience", patience),
            ("max_width", max_width),
        ):
            check_positive(name, value, integer=True)
        check_positive("learning_rate", learning_rate)
        check_probability("validation_fraction", validation_fraction, open_interval=False)
        if validation_fraction >= 1:
            raise ValueError(f"validation_fraction must be < 1, got {validation_fraction!r}")
        if hidden_features is not None:
            hidden_features = tuple(hidden_features)
            for width in hidden_features:
                check_positive("hidden_features", width, integer=True)
        if tol < 0 or weight_decay < 0:
            raise ValueError(f"tol and weight_decay must be >= 0, got {tol!r}, {weight_decay!r}")
        self.num_members, self.hidden_features = num_members, hidden_features
        self.max_width = max_width
        self.learning_rate, self.batch_size = learning_rate, batch_size
        self.max_epochs, self.patience, self.tol = max_epochs, patience, tol
        self.validation_fraction, self.weight_decay, self.seed = (
            validation_fraction,
            weight_decay,
            seed,
        )
        self.num_layers = (len(hidden_features) if hidden_features is not None else 2) + 1
        for i in range(self.num_layers):
            self.register_buffer(f"weight{i}", torch.empty(0))
            self.register_buffer(f"bias{i}", torch.empty(0))
        self.register_buffer("loc", torch.empty(0))
        self.register_buffer("scale", torch.empty(0))
        self.register_buffer("epochs", torch.zeros(0, dtype=torch.long))

    def extra_repr(self) -> str:
        return f"num_members={self.num_members}, hidden_features={self.hidden_features}"

    @property
    def fitted(self) -> bool:
        """Whether :meth:`fit` has run (or fitted weights were loaded)."""
        return self.loc.numel() > 0

    @property
    def in_features(self) -> int:
        return int(self.loc.shape[-1]) if self.fitted else 0

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        for name, _ in self.named_buffers(recurse=False):
            if prefix + name in state_dict:
                setattr(self, name, torch.empty_like(state_dict[prefix + name]))
        super()._load_from_state_dict(state_dict, prefix, *args)

    @staticmethod
    def _layout(widths: list[int]) -> list[tuple[int, int, int]]:
        """Offsets and shapes of every weight and bias in one flat row of parameters."""
        layout, offset = [], 0
        for fan_in, fan_out in itertools.pairwise(widths):
            for rows in (fan_in, 1):
                layout.append((offset, rows, fan_out))
                offset += rows * fan_out
        return layout

    @staticmethod
    def _views(flat: Tensor, layout: list[tuple[int, int, int]]) -> list[Tensor]:
        """Weights ``(k, fan_in, fan_out)`` and biases ``(k, 1, fan_out)`` as views of ``flat``."""
        k = flat.shape[0]
        return [flat[:, o : o + r * c].view(k, r, c) for o, r, c in layout]

    @staticmethod
    def _init_flat(
        layout: list[tuple[int, int, int]], gens: list[torch.Generator], dtype: torch.dtype
    ) -> Tensor:
        """Glorot-uniform weights and biases (scikit-learn's scheme), one generator per member."""
        bounds = []
        for i in range(0, len(layout), 2):
            fan_in, fan_out = layout[i][1], layout[i][2]
            bound = (6.0 / (fan_in + fan_out)) ** 0.5
            bounds += [
                torch.full((r * c,), bound, dtype=torch.float64) for _, r, c in layout[i : i + 2]
            ]
        bound = torch.cat(bounds)
        draws = torch.stack(
            [torch.rand(bound.shape, generator=g, dtype=torch.float64) for g in gens]
        )
        return (bound * (2 * draws - 1)).to(dtype)

    @staticmethod
    def _forward(params: list[Tensor], x: Tensor, keep: bool = False) -> tuple[Tensor, list]:
        """Logits ``(k, B)`` on inputs ``x (k, B, F)``; with ``keep``, the layer inputs too."""
        h, inputs = x, []
        last = len(params) // 2 - 1
        for i in range(last):
            if keep:
                inputs.append(h)
            h = torch.relu(torch.baddbmm(params[2 * i + 1], h, params[2 * i]))
        if keep:
            inputs.append(h)
        # one output unit: a broadcast product beats a (B, H) @ (H, 1) batched matmul
        return (h * params[-2].transpose(1, 2)).sum(-1) + params[-1][..., 0], inputs

    @staticmethod
    def _backward(params: list[Tensor], inputs: list[Tensor], delta: Tensor) -> list[Tensor]:
        """Gradients of the members' losses, shaped like ``params``, from
        ``delta = dloss/dlogits``."""
        delta = delta.unsqueeze(-1)  # (k, B, 1)
        last = len(inputs) - 1
        grads = [delta.sum(1, keepdim=True), (inputs[last] * delta).sum(1).unsqueeze(-1)]
        delta = delta * params[2 * last].transpose(1, 2)  # (k, B, H)
        for i in reversed(range(last)):
            delta = torch.ops.aten.threshold_backward(delta, inputs[i + 1], 0.0)  # ReLU
            grads.append(delta.sum(1, keepdim=True))
            grads.append(torch.bmm(inputs[i].transpose(1, 2), delta))
            if i:
                delta = torch.bmm(delta, params[2 * i].transpose(1, 2))
        return grads[::-1]

    def fit(self, features: Features, labels: Tensor) -> MLPEnsemble:
        """Train all members; see the module docstring for the layout of the inputs."""
        blocks = as_blocks(features, self.num_members)
        with threads(self.num_threads):
            return self._fit(blocks, labels)

    def _fit(self, blocks: list[Tensor], labels: Tensor) -> MLPEnsemble:
        rows = blocks[0].shape[-2]
        labels = as_labels(labels, self.num_members, rows)
        device, dtype, k_all = blocks[0].device, blocks[0].dtype, self.num_members
        blocks, loc, scale = standardize([b.to(dtype) for b in blocks], k_all)
        labels = labels.to(device=device, dtype=dtype)
        num_val = round(self.validation_fraction * rows)
        num_train = rows - num_val
        if num_train < 1 or (self.validation_fraction > 0 and num_val < 1):
            raise ValueError(
                f"features must have enough rows to hold out validation_fraction="
                f"{self.validation_fraction} and still train, got M = {rows}"
            )
        in_features = loc.shape[-1]
        hidden = self.hidden_features
        if hidden is None:  # () is a valid choice: logistic regression
            width = min(10 * in_features, self.max_width)
            hidden = (width, width)
        layout = self._layout([in_features, *hidden, 1])

        gens = [torch.Generator().manual_seed(self.seed + k) for k in range(k_all)]
        flat = self._init_flat(layout, gens, dtype).to(device)
        split = torch.stack([torch.randperm(rows, generator=g) for g in gens]).to(device)
        train_rows, val_rows = split[:, num_val:], split[:, :num_val]
        members = torch.arange(k_all, device=device)
        val_x = gather(blocks, members, val_rows) if num_val else None
        val_y = gather_labels(labels, members, val_rows) if num_val else None
        # one contiguous tensor per weight and bias: the gradients are written per layer
        # and one fused Adam step updates them all (no flat copy of the gradient per step)
        params = [view.contiguous() for view in self._views(flat, layout)]
        best, final = [p.clone() for p in params], [torch.empty_like(p) for p in params]
        moments = [torch.zeros_like(p) for p in params]
        squares = [torch.zeros_like(p) for p in params]
        best_loss = torch.full((k_all,), float("inf"), dtype=dtype, device=device)
        wait = torch.zeros(k_all, dtype=torch.long, device=device)
        epochs = torch.zeros(k_all, dtype=torch.long)
        active = members.clone()  # original indices of the members still training
        adam = _Adam(self.learning_rate, dtype)
        for epoch in range(1, self.max_epochs + 1):
            order = torch.stack(
                [torch.randperm(num_train, generator=gens[int(k)]) for k in active.cpu()]
            ).to(device)
            order = torch.gather(train_rows[active], 1, order)
            train_loss = torch.zeros(len(active), dtype=dtype, device=device)
            for start in range(0, num_train, self.batch_size):
                batch = order[:, start : start + self.batch_size]
                y = gather_labels(labels, active, batch)
                logits, inputs = self._forward(params, gather(blocks, active, batch), keep=True)
                grads = self._backward(params, inputs, (torch.sigmoid(logits) - y) / y.shape[1])
                if val_x is None:
                    loss = F.binary_cross_entropy_with_logits(logits, y, reduction="none")
                    train_loss += loss.sum(-1)
                if self.weight_decay:  # L2 on the weights only, not the biases
                    for grad, param in zip(grads[::2], params[::2], strict=True):
                        grad.add_(param, alpha=self.weight_decay)
                adam.step(params, grads, moments, squares)
            if val_x is not None:
                logits, _ = self._forward(params, val_x)
                loss = F.binary_cross_entropy_with_logits(logits, val_y, reduction="none")
                monitored = loss.mean(-1)
            else:
                monitored = train_loss / num_train
            improved = monitored < best_loss - self.tol
            best_loss = torch.where(improved, monitored, best_loss)
            wait = torch.where(improved, torch.zeros_like(wait), wait + 1)
            kept = improved[:, None, None]
            best = [torch.where(kept, p, b) for p, b in zip(params, best, strict=True)]
            done = (wait >= self.patience) | (epoch == self.max_epochs)
            if bool(done.any()):
                finished = active[done]
                epochs[finished.cpu()] = epoch
                for out, b in zip(final, best, strict=True):
                    out[finished] = b[done]
                keep = ~done
                active, best_loss, wait = active[keep], best_loss[keep], wait[keep]
                params, best = [p[keep] for p in params], [b[keep] for b in best]
                moments, squares = [m[keep] for m in moments], [v[keep] for v in squares]
                if val_x is not None:
                    val_x, val_y = val_x[keep], val_y[keep]
                if len(active) == 0:
                    break
        for i, tensor in enumerate(final):
            setattr(self, f"weight{i // 2}" if i % 2 == 0 else f"bias{i // 2}", tensor)
        self.loc, self.scale, self.epochs = loc.contiguous(), scale.contiguous(), epochs
        return self

    @torch.no_grad()
    def predict_proba(self, features: Features) -> Tensor:
        r"""Probabilities :math:`P(\text{class } 1)` of every member: ``(K, N)``."""
        if not self.fitted:
            raise ValueError("MLPEnsemble.predict_proba needs a fitted ensemble; call fit first")
        blocks = as_blocks(features, self.num_members)
        widths = [b.shape[-1] for b in blocks]
        if sum(widths) != self.in_features:
            raise ValueError(
                f"features must have {self.in_features} columns in all, got {sum(widths)}"
            )
        weights = [getattr(self, f"weight{i}") for i in range(self.num_layers)]
        biases = [getattr(self, f"bias{i}") for i in range(self.num_layers)]
        # fold the standardization into the first layer: (x - loc) / scale @ W + b
        first = weights[0] / self.scale.unsqueeze(-1)
        bias0 = biases[0] - (self.loc / self.scale).unsqueeze(1) @ weights[0]
        slices = np.cumsum([0, *widths])
        width, rows = max(w.shape[-1] for w in weights), blocks[0].shape[-2]
        # members per pass: all at once when their activations fit the budget, else fewer
        # members with more rows each (one large matrix product beats many small batched ones)
        group = min(self.num_members, max(1, _CHUNK_ELEMENTS // (rows * width)))
        chunk = max(1, _CHUNK_ELEMENTS // (group * width))
        out = []
        with threads(self.num_threads):
            for lo in range(0, self.num_members, group):
                k = slice(lo, lo + group)
                parts = [b[k] if b.ndim == 3 else b for b in blocks]
                params = [first[k], bias0[k], [w[k] for w in weights], [b[k] for b in biases]]
                out.append(self._predict(parts, *params, slices, chunk))
        return torch.cat(out)

    def _predict(
        self,
        blocks: list[Tensor],
        first: Tensor,
        bias0: Tensor,
        weights: list[Tensor],
        biases: list[Tensor],
        slices: np.ndarray,
        chunk: int,
    ) -> Tensor:
        rows, out = blocks[0].shape[-2], []
        for start in range(0, rows, chunk):
            h = bias0
            for block, lo, hi in zip(blocks, slices[:-1], slices[1:], strict=True):
                part = block[..., start : start + chunk, :].to(first.dtype)
                h = h + torch.matmul(part, first[:, lo:hi])
            if self.num_layers == 1:
                out.append(torch.sigmoid(h.squeeze(-1)))
                continue
            for i in range(1, self.num_layers - 1):
                h = torch.baddbmm(biases[i], torch.relu(h), weights[i])
            logits = (torch.relu(h) * weights[-1].transpose(1, 2)).sum(-1) + biases[-1][..., 0]
            out.append(torch.sigmoid(logits))
        return torch.cat(out, -1)
