"""Batched classifier ensembles: equal to members trained alone, accurate, persistent."""

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.linear_model import LogisticRegression

from calib_lightning.classifiers import (
    MLPEnsemble,
    SklearnEnsemble,
    local_test_kwargs,
    make_ensemble,
    sbibm_mlp,
)


def _logistic_data(num_members, rows, generator, dtype=torch.float64):
    """Per-member 2-D features, a shared 1-D feature, labels ~ Bernoulli(sigmoid(2 f0 - f2))."""
    own = torch.randn(num_members, rows, 2, generator=generator, dtype=dtype)
    shared = 3.0 + 2.0 * torch.randn(rows, 1, generator=generator, dtype=dtype)
    logit = 2.0 * own[..., 0] - (shared[:, 0] - 3.0) / 2.0
    labels = (
        torch.rand(num_members, rows, generator=generator, dtype=dtype) < torch.sigmoid(logit)
    ).to(dtype)
    return own, shared, labels


def test_batched_members_equal_members_trained_one_by_one():
    """Member k of a K-ensemble = a 1-member ensemble with seed + k on member k's data:
    same initialisation, split and batch order, so the same weights up to rounding."""
    g = torch.Generator().manual_seed(0)
    own, shared, labels = _logistic_data(5, 300, g)
    settings = {"hidden_features": (8, 6), "batch_size": 64, "patience": 3, "max_epochs": 40}
    batched = MLPEnsemble(5, seed=11, **settings).fit([own, shared], labels)
    # members stop at different epochs: the test exercises the shrinking active set
    assert len(set(batched.epochs.tolist())) > 1
    query = torch.randn(50, 3, generator=g, dtype=torch.float64)
    proba = batched.predict_proba(query)
    for k in range(5):
        alone = MLPEnsemble(1, seed=11 + k, **settings).fit([own[k], shared], labels[k])
        assert int(alone.epochs[0]) == int(batched.epochs[k])
        torch.testing.assert_close(alone.predict_proba(query)[0], proba[k], rtol=0, atol=1e-10)
        for name in ("weight0", "bias0", "weight1", "weight2", "bias2", "loc", "scale"):
            torch.testing.assert_close(
                getattr(alone, name)[0], getattr(batched, name)[k], rtol=0, atol=1e-10
            )
    # and the members are genuinely different classifiers
    assert (proba[0] - proba[1]).abs().max() > 1e-3


def test_manual_backward_matches_autograd():
    g = torch.Generator().manual_seed(1)
    for hidden in [(), (5,), (5, 7), (4, 6, 3)]:
        layout = MLPEnsemble._layout([3, *hidden, 1])
        gens = [torch.Generator().manual_seed(k) for k in range(2)]
        flat = MLPEnsemble._init_flat(layout, gens, torch.float64).requires_grad_()
        x = torch.randn(2, 9, 3, generator=g, dtype=torch.float64)
        y = (torch.rand(2, 9, generator=g) < 0.5).double()
        logits, inputs = MLPEnsemble._forward(MLPEnsemble._views(flat, layout), x, keep=True)
        loss = F.binary_cross_entropy_with_logits(logits, y, reduction="none").mean(-1).sum()
        (expected,) = torch.autograd.grad(loss, flat)
        with torch.no_grad():
            delta = (torch.sigmoid(logits) - y) / y.shape[1]
            grads = MLPEnsemble._backward(MLPEnsemble._views(flat, layout), inputs, delta)
        got = torch.cat([grad.reshape(2, -1) for grad in grads], 1)  # the flat layout
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_learns_the_bayes_probabilities():
    """On a logistic model the ensemble's probabilities approach sigmoid(2 f0 - (f2 - 3) / 2)."""
    g = torch.Generator().manual_seed(2)
    own, shared, labels = _logistic_data(3, 6000, g, torch.float32)
    ensemble = MLPEnsemble(3, seed=0).fit([own, shared], labels)
    query_own = torch.randn(2000, 2, generator=g)
    query_shared = 3.0 + 2.0 * torch.randn(2000, 1, generator=g)
    truth = torch.sigmoid(2.0 * query_own[:, 0] - (query_shared[:, 0] - 3.0) / 2.0)
    proba = ensemble.predict_proba([query_own, query_shared])
    assert proba.shape == (3, 2000)
    assert float((proba - truth).abs().mean()) < 0.05
    # the useless feature f1 is ignored: swapping its sign changes little
    flipped = ensemble.predict_proba([query_own * torch.tensor([1.0, -1.0]), query_shared])
    assert float((flipped - proba).abs().mean()) < 0.05


