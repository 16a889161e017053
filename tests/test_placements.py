"""A family point that loses is timed again at another placement before the guard acts on it (`familyeval`).

On an H200 the same small op moved by up to a quarter between two builds while each build's interval
stayed tight; a sub-range cut on one placement's loss sent parity kernels to stock. A loss by less than
`RETIMED_ABOVE` is benchmarked again on fresh inputs with the buffers elsewhere (`verify.bench`'s
`placement`), and the runs are pooled: a point loses only where every placement lost.
"""

from pathlib import Path

import pytest
import torch
from test_families import _captured, _tiny_llama
from test_familyeval import _silu

from forgepack import families, familyeval, verify
from forgepack.compile import compile_kernel
from forgepack.evaluate import Evaluator, Verdict

KERNELS = Path(__file__).resolve().parent / "kernels"


def _run(speedup, low, high, eager=8.0):
    return Verdict(True, None, "timed", {"bench": {}}, eager_us=eager, kernel_us=eager / speedup,
                   speedup=speedup, ci_low=low, ci_high=high, bench_s=1.0)


def test_a_loss_at_one_placement_and_a_win_at_another_is_no_loss():
    # the KV cache cat at batch 3, 720 tokens, in two H200 builds (benchmarks/2026-12-04-h200-envelope-both-models)
    first, second = _run(0.85, 0.83, 0.90, eager=6.48), _run(1.15, 1.10, 1.19, eager=8.18)
    both = familyeval.pooled([first, second])
    assert both.ci_low == 0.83 and both.ci_high == 1.19 and not familyeval._slower(both.ci_high)
    assert both.eager_us == pytest.approx((6.48 + 8.18) / 2)
    assert both.speedup == pytest.approx(both.eager_us / ((6.48 / 0.85 + 8.18 / 1.15) / 2))
    assert [p["speedup"] for p in both.diagnostics["placements"]] == [0.85, 1.15] and both.bench_s == 2.0


def test_a_loss_at_every_placement_stays_a_loss():
    both = familyeval.pooled([_run(0.9, 0.88, 0.93), _run(0.92, 0.9, 0.95)])
    assert familyeval._slower(both.ci_high) and both.ci_high == 0.95
    assert 0.9 <= both.speedup <= 0.92


@pytest.fixture(scope="module")
def silu():
    return _silu([c for c in families.fold(_captured(_tiny_llama())) if c.family is not None])


@pytest.fixture(scope="module")
def evaluator():
    with Evaluator("cpu", timeout_s=120) as ev:
        yield ev


def test_every_small_loss_is_benchmarked_again_elsewhere_and_a_confirmed_one_narrows(silu, evaluator, monkeypatch):
    src = (KERNELS / "family_slow_everywhere.cpp").read_text()
    monkeypatch.setattr(familyeval, "RETIMED_ABOVE", 0.0)  # its losses are deep: have them retimed all the same
    verdict = familyeval.evaluate(evaluator, silu, src)
    assert not verdict.accepted and verdict.category == "slower", verdict.reason
    points = verdict.diagnostics["family"]["points"]
    assert points and all(len(p["placements"]) == 1 + familyeval.RETIMES for p in points)
    for p in points:  # real timings at both placements, each slower, pooled into one loss
        assert all(run["ci_high"] < 1.0 for run in p["placements"]) and p["ci_high"] < 1.0
        assert p["ci_low"] == min(run["ci_low"] for run in p["placements"])


def test_a_deep_loss_is_not_benchmarked_again(silu, evaluator):
    src = (KERNELS / "family_slow_everywhere.cpp").read_text()
    verdict = familyeval.evaluate(evaluator, silu, src)  # 32 times the work: far below RETIMED_ABOVE
    points = verdict.diagnostics["family"]["points"]
    assert all(p["speedup"] < familyeval.RETIMED_ABOVE and "placements" not in p for p in points), points


def test_a_kernel_caught_at_the_second_placement_fails_the_family(silu, evaluator):
    # right at the captured sizes only: a check point's benchmark elsewhere catches the unwritten tail
    src = (KERNELS / "family_captured_sizes_only.cpp").read_text()
    compiled = compile_kernel(src, "cpu")
    values = {"d0": 1, "d1": 50}  # 50 tokens: the kernel computes the captured 16 and leaves the rest
    assert values not in [dict(p) for p in silu.family.points]
    assert all(d.min <= values[d.name] <= d.max for d in silu.family.dims)
    lost = [(values, _run(0.9, 0.85, 0.95))]
    verdict = familyeval._confirmed(evaluator, silu, compiled, src, lost, [values], margin=0.05)
    assert isinstance(verdict, Verdict) and verdict.category == "mismatch", verdict
    assert verdict.diagnostics["family"]["failed_at"] == values


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_another_placement_puts_the_same_sizes_at_other_addresses():
    device = torch.device("cuda")
    first = torch.empty(3 << 20, dtype=torch.uint8, device=device)
    where = first.data_ptr()
    del first  # the caching allocator hands this block back for the same size ...
    assert torch.empty(3 << 20, dtype=torch.uint8, device=device).data_ptr() == where
    with verify._placed_apart(1, 12345, device):  # ... unless a spacer holds it
        assert torch.empty(3 << 20, dtype=torch.uint8, device=device).data_ptr() != where
