"""Replay verification and output comparison (forgepack/runtime/replaycheck.py, compare.py) through
the emulated backend; the transformers-model cases are in tests/test_graphs.py."""

from __future__ import annotations

import torch
from graph_models import EMU, Accumulates, Counter, Mlp, Scaled, Syncs

from forgepack.runtime import compare, replaycheck

# --- verification ------------------------------------------------------------------------------------


def test_verify_replay_accepts_a_pure_forward_and_leaves_state_as_found():
    model = Accumulates()
    before = model.total.clone()
    ok, reason = replaycheck.verify_replay(model, lambda step: (torch.randn(4),), n=3, **EMU)
    assert ok, reason
    assert torch.equal(model.total, before)


def test_verify_replay_catches_python_state_a_replay_cannot_see():
    model = Scaled()

    def make(step):
        model.scale = 1.0 + step  # eager follows the attribute; the captured graph keeps 3.0
        return (torch.randn(4),)

    ok, reason = replaycheck.verify_replay(model, make, n=3, **EMU)
    assert not ok and reason.startswith("replay step 3") and "differ" in reason


def test_verify_replay_catches_a_counter():
    ok, reason = replaycheck.verify_replay(Counter(), lambda step: (torch.zeros(2),), **EMU)
    assert not ok and "Python-side state" in reason


def test_capture_safe_check_names_the_host_sync():
    ok, reason = replaycheck.capture_safe_check(Syncs(), (torch.randn(3),), backend="emulate")
    assert not ok and "not graphed" in reason and "_local_scalar_dense" in reason
    ok, reason = replaycheck.capture_safe_check(Mlp().eval(), (torch.randn(2, 8),), backend="emulate")
    assert ok, reason


def test_capture_safe_check_on_cpu_with_cuda_backend_says_why():
    ok, reason = replaycheck.capture_safe_check(Mlp().eval(), (torch.randn(2, 8),))
    assert not ok and ("CUDA" in reason or "cpu" in reason)


def test_mismatch_reports_where():
    a = {"logits": torch.zeros(3), "n": 1}
    b = {"logits": torch.tensor([0.0, 1.0, 0.0]), "n": 1}
    why = compare.outputs_mismatch(a, b)
    assert "out['logits']" in why and "1 of 3 elements differ" in why
    assert compare.outputs_mismatch(a, {"logits": torch.zeros(3), "n": 2}) == "out['n']: 2 instead of 1"
    assert "NaN" in compare.tensor_mismatch(torch.tensor([float("nan")]), torch.tensor([0.0]))
    assert compare.tensor_mismatch(torch.tensor([1.0]), torch.tensor([1.0 + 1e-6])) == ""


def test_scale_relative_tolerance_is_the_gate_s_model_tolerance():
    """`scale_rtol`: the largest difference over the largest magnitude, as the gate compares a model's
    outputs; a few ulps of bf16 logits pass, a stale or wrong value does not, Inf must match."""
    e = torch.tensor([4.0, -3.0, 0.01, 2.0]).bfloat16()
    g = e.clone()
    g[2] += 0.125  # far outside elementwise allclose at 0.01, 3% of the scale
    assert compare.tensor_mismatch(e, g) and not compare.tensor_mismatch(e, g, scale_rtol=5e-2)
    g[0] = -4.0
    assert "of its scale" in compare.tensor_mismatch(e, g, scale_rtol=5e-2)
    inf = torch.tensor([float("-inf"), 1.0])
    assert "Inf" in compare.tensor_mismatch(inf, torch.tensor([-1e30, 1.0]), scale_rtol=5e-2)
    assert compare.outputs_mismatch({"x": e}, {"x": e.clone()}, scale_rtol=5e-2) == ""
