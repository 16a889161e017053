"""Graph mode inside `model.generate()` (forgepack/runtime/serving.py).

CPU: the emulated backend (a recorded aten trace replayed on the same tensors, no Python on replay) on a
tiny Llama saved with random weights and loaded through `from_pretrained`: buckets, batch and prompt
padding, the cache rewound after a padded prefill, teacher-forced logits of every step against eager,
replays counted, a caller's static cache, no_grad and inference_mode, transformers' compile kept off.
The tiny grammar-trained model (forgepack/trainedlm.py) has decisive greedy tokens, so on it the served
tokens are compared with eager's unconditionally.
GPU (`gpu` marker): the same with real CUDA graphs, token for token on the trained model.
"""

from __future__ import annotations

import copy
import itertools
import logging
import types

import pytest
import torch

from forgepack.runtime import compare, graphs, serving
from forgepack.trainedlm import follows_grammar, grammar_prompts

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


def cache_size(model, rows: int, length: int) -> int:
    """The bytes forgepack's KV cache of this bucket holds (what max_bytes counts for it)."""
    from transformers import StaticCache

    return serving.expected_cache_bytes(model, StaticCache(config=model.config, max_cache_len=length), rows)


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
    defaults = serving.ServeOptions()  # the defaults: batch 1, 2, 4, 8; prompts on a geometric ladder
    rungs = defaults.prompt_buckets
    assert defaults.batch_buckets == (1, 2, 4, 8) and rungs[0] == 16 and len(rungs) < 25
    assert all(a < b <= max(a + 16, 1.5 * a + 8) for a, b in itertools.pairwise(rungs))  # at most 1.5x each step


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


def test_padding_never_leaks_padded_against_exact_buckets(tiny_llama_dir):
    """The same requests served twice with the emulated backend: padded (3 rows to a bucket of 4, an
    11-token prompt to a rung of 16) and with buckets that fit them exactly (3 rows, 11 positions). Every
    step's logits of the real rows agree, with and without a caller's left-padding mask, from the
    warm-up calls to the replays: neither the dummy row nor the padded positions reach a result."""
    wide, exact = load(tiny_llama_dir), load(tiny_llama_dir)
    try:
        padded = serving.serve(wide, batch_buckets=(4,), prompt_buckets=(16,), cache_lengths=(64,), **EMU)
        fitted = serving.serve(exact, batch_buckets=(3,), prompt_buckets=(11,), cache_lengths=(64,), **EMU)
        ids = torch.randint(1, 256, (3, 11))
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        ids[1, :3] = 0
        with torch.no_grad():
            for extra in ({}, {"attention_mask": mask}):
                for _ in range(4):  # warm-up calls, the captures, replays
                    got, ref = generate(wide, ids, **extra), generate(exact, ids, **extra)
                    assert torch.equal(got.sequences, ref.sequences)
                    steps = torch.stack(got.logits)
                    assert steps.shape == (6, 3, 256) and torch.isfinite(steps).all()
                    assert scale_error(torch.stack(ref.logits), steps) < 1e-5
        buckets = padded.stats()["buckets"]
        assert buckets["prefill b4 s16 c64"]["replays"] >= 1 and buckets["decode b4 c64"]["replays"] >= 8 * 5 - 4
        assert set(fitted.stats()["buckets"]) == {"prefill b3 s11 c64", "decode b3 c64"}
    finally:
        serving.stop(wide)
        serving.stop(exact)