def test_standardization_makes_training_affine_invariant():
    g = torch.Generator().manual_seed(3)
    own, shared, labels = _logistic_data(2, 400, g)
    base = MLPEnsemble(2, hidden_features=(6,), max_epochs=15).fit([own, shared], labels)
    moved = MLPEnsemble(2, hidden_features=(6,), max_epochs=15).fit(
        [1000.0 * own - 7.0, 0.01 * shared + 5.0], labels
    )
    query = torch.randn(30, 3, generator=g, dtype=torch.float64)
    moved_query = torch.cat([1000.0 * query[:, :2] - 7.0, 0.01 * query[:, 2:] + 5.0], 1)
    torch.testing.assert_close(
        moved.predict_proba(moved_query), base.predict_proba(query), rtol=0, atol=1e-7
    )


def test_state_dict_round_trip_with_weights_only_load():
    g = torch.Generator().manual_seed(4)
    own, shared, labels = _logistic_data(3, 300, g, torch.float32)
    ensemble = MLPEnsemble(3, max_epochs=10).fit([own, shared], labels)
    buffer = io.BytesIO()
    torch.save(ensemble.state_dict(), buffer)
    buffer.seek(0)
    fresh = MLPEnsemble(3, max_epochs=10)
    assert not fresh.fitted
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    query = torch.randn(20, 3, generator=g)
    assert fresh.fitted
    assert fresh.in_features == 3
    torch.testing.assert_close(fresh.predict_proba(query), ensemble.predict_proba(query))
    assert list(fresh.parameters()) == []  # weights are buffers: no optimizer picks them up


def test_without_validation_split_monitors_training_loss():
    g = torch.Generator().manual_seed(5)
    own, shared, labels = _logistic_data(2, 500, g, torch.float32)
    ensemble = MLPEnsemble(2, validation_fraction=0.0, patience=2, max_epochs=300)
    ensemble.fit([own, shared], labels)
    assert (ensemble.epochs < 300).all()  # stopped on the training loss
    proba = ensemble.predict_proba([own[0], shared])
    assert float(((proba > 0.5).float() == labels[0]).float().mean()) > 0.7


def test_sklearn_ensemble_matches_sklearn_on_standardized_data():
    g = torch.Generator().manual_seed(6)
    own, shared, labels = _logistic_data(2, 300, g)
    ensemble = SklearnEnsemble(LogisticRegression(C=0.5), num_members=2).fit([own, shared], labels)
    query = torch.randn(25, 3, generator=g, dtype=torch.float64)
    proba = ensemble.predict_proba(query)
    for k in range(2):
        data = torch.cat([own[k], shared], 1).numpy()
        loc, scale = data.mean(0), data.std(0, ddof=1)
        reference = LogisticRegression(C=0.5).fit((data - loc) / scale, labels[k].numpy())
        expected = reference.predict_proba((query.numpy() - loc) / scale)[:, 1]
        np.testing.assert_allclose(proba[k].numpy(), expected, atol=1e-8)


def test_sbibm_reference_classifier_settings():
    model = sbibm_mlp(4, seed=3)
    assert model.hidden_layer_sizes == (40, 40)
    assert (model.activation, model.solver, model.max_iter, model.random_state) == (
        "relu",
        "adam",
        10000,
        3,
    )
    ensemble = make_ensemble("sbibm", num_members=2, seed=7)
    g = torch.Generator().manual_seed(7)
    own, shared, labels = _logistic_data(2, 200, g, torch.float32)
    ensemble.fit([own, shared], labels)
    assert [m.random_state for m in ensemble.members] == [7, 8]
    assert [m.hidden_layer_sizes for m in ensemble.members] == [(30, 30), (30, 30)]
    assert ensemble.predict_proba([own[0], shared]).shape == (2, 200)


