"""Graph mode inside `model.generate()` (forgepack/runtime/serving.py).

CPU: the emulated backend (a recorded aten trace replayed on the same tensors, no Python on replay) on a
tiny Llama saved with random weights and loaded through `from_pretrained`: buckets, batch and prompt
padding, the cache rewound after a padded prefill, teacher-forced logits of every step against eager,
replays counted, a caller's static cache, no_grad and inference_mode, transformers' compile kept off.
GPU (`gpu` marker): the same with real CUDA graphs.
"""

from __future__ import annotations

import copy
import logging
import types

import pytest
import torch

from forgepack.runtime import compare, graphs, serving

EMU = {"backend": "emulate"}
# decode_loop off: these tests count generate()'s own forward calls (tests/test_decodeloop.py: the loop)
SMALL = {"cache_lengths": (64, 128), "prompt_buckets": (8, 16, 32), "decode_loop": False}


def load(path, device="cpu", dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


@pytest.fixture
def pair(tiny_llama_dir):
    """(served model, eager twin): the same weights, loaded twice."""
    model, twin = load(tiny_llama_dir), load(tiny_llama_dir)
    yield model, twin
    serving.stop(model)


def scale_error(expected: torch.Tensor, got: torch.Tensor) -> float:
    return compare.scale_error(expected.float(), got.float())


def teacher_forced(twin, sequences: torch.Tensor, prompt: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Eager logits that predict each generated token, given the tokens before it: [steps, batch, vocab]."""
    full = None if mask is None else torch.cat([mask, mask.new_ones(mask.shape[0], sequences.shape[1] - prompt)], 1)
    with torch.no_grad():
        logits = twin(input_ids=sequences, attention_mask=full, use_cache=False).logits
    return logits[:, prompt - 1:-1].transpose(0, 1)


def generate(model, ids, new=6, **kwargs):
    return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True, **kwargs)


# --- buckets -----------------------------------------------------------------------------------------


def test_ladders_and_buckets():
    assert serving.ladder(16, 300)[:8] == (16, 32, 48, 64, 96, 144, 224, 336)
    assert all(b % 16 == 0 for b in serving.DEFAULT_PROMPT_BUCKETS) and serving.DEFAULT_PROMPT_BUCKETS[-1] >= 4096
    options = serving.ServeOptions(cache_lengths=(64, 256), max_cache_len=200)
    assert [options.batch_bucket(b) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert options.prompt_bucket(17) == 32 and options.prompt_bucket(6000) == 6000
    assert options.cache_length(60, cap=512) == 64
    assert options.cache_length(100, cap=512) == 200  # the next rung is over max_cache_len: the cap itself
    assert options.cache_length(201, cap=512) is None and options.cache_length(100, cap=90) is None
    with pytest.raises(ValueError):
        serving.ServeOptions(batch_buckets=())


# --- padding and masking, one forward at a time ------------------------------------------------------


def test_padded_prefill_matches_the_unpadded_one_and_leaves_the_cache_as_it_would(tiny_llama_dir):
    """Right-padded prompt and padded batch against the exact call: the real rows' logits at the last real
    position agree, the cache holds the same keys in the real slots, and its length is rewound to the
    real length, so the next decode step sees exactly what it would have seen."""
    from transformers import StaticCache

    model = load(tiny_llama_dir)
    key = graphs.cache_kwarg(model)
    ids = torch.randint(1, 256, (3, 11))
    exact, padded = (StaticCache(config=model.config, max_cache_len=64) for _ in range(2))
    call = {"input_ids": ids, "position_ids": torch.arange(11).expand(3, 11), "logits_to_keep": 1, "use_cache": True}
    with torch.no_grad():
        ref = model(**call, **{key: exact}).logits
        wide = serving._pad_rows(serving._pad_prompt({**call, key: padded}, 11, 16), 3, 4)
        assert wide["input_ids"].shape == (4, 16) and wide["logits_to_keep"].tolist() == [10]
        out = model(**wide).logits
        serving._rewind(padded, 16 - 11)
        assert torch.allclose(out[:3], ref, atol=1e-5)
        for mine, theirs in zip(padded.layers, exact.layers, strict=True):
            assert int(mine.cumulative_length) == 11
            assert torch.allclose(mine.keys[:3, :, :11], theirs.keys[:, :, :11], atol=1e-6)
        # the next step, with the mask generate builds from the rewound length, sees no padded slot
        token = ref.argmax(-1)
        step = {"input_ids": token, "position_ids": torch.full((3, 1), 11), "use_cache": True, "logits_to_keep": 1}
        ref_next = model(**step, **{key: exact}).logits
        out_next = model(**serving._pad_rows({**step, key: padded}, 3, 4)).logits
        assert torch.allclose(out_next[:3], ref_next, atol=1e-5)


def test_a_padded_query_row_attends_like_the_last_real_one():
    mask = torch.zeros(2, 1, 3, 8, dtype=torch.bool)
    mask[:, :, 0, :1] = mask[:, :, 1, :2] = mask[:, :, 2, :3] = True
    out = serving._pad_prompt({"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": mask}, 3, 5)
    wide = out["attention_mask"]
    assert wide.shape == (2, 1, 5, 8) and torch.equal(wide[:, :, :3], mask)
    assert torch.equal(wide[:, :, 3], mask[:, :, 2]) and torch.equal(wide[:, :, 4], mask[:, :, 2])
    assert out["input_ids"][:, 3:].eq(0).all()


# --- a full generate() -------------------------------------------------------------------------------


def test_generate_replays_and_matches_eager_teacher_forced(pair):
    """Default cache (none passed): forgepack's static cache for the batch bucket, prompts padded to a rung;
    every step's logits agree with eager logits of the same sequence (max error over scale), the tokens are
    eager's, dummy rows never reach the output, and stats() proves the decode steps replayed."""
    model, twin = pair
    server = serving.serve(model, **EMU, **SMALL)
    with torch.no_grad():
        for length in (9, 10, 12, 13):
            ids = torch.randint(1, 256, (3, length))
            out = generate(model, ids)
            ref = generate(twin, ids)
            assert out.sequences.shape == ref.sequences.shape == (3, length + 6)
            assert torch.equal(out.sequences, ref.sequences)
            steps = torch.stack(out.logits)  # [steps, batch, vocab]: the real rows only
            assert steps.shape == (6, 3, 256)
            assert scale_error(teacher_forced(twin, out.sequences, length), steps) < 1e-5
            assert out.get("cache") is None and out.get("past_key_values") is None  # the server keeps its cache
    stats = server.stats()
    decode, prefill = stats["buckets"]["decode b4 c64"], stats["buckets"]["prefill b4 s16 c64"]
    assert decode["calls"] == 4 * 5 and decode["captures"] == 1 and decode["replays"] == 4 * 5 - 2
    assert prefill["calls"] == 4 and prefill["replays"] >= 1  # the 4th prompt replays the 16-token graph
    assert stats["caches"] == [(4, 64, False)] and stats["graphs"]["fallbacks"] == 0
    assert stats["served_requests"] == 4 and not stats["eager_requests"]


def test_a_static_cache_implementation_gets_forgepack_s_cache(pair):
    """cache_implementation="static", asked in the call or by the model's generation config, would build a
    new cache per call (no graph could be reused): forgepack's bucketed cache serves it instead."""
    model, twin = pair
    server = serving.serve(model, **EMU, **SMALL)
    model.generation_config.cache_implementation = "static"
    ids = torch.randint(1, 256, (2, 9))
    with torch.no_grad():
        for _ in range(2):
            out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
            assert torch.equal(out, twin.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0))
            model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert server.stats()["caches"] == [(2, 64, False)] and server.stats()["served_requests"] == 4
    assert server.stats()["buckets"]["decode b2 c64"]["replays"] == 4 * 4 - 2


def test_a_left_padded_batch_matches_eager(pair):
    """A caller's padding mask (left padding, as tokenizers give it for generation) goes through the
    4D mask generate builds; padded query rows copy the last real row, so nothing is empty or NaN."""
    model, twin = pair
    serving.serve(model, **EMU, **SMALL)
    ids = torch.randint(1, 256, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ids[0, :4] = 0
    with torch.no_grad():
        for _ in range(3):
            out = generate(model, ids, attention_mask=mask)
            ref = generate(twin, ids, attention_mask=mask)
            assert torch.equal(out.sequences, ref.sequences)
            steps = torch.stack(out.logits)
            assert torch.isfinite(steps).all()
            assert scale_error(teacher_forced(twin, out.sequences, 10, mask), steps) < 1e-5


def test_a_caller_static_cache_is_used_as_given_with_prompt_padding(pair):
    from transformers import StaticCache

    model, twin = pair
    server = serving.serve(model, **EMU, **SMALL)
    key = graphs.cache_kwarg(model)
    cache = StaticCache(config=model.config, max_cache_len=48)
    with torch.no_grad():
        for length in (9, 11, 14):
            ids = torch.randint(1, 256, (2, length))
            cache.reset()
            out = generate(model, ids, **{key: cache})
            ref = generate(twin, ids)
            assert torch.equal(out.sequences, ref.sequences)
            assert int(cache.layers[0].cumulative_length) == length + 5  # the last token is not fed back
            assert cache.layers[0].keys.shape[0] == 2  # the caller's rows: no dummy row in their cache
    stats = server.stats()["buckets"]
    assert stats["decode b2 c48"]["replays"] == 3 * 5 - 2 and "prefill b2 s16 c48" in stats


def test_inference_mode_and_no_grad_both_replay(pair):
    """Capture under torch.inference_mode(): transformers' mask is an inference tensor without a
    version counter (the H200 failed every such capture); both modes replay, each its own graphs."""
    model, twin = pair
    server = serving.serve(model, **EMU, **SMALL)
    ids = torch.randint(1, 256, (1, 7))
    ref = generate(twin, ids)
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            out = generate(model, ids)
        assert torch.equal(out.sequences, ref.sequences)
    stats = server.stats()
    assert stats["graphs"]["fallbacks"] == 0 and stats["graphs"]["captures"] == 2, stats
    assert stats["buckets"]["decode b1 c64"]["replays"] == 2 * (5 - 2)


def test_graphed_decode_captures_under_inference_mode():
    """The regression itself, without the server: a static-cache decode step captured in inference mode."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64)).eval()
    cache = StaticCache(config=model.config, max_cache_len=16)
    run = graphs.GraphedForward(model, **EMU)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 64, (1, 4)), use_cache=True, **{graphs.cache_kwarg(model): cache})
        mask = torch.ones(1, 1, 1, 16, dtype=torch.bool)
        for _ in range(4):
            run(**graphs.decode_kwargs(model, torch.randint(0, 64, (1, 1)), cache), attention_mask=mask)
    assert run.stats()["replays"] == 2 and not run.stats()["failures"], run.stats()


def test_transformers_compile_is_off_for_a_served_model(pair, caplog):
    model, _ = pair
    seen = []
    real = model._valid_auto_compile_criteria

    def spy(model_kwargs, generation_config):
        seen.append(generation_config.disable_compile)
        return real(model_kwargs, generation_config)

    model._valid_auto_compile_criteria = spy
    with caplog.at_level(logging.INFO, logger=serving.__name__):
        serving.serve(model, **EMU, **SMALL)
    assert any("automatic torch.compile is off" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        model.generate(torch.randint(1, 256, (1, 5)), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert seen and all(seen)
    serving.stop(model)
    seen.clear()
    with torch.no_grad():
        model.generate(torch.randint(1, 256, (1, 5)), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert seen and not any(seen)  # stopped: generate is the model's own again, compile as transformers decides


def test_requests_it_does_not_serve_run_eagerly_and_say_why(pair):
    from transformers import DynamicCache

    model, twin = pair
    server = serving.serve(model, **EMU, **SMALL)
    ids = torch.randint(1, 256, (2, 6))
    with torch.no_grad():
        beams = model.generate(ids, max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=0)
        assert torch.equal(beams, twin.generate(ids, max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=0))
        model.generate(torch.randint(1, 256, (9, 6)), max_new_tokens=2, pad_token_id=0)
        model.generate(ids, max_new_tokens=2, pad_token_id=0, **{graphs.cache_kwarg(model): DynamicCache()})
        model.generate(ids, max_new_tokens=300, pad_token_id=0)
    why = server.stats()["eager_requests"]
    assert why["beam search"] == 1 and why["batch 9 is over the largest bucket (8)"] == 1
    assert any("DynamicCache is not replayable" in k for k in why) and any("over the largest cache" in k for k in why)
    assert server.stats()["graphs"]["captures"] == 0


def test_warmup_captures_before_the_first_request(pair):
    model, twin = pair
    stats = serving.warmup(model, batch_sizes=(1, 3), prompt_lengths=(10,), max_new_tokens=(6,), **EMU, **SMALL)
    assert set(stats["buckets"]) == {"decode b1 c64", "prefill b1 s16 c64", "decode b4 c64", "prefill b4 s16 c64"}
    server = serving.server(model)
    captures = server.stats()["graphs"]["captures"]
    ids = torch.randint(1, 256, (3, 12))
    with torch.no_grad():
        out = generate(model, ids)
    assert torch.equal(out.sequences, generate(twin, ids).sequences)
    after = server.stats()
    assert after["graphs"]["captures"] == captures  # nothing new to capture: every call replayed
    assert after["graphs"]["replays"] - stats["graphs"]["replays"] == 6


def test_stop_restores_generate_and_the_forward():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=64)).eval()
    assert "generate" not in vars(model) and "forward" not in vars(model)
    server = serving.serve(model, **EMU)
    assert serving.serve(model) is server and serving.server(model) is server
    assert "generate" in vars(model) and isinstance(model.forward, graphs.GraphedForward)
    twin = copy.deepcopy(model)  # the copy must not serve through the original's server
    assert twin.generate.__self__ is twin and serving.server(twin) is None
    assert serving.stop_all() == 1
    assert "generate" not in vars(model) and "forward" not in vars(model) and serving.server(model) is None


def test_sampling_draws_what_eager_draws(pair):
    """generate() samples from the real rows only: with the same seed, the same draws as eager."""
    model, twin = pair
    serving.serve(model, **EMU, **SMALL)
    ids = torch.randint(1, 256, (3, 9))
    with torch.no_grad():
        for seed in (1, 2, 3):
            torch.manual_seed(seed)
            out = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=0)
            torch.manual_seed(seed)
            assert torch.equal(out, twin.generate(ids, max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=0))


def test_activate_serves_generate_and_deactivate_gives_it_back(tiny_llama_dir, monkeypatch):
    """The pack's wiring: activate(graphs=True, model=...) installs the server (serve=False only graph
    mode on the forward), and deactivate() gives generate() back before graph mode goes."""
    from forgepack import runtime
    from forgepack.runtime.packinfo import GraphVerdict

    monkeypatch.setattr(runtime, "manifest", lambda: types.SimpleNamespace(graphs=GraphVerdict()))
    monkeypatch.setattr(runtime, "_fused", lambda: None)
    monkeypatch.setitem(runtime._STATE, "loaded", False)
    model = load(tiny_llama_dir)
    runtime._enable_graphs(model, {"backend": "emulate", "cache_lengths": (64,)})
    assert serving.server(model) is not None and "generate" in vars(model)
    assert serving.server(model).options.cache_lengths == (64,)
    runtime.deactivate()
    assert serving.server(model) is None and "generate" not in vars(model) and "forward" not in vars(model)
    runtime._enable_graphs(model, {"backend": "emulate", "serve": False})
    assert serving.server(model) is None and isinstance(model.forward, graphs.GraphedForward)
    runtime.deactivate()
    assert "forward" not in vars(model)


def test_serving_imports_only_torch_the_standard_library_graphs_and_the_decode_loop():
    import ast
    import sys
    from pathlib import Path

    roots = set()
    for node in ast.walk(ast.parse(Path(serving.__file__).read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            assert node.module is None and [a.name for a in node.names] == ["decodeloop", "graphs"], ast.dump(node)
        elif isinstance(node, ast.ImportFrom):
            roots.add(node.module.split(".")[0])
    assert roots - {"torch", "__future__", "transformers"} <= set(sys.stdlib_module_names), roots


# --- real CUDA graphs ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_generate_replays_and_matches_eager(tiny_llama_dir, dtype):
    model, twin = load(tiny_llama_dir, "cuda", dtype), load(tiny_llama_dir, "cuda", dtype)
    server = serving.serve(model, cache_lengths=(64, 128), prompt_buckets=(8, 16, 32), decode_loop=False)
    try:
        with torch.no_grad():
            for length in (9, 12, 14, 10):
                ids = torch.randint(1, 256, (3, length), device="cuda")
                out, ref = generate(model, ids, new=8), generate(twin, ids, new=8)
                steps = torch.stack(out.logits)
                # teacher-forced, not token by token: random weights have near-ties that a few ulps flip
                tolerance = 1e-4 if dtype == torch.float32 else 5e-2  # the pack's model tolerance in bf16
                assert scale_error(teacher_forced(twin, out.sequences, length), steps) < tolerance
                assert scale_error(torch.stack(ref.logits), steps) < tolerance or not torch.equal(
                    out.sequences, ref.sequences)
        stats = server.stats()
        assert stats["buckets"]["decode b4 c64"]["replays"] == 4 * 7 - 2, stats
        assert stats["buckets"]["prefill b4 s16 c64"]["replays"] >= 1 and stats["graphs"]["fallbacks"] == 0, stats
    finally:
        serving.stop(model)


@pytest.mark.gpu
def test_gpu_inference_mode_capture(tiny_llama_dir):
    model, twin = load(tiny_llama_dir, "cuda"), load(tiny_llama_dir, "cuda")
    server = serving.serve(model, cache_lengths=(64,), prompt_buckets=(16,), decode_loop=False)
    try:
        ids = torch.randint(1, 256, (2, 9), device="cuda")
        with torch.inference_mode():
            for _ in range(4):  # prefill: a fresh cache's call, two warm-ups, the capture
                out = generate(model, ids, new=8)
            steps = torch.stack(out.logits)
            assert scale_error(teacher_forced(twin, out.sequences, 9), steps) < 1e-4
        stats = server.stats()
        assert stats["graphs"]["fallbacks"] == 0 and not stats["graphs"]["failures"], stats
        assert stats["buckets"]["decode b2 c64"]["replays"] == 4 * 7 - 2, stats
        assert stats["buckets"]["prefill b2 s16 c64"]["replays"] == 1, stats
    finally:
        serving.stop(model)


# --- the serving benchmark -----------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_serve_smoke_on_cpu(tmp_path, monkeypatch):
    """tools/bench_serve.py end to end on the tiny model: eager and the served path agree with eager
    teacher-forced, and the results land as JSON and markdown with date, device, commit and command."""
    import json
    import sys
    from pathlib import Path

    tools = Path(__file__).resolve().parent.parent / "tools"
    monkeypatch.syspath_prepend(str(tools))
    import bench_serve

    monkeypatch.setattr(sys, "argv", ["bench_serve.py", "--models", "tiny-llama", "--requests", "3", "--batches",
                                      "1,3", "--prompt", "16,40", "--new", "6,10", "--rounds", "1", "--agree", "1",
                                      "--out", str(tmp_path)])
    assert bench_serve.main() == 0
    data = json.loads((tmp_path / "results" / "bench_serve-tiny-llama.json").read_text())
    assert {"date", "gpu", "commit", "command"} <= set(data)
    cols = data["results"]["tiny-llama"]["columns"]
    assert set(cols) >= {"eager", "graphs"}
    assert cols["graphs"]["top1"] == 1.0 and cols["graphs"]["max_err_over_scale"] < 1e-4
    assert cols["graphs"]["serving"]["graphs"]["replays"] > 0
    loop = cols["graphs"]["serving"]["decode_loop"]  # every request of the column: the graph-captured decode loop
    assert loop["requests"] > 0 and not loop["fallbacks"] and not loop["failures"], loop
    assert "| graphs" in (tmp_path / "results" / "bench_serve-tiny-llama.md").read_text()