def test_graphs_over_max_bytes_run_eagerly_and_stats_say_why(pair):
    """max_bytes bounds the memory the server holds (one pool, graphs.GraphedForward's bound): with room for
    the bucket's KV cache only, a graph over it is replayed for the call that captured it and dropped, and
    its bucket then counts its calls under "over max_bytes" (not "capture failed": nothing failed). Results
    stay eager's."""
    model, twin = pair
    server = serving.serve(model, max_bytes=cache_size(model, 2, 64), **EMU, **SMALL)
    ids = torch.randint(1, 256, (2, 9))
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(generate(model, ids).sequences, generate(twin, ids).sequences)
    stats = server.stats()
    assert stats["graphs"]["graphs"] == 0 and stats["graphs"]["graph_bytes"] == 0
    decode = stats["buckets"]["decode b2 c64"]
    # 10 decode steps: two warm-ups, the capture (one replay, then dropped), seven eager for its size
    assert decode == {"calls": 10, "eager: warm-up": 2, "captures": 1, "replays": 1, "eager: over max_bytes": 7}
    limit = cache_size(model, 2, 64)
    assert all(f"over max_bytes={limit}" in why for why in stats["graphs"]["failures"].values())
    assert stats["cache_bytes"] == limit == stats["budget"]["bytes"]


def test_the_bytes_bound_evicts_the_least_recently_used_bucket(pair):
    """A bound that holds one decode graph: a second bucket's graph evicts the first, counted."""
    model, twin = pair
    probe = serving.serve(model, **EMU, **SMALL)
    ids = {rows: torch.randint(1, 256, (rows, 9)) for rows in (1, 2)}
    with torch.no_grad():
        for _ in range(2):
            generate(model, ids[2])
    one = max(probe.stats()["graphs"]["graph_bytes"], 1)
    serving.stop(model)
    server = serving.serve(model, max_bytes=int(one * 1.2), **EMU, **SMALL)
    with torch.no_grad():
        for rows in (2, 2, 1, 1, 2):
            assert torch.equal(generate(model, ids[rows]).sequences, generate(twin, ids[rows]).sequences)
    stats = server.stats()["graphs"]
    assert stats["evictions"] >= 1 and stats["graph_bytes"] <= one * 1.2


def held(server) -> dict:
    """What forgepack holds, counted apart from the ledger: the StaticCaches alive in the process (the
    eager twin makes none) with their allocated bytes, and the graphs of the graphed forward and the loop."""
    import gc

    from transformers import StaticCache

    gc.collect()
    caches = [o for o in gc.get_objects() if isinstance(o, StaticCache)]  # counted, not kept: no reference left
    graph_bytes = sum(entry.nbytes for entry in server.pool.entries("graph"))
    return {"caches": len(caches), "cache_bytes": sum(serving.cache_bytes(c) for c in caches),
            "graph_bytes": graph_bytes, "loop_bytes": sum(loop.state.nbytes() + (loop.graph.nbytes if loop.graph else 0)
                              for loop in server.pool.entries("loop"))}


def newly_made(server) -> int:
    """How many of the caches the server holds were not held at the last look (a function: no reference
    to a cache stays in the test's frame, or the count of caches alive would see it)."""
    new = [c for c in server.pool.entries("cache") if not hasattr(c, "_seen_by_test")]
    for cache in new:
        cache._seen_by_test = True
    return len(new)


