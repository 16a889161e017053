"""Profile: per-variant times, shares, roofline and classes, written to and read back from the workspace."""

import json
import re
import subprocess
import sys

import pytest
import torch

from forgepack import models, profile, recipe, workspace
from forgepack.capture import card_from_call
from forgepack.devices import DeviceFacts
from forgepack.roofline import card_bytes, card_flops, roofline


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    r = recipe.resolve("tiny-llama")
    ws = workspace.Workspace.for_recipe(r, tmp_path_factory.mktemp("ws"))
    result, cards = profile.run_profile(r, ws)
    return r, ws, result, cards


def test_shares_sum_to_one_and_cards_round_trip(tiny_profile):
    r, ws, result, cards = tiny_profile
    ops = [c for c in cards if c.kind == "op"]  # fusion cards' shares overlap the ops they replace
    assert abs(sum(c.profile.share for c in ops) - 1.0) < 1e-9
    assert result.aten_calls == sum(c.calls for c in ops)
    assert result.e2e_ms > 0 and result.variants == len(ops)
    loaded = {c.id: c for c in ws.load_cards()}
    for c in cards:
        assert loaded[c.id].profile == c.profile and loaded[c.id].op == c.op
    assert ws.load_recipe() == r
    assert profile.load_profile(ws) == result


def test_shares_shown_together_never_pass_100_percent(tiny_profile, monkeypatch):
    """A fusion chain's share overlaps the operator calls it replaces: the profile table and the
    report's class bar show operators (adding up to 100%), and chains apart."""
    from rich.console import Console

    from forgepack import report
    from forgepack.cli import profile as profile_cli

    _, ws, result, cards = tiny_profile
    ops, chains = profile.operators_and_chains(cards)
    assert chains and sum(c.profile.share for c in cards) > 1.0  # why they must not be shown as one list
    assert abs(sum(c.profile.share for c in ops) - 1.0) < 1e-9
    shown = Console(record=True, width=250)
    monkeypatch.setattr(profile_cli, "out", shown)
    profile_cli.show(result, cards, top=0)
    text = shown.export_text()
    operators, _, chain_part = text.partition("fusion chains")
    assert chain_part and "overlaps the table above" in chain_part
    assert not any(c.op.startswith("fusion.") and c.op_name in operators.split() for c in chains)
    totals = report.class_totals(report.gather(ws.root).cards)
    assert "fusion" not in totals and abs(sum(totals.values()) - 1.0) < 1e-9
    page = report.render(report.gather(ws.root), plots=False)
    assert "Fusion chains" in page and "is not added to them" in page


def test_classes_and_roofline_on_cpu(tiny_profile):
    _, _, _, cards = tiny_profile
    classes = {c.op_name: c.profile.baseline for c in cards}
    assert classes["mm"] == "vendor"
    assert classes["view"] == "view" and classes["_unsafe_view"] == "view"
    assert classes["rsqrt"] == "native"
    for c in cards:
        if c.profile.baseline != "view":
            assert c.profile.eager_us > 0 and c.profile.roofline_us > 0


def test_samples_are_kept_and_bounded(tiny_profile):
    _, ws, _, cards = tiny_profile
    kept = [c for c in cards if c.samples]
    assert kept and all(c.samples <= 2 for c in cards)
    assert all(ws.sample_path(c.id).exists() for c in kept)


def test_the_pipeline_reuses_the_workspaces_profile(tiny_profile, monkeypatch):
    from forgepack import pipeline

    r, ws, result, cards = tiny_profile
    monkeypatch.setattr(profile, "run_profile", lambda *a, **k: pytest.fail("profiled again"))
    profiled = pipeline.profile(r, ws)
    assert {c.id for c in profiled.cards} == {c.id for c in cards}
    assert profiled.reused and profiled.profile == result


def test_classify_from_kernel_names():
    assert profile.classify("mm", ["sm90_xmma_gemm_bf16bf16_bf16f32"], "cuda", False) == "vendor"
    assert profile.classify("_softmax", ["void at::native::(anonymous namespace)::cunn_SoftMaxForward"], "cuda",
                            False) == "native"
    assert profile.classify("view", [], "cuda", True) == "view"
    assert profile.classify("addmm", [], "cpu", False) == "vendor"


def test_roofline_counts_matmul_flops_and_bytes():
    a, b = torch.randn(32, 64), torch.randn(64, 16)
    card, _, _ = card_from_call(torch.ops.aten.mm.default, (a, b))
    assert card_flops(card) == 2 * 32 * 16 * 64
    assert card_bytes(card) == 4 * (32 * 64 + 64 * 16 + 32 * 16)
    facts = DeviceFacts("cpu", "x", None, 1, 0, 0, copy_gbps=10.0, matmul_tflops={"float32": 1.0},
                        torch_version="", cuda_version=None)
    roof = roofline(card, facts)
    assert roof.us == pytest.approx(max(card_bytes(card) / 10e9, card_flops(card) / 1e12) * 1e6)