def test_bad_input_is_rejected_with_a_clear_message():
    ensemble = MLPEnsemble(2)
    features = torch.randn(50, 3)
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        ensemble.fit(features, torch.full((50,), 0.5))
    with pytest.raises(ValueError, match=r"labels must have shape \(50,\) or \(2, 50\)"):
        ensemble.fit(features, torch.zeros(49))
    with pytest.raises(ValueError, match=r"K = 2 members"):
        ensemble.fit(torch.randn(3, 50, 3), torch.zeros(50))
    with pytest.raises(ValueError, match="share the number of rows"):
        ensemble.fit([features, torch.randn(40, 1)], torch.zeros(50))
    with pytest.raises(ValueError, match="finite"):
        ensemble.fit(features.index_fill(0, torch.tensor([3]), float("nan")), torch.zeros(50))
    with pytest.raises(ValueError, match="call fit first"):
        ensemble.predict_proba(features)
    with pytest.raises(ValueError, match="validation_fraction"):
        MLPEnsemble(validation_fraction=1.0)
    with pytest.raises(ValueError, match="classifier must be 'mlp', 'sbibm'"):
        make_ensemble("forest")
    with pytest.raises(ValueError, match="apply to classifier='mlp' only"):
        make_ensemble("sbibm", hidden_features=(4,))
    fitted = MLPEnsemble(2, max_epochs=2).fit(features, (features[:, 0] > 0).float())
    with pytest.raises(ValueError, match="3 columns"):
        fitted.predict_proba(torch.randn(5, 4))


def test_default_width_is_ten_units_per_feature_up_to_max_width():
    """sbibm's ``10 F`` units for few features, ``max_width`` (128) at most (an embedding, a
    flat image); the local tests bound it at 96, under the user's settings."""
    g = torch.Generator().manual_seed(8)
    for features, width, kwargs in (
        (4, 40, {}), (19, 128, {}), (1027, 128, {}), (19, 96, {"max_width": 96}),
        (7, 70, {"max_width": 96}),
    ):  # fmt: skip
        x = torch.randn(40, features, generator=g)
        fitted = MLPEnsemble(1, max_epochs=1, **kwargs).fit(x, (x[:, 0] > 0).float())
        assert fitted.weight0.shape == (1, features, width)
        assert fitted.weight1.shape == (1, width, width)
    assert local_test_kwargs("mlp", None) == {"patience": 2, "max_width": 96}
    assert local_test_kwargs("mlp", {"patience": 5}) == {"patience": 5, "max_width": 96}
    assert local_test_kwargs("sbibm", None) == {}  # scikit-learn classifiers take none
    with pytest.raises(ValueError, match="max_width must be a positive integer"):
        MLPEnsemble(max_width=0)


def test_fused_adam_step_equals_the_written_out_update(monkeypatch):
    """torch's fused Adam kernel (public functional Adam) and the fallback written out train
    the same ensemble."""
    import torch.optim.adam as torch_adam

    g = torch.Generator().manual_seed(9)
    own, shared, labels = _logistic_data(3, 300, g)
    settings = {"hidden_features": (8, 6), "max_epochs": 30, "weight_decay": 1e-3}
    calls, real = [], torch_adam.adam

    def counted(*args, **kwargs):
        calls.append(kwargs["fused"])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_adam, "adam", counted)
    fused = MLPEnsemble(3, **settings).fit([own, shared], labels)
    assert calls
    assert all(calls)  # the fused kernel ran at every step

    def unavailable(*args, **kwargs):
        raise RuntimeError("no fused kernel on this device")

    monkeypatch.setattr(torch_adam, "adam", unavailable)
    written = MLPEnsemble(3, **settings).fit([own, shared], labels)
    assert torch.equal(fused.epochs, written.epochs)
    for name in ("weight0", "bias0", "weight1", "bias1", "weight2", "bias2"):
        torch.testing.assert_close(getattr(fused, name), getattr(written, name), rtol=0, atol=1e-9)


def test_prediction_in_member_groups_equals_one_batched_pass(monkeypatch):
    """Many rows are predicted a few members at a time: the same probabilities."""
    import calib_lightning.classifiers.mlp as mlp

    g = torch.Generator().manual_seed(10)
    own, shared, labels = _logistic_data(4, 200, g)
    ensemble = MLPEnsemble(4, hidden_features=(8, 6), max_epochs=5).fit([own, shared], labels)
    query = [torch.randn(4, 3000, 2, generator=g, dtype=torch.float64), shared[:1].expand(3000, 1)]
    monkeypatch.setattr(mlp, "_CHUNK_ELEMENTS", 2**14)  # one member per pass, 2048-row chunks
    grouped = ensemble.predict_proba(query)
    monkeypatch.setattr(mlp, "_CHUNK_ELEMENTS", 2**40)  # all members and rows at once
    torch.testing.assert_close(grouped, ensemble.predict_proba(query), rtol=0, atol=1e-12)