@pytest.mark.parametrize("decode_loop", [False, True])
def test_a_trace_over_buckets_stays_under_max_bytes_evicting_caches_with_their_graphs(pair, decode_loop):
    """max_bytes covers forgepack's KV caches with its graphs: a bound that holds the largest bucket's cache and
    graphs but no second cache beside them. A trace alternating batch buckets 1, 2 and 4 evicts the least
    recently used cache with the graphs captured on it and re-creates it when its bucket comes back; after every
    request the caches alive in the process and the graphs held (counted apart from the ledger) stay under the
    bound, and every request's tokens are eager's and its logits eager's within fp32 noise."""
    model, twin = pair
    options = {**EMU, **SMALL, "decode_loop": decode_loop}
    ids = {rows: torch.randint(1, 256, (rows, 9)) for rows in (1, 2, 3)}
    probe = serving.serve(model, **options)
    with torch.no_grad():
        for _ in range(4):
            generate(model, ids[3])
    footprint = probe.stats()["budget"]["bytes"]  # the b4 bucket's cache, graphs and loop, all captured
    serving.stop(model)
    limit = footprint + 1000  # no room for even the b1 cache beside it
    assert cache_size(model, 1, 64) > 1000
    server = serving.serve(model, max_bytes=limit, **options)
    made = 0  # caches forgepack made: more than the three buckets when evicted ones were made again
    with torch.no_grad():
        for rows in (3, 3, 3, 1, 1, 2, 3, 3, 1, 2, 2, 3):
            out, ref = generate(model, ids[rows]), generate(twin, ids[rows])
            assert torch.equal(out.sequences, ref.sequences)
            assert scale_error(torch.stack(ref.logits), torch.stack(out.logits)) < 1e-5
            now = held(server)
            stats = server.stats()
            assert now["cache_bytes"] == stats["cache_bytes"] and now["caches"] == len(stats["caches"])
            assert now["graph_bytes"] == stats["graphs"]["graph_bytes"]
            assert now["loop_bytes"] == stats["decode_loop"]["bytes"]
            total = now["cache_bytes"] + now["graph_bytes"] + now["loop_bytes"]
            assert total == stats["budget"]["bytes"] <= limit, stats["budget"]
            made += newly_made(server)
    stats = server.stats()
    assert stats["served_requests"] == 12 and not stats["eager_requests"]
    evicted = stats["budget"]["evictions"]
    assert stats["cache_evictions"] == evicted["cache"] >= 3, stats["budget"]
    assert made == evicted["cache"] + len(stats["caches"]) > 3  # every cache made is held or was evicted
    assert evicted["graph"] + evicted["loop"] >= evicted["cache"]  # its graphs went with each cache
    replays = stats["decode_loop"]["buckets"] if decode_loop else stats["buckets"]
    assert replays["decode b4 c64"]["replays"] > 0  # re-created buckets still replay after their warm-up


def test_a_bucket_whose_cache_can_never_fit_runs_eagerly_and_says_why(pair):
    """A bound under the b2 cache's bytes: a 2-row request runs eagerly (its tokens eager's, the reason in
    stats(), nothing allocated for it), while a 1-row request is still served under the same bound."""
    model, twin = pair
    limit = cache_size(model, 2, 64) - 1
    server = serving.serve(model, max_bytes=limit, **EMU, **SMALL)
    with torch.no_grad():
        for rows in (2, 1, 2):
            ids = torch.randint(1, 256, (rows, 9))
            assert torch.equal(generate(model, ids).sequences, generate(twin, ids).sequences)
    stats = server.stats()
    why = f"its KV cache (b2 c64) needs {limit + 1} bytes, over max_bytes={limit}"
    assert stats["eager_requests"] == {why: 2} and stats["served_requests"] == 1
    assert stats["caches"] == [(1, 64, False)] and stats["budget"]["bytes"] <= limit
    assert not any(k.endswith("b2 c64") for k in stats["buckets"])


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


def spy_compile(model) -> list:
    """Records `generation_config.disable_compile` each time generate() asks whether to compile."""
    seen = []
    real = model._valid_auto_compile_criteria

    def spy(model_kwargs, generation_config):
        seen.append(generation_config.disable_compile)
        return real(model_kwargs, generation_config)

    model._valid_auto_compile_criteria = spy
    return seen