def test_roofline_reads_every_input_even_when_two_look_alike():
    # A residual add of two same-shaped tensors moves three tensors, not two: equal metadata says
    # nothing about aliasing (the first H200 templates table under-counted add and cat this way).
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    card, _, _ = card_from_call(torch.ops.aten.add.Tensor, (a, b))
    assert card_bytes(card) == 3 * a.nbytes
    halves = [torch.randn(16, 8), torch.randn(16, 8)]
    card, _, _ = card_from_call(torch.ops.aten.cat.default, (halves, -1))
    assert card_bytes(card) == 4 * halves[0].nbytes


def test_diagnosis_says_launch_bound_when_gpu_is_idle(tiny_profile):
    _, _, _, cards = tiny_profile
    assert profile.diagnose(0.3, 10.0, 9.0, cards).startswith("launch-bound")
    assert not profile.diagnose(0.95, 10.0, 9.0, cards).startswith("launch-bound")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "forgepack", *args], capture_output=True, text=True, timeout=300)


def test_profile_cli_json(tmp_path):
    proc = _cli("profile", "tiny-bert", "--json", "--workspace", str(tmp_path / "ws"))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["recipe"] == "tiny-bert" and doc["cards"]
    assert abs(sum(c["share"] for c in doc["cards"]) - 1) < 1e-6
    assert (tmp_path / "ws" / "profile.json").exists()


def test_profile_cli_table_of_vision_model(tmp_path):
    proc = _cli("profile", "tiny-resnet", "--workspace", str(tmp_path / "ws"))
    assert proc.returncode == 0, proc.stderr
    assert "convolution" in proc.stdout and "diagnosis:" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no-such/model"], "cannot reach the Hugging Face Hub"),
        (["/no/such/dir"], "does not exist"),
        (["tiny-llama", "--target", "cuda"], "needs a CUDA GPU"),
        (["tiny-llama", "--target", "tpu"], "'target.device' must be one of"),
        (["tiny-llama", "--dtype", "int8"], "'workload.dtype' must be one of"),
    ],
)
def test_profile_cli_bad_input_is_one_line(args, message):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = _cli("profile", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    # off a terminal, a stage that had started (loading the model) logs one timestamped line first
    errors = [line for line in proc.stderr.strip().splitlines() if not re.match(r"\d\d:\d\d:\d\d ", line)]
    assert "Traceback" not in proc.stderr and len(errors) == 1 and message in errors[0]


def test_profile_loads_a_local_model_directory(tiny_llama_dir, tmp_path):
    proc = _cli("profile", str(tiny_llama_dir), "--json", "--workspace", str(tmp_path / "ws"))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert any(c["op"] == "aten.mm.default" for c in doc["cards"])


def test_unknown_recipe_key_in_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[model]\nconfig = { model_type = "llama" }\n[workload]\nseqlen = 3\n')
    proc = _cli("profile", str(bad))
    assert proc.returncode == 2 and "unknown key 'workload.seqlen'" in proc.stderr


@pytest.mark.gpu
def test_profile_end_to_end_matches_plain_timing_on_gpu(tmp_path):
    r = recipe.resolve("tiny-llama").replace(target={"device": "cuda"})
    ws = workspace.Workspace.for_recipe(r, tmp_path / "ws")
    result, cards = profile.run_profile(r, ws)
    assert result.gpu_busy is not None and 0 < result.gpu_busy <= 1, result
    classes = {(c.op_name, c.profile.baseline, c.profile.kernels) for c in cards}
    assert any(c.profile.baseline == "vendor" for c in cards), classes
    assert all(c.profile.kernels == () for c in cards if c.profile.baseline == "view"), classes
    # The end-to-end time against a plain loop of the same forward (synchronised wall clock, median of
    # rounds): a profile off by 2x either way fails; launch-bound at this size, so both see the same launches.
    with models.quiet_transformers():
        lm = models.load(r)
    plain_ms = _plain_forward_ms(lm)
    assert 0.5 < result.e2e_ms / plain_ms < 2.0, (result.e2e_ms, plain_ms)
    assert result.kernel_ms is not None and 0 < result.kernel_ms <= result.e2e_ms * 1.05, result


def _plain_forward_ms(lm, rounds: int = 9, loops: int = 10) -> float:
    import statistics
    import time

    for _ in range(5):
        lm.run()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(loops):
            lm.run()
        torch.cuda.synchronize()
        per.append((time.perf_counter() - start) / loops * 1e3)
    return statistics.median(per)