def test_transformers_compile_is_off_for_a_served_model(pair, caplog):
    model, _ = pair
    seen = spy_compile(model)
    with caplog.at_level(logging.INFO, logger=serving.__name__):
        serving.serve(model, **EMU, **SMALL)
    lines = [r.getMessage() for r in caplog.records if "automatic torch.compile is off" in r.getMessage()]
    assert len(lines) == 1 and "forgepack.runtime.serving.stop(model)" in lines[0], lines
    assert "the pack's deactivate()" in lines[0]  # a pack's copy names the pack: <pack>.deactivate()
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
    seen = spy_compile(model)
    runtime._enable_graphs(model, {"backend": "emulate", "cache_lengths": (64,)})
    assert serving.server(model) is not None and "generate" in vars(model)
    assert serving.server(model).options.cache_lengths == (64,)
    runtime.deactivate()  # what the log line says gives transformers' compile back
    assert serving.server(model) is None and "generate" not in vars(model) and "forward" not in vars(model)
    with torch.no_grad():
        model.generate(torch.randint(1, 256, (1, 5)), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert seen and not any(seen)
    seen.clear()
    before = model.generation_config.disable_compile
    runtime._enable_graphs(model, {"backend": "emulate", "serve": False})
    assert serving.server(model) is None and isinstance(model.forward, graphs.GraphedForward)
    with torch.no_grad():  # graph mode on the forward only: generate() must not compile it either
        model.generate(torch.randint(1, 256, (1, 5)), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert seen and all(seen) and model.generation_config.disable_compile is True
    runtime.deactivate()
    assert "forward" not in vars(model) and model.generation_config.disable_compile is before


def test_class_level_activate_serves_any_model_s_generate_and_deactivate_restores_stock(tiny_llama_dir,
                                                                                        monkeypatch):
    """activate(graphs=True) without model=: every instance of the pack's model class has its generate()
    served from its first call (a server of its own, with activate's options, counted in its stats;
    tokens and logits eager's); serving.stop(model) takes one model off; deactivate() puts the class's own
    generate back (the same function object) and no server is made again."""
    from transformers import LlamaForCausalLM

    from forgepack import runtime
    from forgepack.runtime.packinfo import GraphVerdict

    stock = LlamaForCausalLM.__dict__.get("generate")
    inherited = LlamaForCausalLM.generate
    manifest = types.SimpleNamespace(graphs=GraphVerdict(), model_arch="LlamaForCausalLM")
    monkeypatch.setattr(runtime, "manifest", lambda: manifest)
    monkeypatch.setattr(runtime, "_fused", lambda: None)
    monkeypatch.setitem(runtime._STATE, "loaded", False)
    model, other, twin = load(tiny_llama_dir), load(tiny_llama_dir), load(tiny_llama_dir)
    ids = torch.randint(1, 256, (2, 9))
    with torch.no_grad():
        ref = generate(twin, ids)  # stock, before activation
    try:
        runtime._enable_graphs(None, {"backend": "emulate", "cache_lengths": (64,), "prompt_buckets": (16,),
                                      "max_bytes": 10**7})
        assert serving.server(model) is None  # nothing is made before the first call
        with torch.no_grad():
            for _ in range(4):
                out = generate(model, ids)
                assert torch.equal(out.sequences, ref.sequences)
                assert scale_error(torch.stack(ref.logits), torch.stack(out.logits)) < 1e-5
            generate(other, ids)
        server = serving.server(model)
        assert server is not None and serving.server(other) is not None and serving.server(twin) is None
        assert server.options.cache_lengths == (64,) and server.pool.max_bytes == 10**7
        stats = server.stats()
        assert stats["served_requests"] == 4 and stats["decode_loop"]["requests"] == 4
        assert stats["decode_loop"]["buckets"]["decode b2 c64"]["replays"] > 0
        copied = copy.deepcopy(model)  # its copy: served through the class (a server of its own), not the original's
        with torch.no_grad():
            assert torch.equal(generate(copied, ids).sequences, ref.sequences)
        assert serving.server(copied) not in (None, server)
        assert serving.stop(other) and "generate" not in vars(other)
        with torch.no_grad():
            generate(other, ids)
        assert serving.server(other) is None  # stopped: the class does not serve it again
    finally:
        runtime.deactivate()
    assert LlamaForCausalLM.__dict__.get("generate") is stock and LlamaForCausalLM.generate is inherited
    assert serving.server(model) is None and "generate" not in vars(model) and "forward" not in vars(model)
    with torch.no_grad():
        assert torch.equal(generate(model, ids).sequences, ref.sequences)
        assert torch.equal(generate(copied, ids).sequences, ref.sequences)
    assert serving.server(model) is None and serving.server(copied) is None


def test_serving_imports_only_torch_the_standard_library_graphs_and_the_decode_loop():
    import ast
    import sys
    from pathlib import Path

    roots = set()
    source = Path(serving.__file__).read_text() + Path(serving.__file__).with_name("servereq.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            names = [a.name for a in node.names]
            assert ((node.module is None and set(names) <= {"decodeloop", "graphs"})
                    or node.module == "servereq"), ast.dump(node)
        elif isinstance(node, ast.ImportFrom):
            roots.add(node.module.split(".")[0])
    assert roots - {"torch", "__future__", "transformers"} <= set(sys.stdlib_module_names), roots


# --- the trained model: greedy tokens are decisive ----------------------------------------------------

TRAINED_LENGTHS = (9, 10, 12, 13, 17)  # four prompts pad to the 16-token rung (the 4th replays it), one to 32
TRAINED_NEW = 10


def trained_prompts(index: int, length: int, device: str, left_pad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Three grammar prompts of `length` (a different three per index); row 0 left-padded by 3 tokens."""
    rows = grammar_prompts(3 * len(TRAINED_LENGTHS), length=length)[3 * index:3 * index + 3]
    ids = torch.tensor(rows, device=device)
    mask = torch.ones_like(ids)
    if left_pad:
        ids[0, :3], mask[0, :3] = 0, 0
    return ids, mask


def served_matches_eager_token_for_token(model, twin, device: str, tolerance: float, left_pad: bool = True) -> None:
    """Greedy tokens of the served model are eager's exactly, every request, no escape: the trained model's
    top-1 logit leads by a wide margin (tests/test_trainedlm.py), so rounding cannot flip one, and a serving
    bug (a wrong mask, a stale cache row, a replay on old inputs) shows as a different token. The tokens
    also walk the grammar, so eager itself is checked, and the per-step logits agree within `tolerance`."""
    with torch.no_grad():
        for index, length in enumerate(TRAINED_LENGTHS):
            ids, mask = trained_prompts(index, length, device, left_pad)
            out = generate(model, ids, new=TRAINED_NEW, attention_mask=mask)
            ref = generate(twin, ids, new=TRAINED_NEW, attention_mask=mask)
            assert torch.equal(out.sequences, ref.sequences), (length, out.sequences, ref.sequences)
            for row in out.sequences[:, length - 1:].tolist():
                assert follows_grammar(row), (length, row)
            assert scale_error(torch.stack(ref.logits), torch.stack(out.logits)) < tolerance


def trained_decode_replays(server, decode_loop: bool) -> int:
    stats = server.stats()
    assert stats["served_requests"] == len(TRAINED_LENGTHS) and not stats["eager_requests"], stats
    assert stats["graphs"]["fallbacks"] == 0, stats
    assert stats["buckets"]["prefill b4 s16 c64"]["replays"] >= 1, stats
    buckets = stats["decode_loop"]["buckets"] if decode_loop else stats["buckets"]
    return buckets["decode b4 c64"]["replays"]


@pytest.mark.parametrize("decode_loop", [False, True], ids=["generate-loop", "decode-loop"])
def test_a_trained_model_s_served_tokens_are_eager_s_over_buckets_and_padding(trained_lm_dir, decode_loop):
    """Emulated graphs: prompt lengths over two rungs, a batch of 3 padded to its bucket of 4, through
    generate()'s own loop (with a left-padded row) and forgepack's decode loop (which leaves a padding mask
    to generate()'s loop, so its prompts are unpadded); the decode steps replayed."""
    model, twin = load(trained_lm_dir), load(trained_lm_dir)
    server = serving.serve(model, **EMU, **{**SMALL, "decode_loop": decode_loop})
    try:
        served_matches_eager_token_for_token(model, twin, "cpu", 1e-5, left_pad=not decode_loop)
        steps = len(TRAINED_LENGTHS) * (TRAINED_NEW - 1)
        assert trained_decode_replays(server, decode_loop) == steps - 2  # two warm-ups, then captured once
    finally:
        serving.stop(model)


# --- real CUDA graphs ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("decode_loop", [False, True], ids=["generate-loop", "decode-loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_generate_replays_and_matches_eager(trained_lm_dir, dtype, decode_loop):
    """Real CUDA graphs, the trained model: served tokens are eager's exactly in float32 and bfloat16 (its
    logit margins dwarf bf16 rounding), logits within the pack's model tolerance, the decode steps replayed."""
    model, twin = load(trained_lm_dir, "cuda", dtype), load(trained_lm_dir, "cuda", dtype)
    server = serving.serve(model, cache_lengths=(64, 128), prompt_buckets=(8, 16, 32), decode_loop=decode_loop)
    try:
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2  # the pack's model tolerance in bf16
        served_matches_eager_token_for_token(model, twin, "cuda", tolerance, left_pad=not decode_loop)
        steps = len(TRAINED_LENGTHS) * (TRAINED_NEW - 1)
        assert trained_decode_replays(server, decode_loop) == steps - 2
    finally:
        serving.stop(model)


@pytest.mark.gpu
def test_gpu_inference_mode_capture(trained_lm_dir):
    model, twin = load(trained_lm_dir, "cuda"), load(trained_lm_dir, "cuda")
    server = serving.serve(model, cache_lengths=(64,), prompt_buckets=(16,), decode_loop=False)
    try:
        ids = torch.tensor(grammar_prompts(2, length=9), device="cuda")
        with torch.inference_mode():
            ref = generate(twin, ids, new=8)
            for _ in range(4):  # prefill: a fresh cache's call, two warm-ups, the capture
                out = generate(model, ids, new=8)
                assert torch.equal(out.sequences, ref.sequences), (out.sequences, ref.sequences)
            steps = torch.stack(out.logits)
            assert scale_error(teacher_forced(twin, out.sequences, 9), steps) < 1e-4
        stats = server.stats()
        assert stats["graphs"]["fallbacks"] == 0 and not stats["graphs"]["failures"], stats
        assert stats["buckets"]["decode b2 c64"]["replays"] == 4 * 7 - 2, stats
        assert stats["buckets"]["prefill b2 s16 c64"]["replays"] == 1, stats
    finally:
        serving.stop(model)


@pytest.mark.gpu
def test_gpu_served_graphs_share_one_pool_bounded_by_max_bytes(tiny_llama_dir):
    """Real graphs: the server's graphs go to the device's one shared pool, and a bound they do not fit
    under beside the KV cache (a graph's bytes are its static inputs and the pool's growth) leaves them
    eager, named; the cache is counted, the decode loop's buffers do not fit either."""
    from forgepack.runtime import graphbackends

    model, twin = load(tiny_llama_dir, "cuda"), load(tiny_llama_dir, "cuda")
    # room for the KV cache (64 bytes of slack: a transformers version's bookkeeping tensors), not a graph
    server = serving.serve(model, max_bytes=cache_size(model, 2, 64) + 64, cache_lengths=(64,), prompt_buckets=(16,))
    try:
        ids = torch.randint(1, 256, (2, 9), device="cuda")
        with torch.no_grad():
            for _ in range(2):
                out = generate(model, ids)
                assert scale_error(teacher_forced(twin, out.sequences, 9), torch.stack(out.logits)) < 1e-4
        device = torch.device("cuda", torch.cuda.current_device())
        assert server.graphed._backend.pool_for(device) is graphbackends.shared_pool(device)
        stats = server.stats()
        assert stats["graphs"]["graphs"] == 0, stats
        assert stats["buckets"]["decode b2 c64"]["eager: over max_bytes"] == 7, stats
        held = serving.cache_bytes(server.pool.entries("cache")[0])  # as allocated, counted
        assert stats["cache_bytes"] == held == stats["budget"]["bytes"] > 0, stats
        assert any("decode buffers" in why for why in stats["decode_loop"]["fallbacks"]), stats
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
    assert cols["graphs"]["top1_clear"] in (1.0, None) and 0 <= cols["graphs"]["clear_share"] <= 1
    assert cols["graphs"]["serving"]["graphs"]["replays"] > 0
    loop = cols["graphs"]["serving"]["decode_loop"]  # every request of the column: the graph-captured decode loop
    assert loop["requests"] > 0 and not loop["fallbacks"] and not loop["failures"], loop
    assert "| graphs" in (tmp_path / "results" / "bench_serve-tiny-llama.md").read_text()


TINY_TRACE = ["--requests", "2", "--batches", "1,2", "--prompt", "16,24", "--new", "3,4", "--rounds", "1",
              "--agree", "1"]


def test_forgepack_bench_serve_runs_the_serving_benchmark_through_the_cli(isolated_dirs):
    """`forgepack bench --serve` on CPU: the eager and graphs (emulated) columns of servebench over a tiny
    trace, through the real command: JSON on stdout, serve_bench.json in the workspace, the served
    path's replays, agreement with eager, and the first request from a cold process; then the table."""
    import json

    from typer.testing import CliRunner

    from forgepack.cli import app

    runner = CliRunner()
    args = ["bench", "tiny-llama", "--target", "cpu", "--serve", *TINY_TRACE]
    done = runner.invoke(app, [*args, "--json"])
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    assert doc["recipe"] == "tiny-llama" and doc["device"] == "cpu" and doc["settings"]["batches"] == [1, 2]
    assert len(doc["trace"]) == 2 and list(doc["columns"]) == ["eager", "graphs", "graphs (generate loop)"]
    assert len(doc["columns"]["graphs"]["request_s"]) == 2
    for name, col in doc["columns"].items():
        assert col["tokens_per_s"] > 0 and col["first_request_s"] > 0 and col["top1"] == 1.0, name
    graphs_col = doc["columns"]["graphs"]
    assert graphs_col["max_err_over_scale"] < 1e-4 and graphs_col["serving"]["graphs"]["replays"] > 0
    assert graphs_col["serving"]["served_requests"] > 0 and not graphs_col["serving"]["eager_requests"]
    assert graphs_col["serving"]["decode_loop"]["requests"] > 0  # the plain greedy trace took the decode loop
    cold = graphs_col["cold_process"]
    assert cold["served"] and cold["since_activate_s"] >= cold["first_request_s"] > 0, cold
    saved = json.loads((isolated_dirs / ".forgepack" / "tiny_llama" / "serve_bench.json").read_text())
    assert saved["columns"].keys() == doc["columns"].keys()

    table = runner.invoke(app, [*args, "--no-cold"], env={"COLUMNS": "250"})
    assert table.exit_code == 0, table.output
    rows = [line for line in table.stdout.splitlines() if line.startswith(("│ eager", "│ graphs"))]
    assert len(rows) == 3 and "emulated backend" in table.output, table.output


@pytest.mark.parametrize(("argv", "words"), [
    (["--serve", "--batches", "1,x"], "--batches is a comma-separated list"),
    (["--serve", "--prompt", "64,16"], "--prompt must be low,high"),
    (["--serve", "--reps", "3"], "--reps is not for the serving benchmark"),
    (["--requests", "3"], "--requests is for the serving benchmark (add --serve)"),
])
def test_bench_serve_bad_flags_say_why_in_one_line(argv, words, monkeypatch, capsys):
    import sys

    from forgepack.cli import main

    monkeypatch.setattr(sys, "argv", ["forgepack", "bench", "tiny-llama", "--target", "cpu", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_a_failed_cold_process_is_reported_not_raised():
    """The cold-process measurement must not cost the rest of the benchmark: its failure is a value."""
    from forgepack import recipe, servebench

    tiny = recipe.resolve("tiny-llama").replace(target={"device": "cpu"})
    got = servebench.cold_process(tiny, servebench.ServeSettings(requests=1), "no_such_pack_module")
    assert "the cold process failed (exit 1)" in got["error"] and "no_such_pack_module" in got["error"], got


def test_a_near_tie_is_not_a_clear_decode_step():
    """The serving benchmark's `top-1 (clear)` leaves out steps whose eager top two logits lie within
    CLEAR_GAP of the step's scale (random weights make many; any reordering flips some)."""
    import torch

    from forgepack.servebench import CLEAR_GAP, clear_positions

    scale = 10.0
    ref = torch.tensor([[scale, scale * (1 - CLEAR_GAP / 2), 0.0],   # a near-tie
                        [scale, scale * (1 - 2 * CLEAR_GAP), 0.0],   # clear
                        [-scale, 0.0, 1.0]])                         # clear: the scale is |logit|
    assert clear_positions(ref).tolist() == [False, True, True]
