"""The graph-captured decode loop of served `generate()` (forgepack/runtime/decodeloop.py).

CPU: the emulated backend (the recorded aten trace of a whole decode step, replayed on the same tensors)
on the tiny random-weight Llama of tests/conftest.py, loaded twice: the served model against the same
weights' stock `generate()`. Token-identical sequences (shape and values) and equal per-step logits for
batches 1-3 (padded to buckets), several prompt lengths, min_new_tokens, eos firing in some rows only,
early stops, pad defaults, return_dict_in_generate; requests it must refuse fall back with the reason
counted; no_grad and inference_mode; the benchmark's exact call takes the fast path.
GPU (`gpu` marker): the same loop with real CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from forgepack.runtime import decodeloop, serving

EMU = {"backend": "emulate"}
SMALL = {"cache_lengths": (64, 128), "prompt_buckets": (8, 16, 32)}


def load(path, device="cpu", dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


@pytest.fixture
def pair(tiny_llama_dir):
    """(served model, its server, stock twin): the same weights, loaded twice."""
    model, twin = load(tiny_llama_dir), load(tiny_llama_dir)
    server = serving.serve(model, **EMU, **SMALL)
    yield model, server, twin
    serving.stop(model)


def both(model, twin, ids, **kwargs):
    with torch.no_grad():
        return model.generate(ids, **kwargs), twin.generate(ids, **kwargs)


def same(out, ref) -> None:
    """Token-identical, the same output fields, each step's logits and scores equal within fp32 noise."""
    if isinstance(ref, torch.Tensor):
        assert isinstance(out, torch.Tensor) and out.shape == ref.shape and torch.equal(out, ref)
        return
    assert out.sequences.shape == ref.sequences.shape and torch.equal(out.sequences, ref.sequences)
    assert set(out.keys()) == set(ref.keys())
    for name in ("logits", "scores"):
        mine, theirs = out.get(name), ref.get(name)
        assert (mine is None) == (theirs is None), name
        if theirs is not None:
            assert len(mine) == len(theirs)
            torch.testing.assert_close(torch.stack(mine), torch.stack(theirs), atol=1e-5, rtol=1e-5)


GREEDY = {"do_sample": False, "pad_token_id": 0}


def emitted(twin, ids, new=12) -> torch.Tensor:
    """The tokens stock greedy generate emits with no eos: [batch, new]."""
    with torch.no_grad():
        out = twin.generate(ids, max_new_tokens=new, min_new_tokens=new, eos_token_id=None, **GREEDY)
    return out[:, ids.shape[1]:]


def loop_stats(server) -> dict:
    return server.stats()["decode_loop"]


# --- token-identical to stock generate() -------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_token_identical_with_logits_and_scores_per_step(pair, batch):
    """Batch 3 runs in bucket 4 (a padding row that never reaches the output); prompts under a rung, on
    one and past it; every step's fp32 logits and scores equal stock's, the same dict fields."""
    model, server, twin = pair
    torch.manual_seed(batch)
    for length in (5, 9, 16, 20):
        ids = torch.randint(3, 256, (batch, length))
        out, ref = both(model, twin, ids, max_new_tokens=8, min_new_tokens=8, output_logits=True,
                        output_scores=True, return_dict_in_generate=True, **GREEDY)
        same(out, ref)
        assert out.logits[0].shape == (batch, 256) and out.get("cache") is None
    stats = loop_stats(server)
    bucket = {1: 1, 2: 2, 3: 4}[batch]
    decode = stats["buckets"][f"decode b{bucket} c64"]
    assert stats["requests"] == 4 and not stats["fallbacks"]
    assert decode["steps"] == 4 * 7 and decode["captures"] == 1 and decode["replays"] == 4 * 7 - 2
    assert decode["eager: warm-up"] == 2 and stats["graphs"] == 1


def test_the_benchmark_call_takes_the_fast_path(pair):
    """tools/bench_serve.py's Column.generate, timed and agreement-checked: both decoded by the loop.
    Fails if the fast path silently stops being taken."""
    model, server, twin = pair
    ids = torch.randint(3, 256, (3, 12))
    call = {"max_new_tokens": 10, "min_new_tokens": 10, "do_sample": False, "pad_token_id": 0,
            "attention_mask": torch.ones_like(ids)}
    same(*both(model, twin, ids, **call))
    same(*both(model, twin, ids, **call, output_logits=True, return_dict_in_generate=True))
    stats = loop_stats(server)
    assert stats["requests"] == 2 and not stats["fallbacks"], stats
    assert stats["buckets"]["decode b4 c64"]["replays"] == 2 * 9 - 2
    assert not any(k.startswith("decode") for k in server.stats()["buckets"])  # generate's loop never ran


def test_eos_fires_in_some_rows_and_not_others(pair):
    """An eos the model really emits in row 0 and never in row 2: row 0 finishes and emits the pad
    token from then on, row 2 runs to max_new_tokens; a list of eos ids too."""
    model, server, twin = pair
    torch.manual_seed(5)
    ids = torch.randint(3, 256, (3, 9))
    tokens = emitted(twin, ids)
    eos = next(int(t) for t in tokens[0, 1:] if t not in tokens[2] and t != tokens[0, 0])
    out, ref = both(model, twin, ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=7, output_logits=True,
                    return_dict_in_generate=True, do_sample=False)
    same(out, ref)
    row = out.sequences[0, 9:].tolist()
    assert eos in row and row[row.index(eos) + 1:] == [7] * (11 - row.index(eos))  # the eos really fired
    assert out.sequences.shape[1] == 9 + 12 and eos not in out.sequences[2, 9:].tolist()
    other = next(int(t) for t in tokens[1] if t not in tokens[2])
    same(*both(model, twin, ids, max_new_tokens=12, eos_token_id=[other, eos], pad_token_id=7, do_sample=False))
    assert loop_stats(server)["requests"] == 2


@pytest.mark.parametrize("check_every", [4, 16])
def test_an_early_stop_cuts_where_generate_stops(pair, check_every):
    """Every row finishes early: the output ends after the step where the last one finished, whether that
    is seen at the next host check or not (steps run past it are dropped, logits included)."""
    model, server, twin = pair
    server.loop.check_every = check_every
    torch.manual_seed(6)
    ids = torch.randint(3, 256, (1, 9))
    tokens = emitted(twin, ids, new=20)[0].tolist()
    index = next(i for i in range(2, 20) if tokens[i] not in tokens[:i])  # its first appearance
    out, ref = both(model, twin, ids, max_new_tokens=40, eos_token_id=tokens[index], output_logits=True,
                    return_dict_in_generate=True, **GREEDY)
    same(out, ref)
    assert out.sequences.shape == (1, 9 + index + 1) and len(out.logits) == index + 1
    assert loop_stats(server)["buckets"]["decode b1 c64"]["steps"] >= index


def test_min_new_tokens_blocks_an_eos_the_model_emits(pair):
    model, server, twin = pair
    torch.manual_seed(7)
    ids = torch.randint(3, 256, (2, 10))
    eos = int(emitted(twin, ids)[0, 1])  # row 0 would stop after two tokens
    for blocked in (0, 5):
        out, ref = both(model, twin, ids, max_new_tokens=9, min_new_tokens=blocked, eos_token_id=eos,
                        output_scores=True, return_dict_in_generate=True, **GREEDY)
        same(out, ref)
        assert bool(torch.isinf(out.scores[0][:, eos]).all()) == (blocked > 0)
    assert loop_stats(server)["requests"] == 2


def test_max_length_min_length_and_the_pad_default(pair):
    """max_length/min_length in place of the new-token counts, and no pad token: transformers pads
    finished rows with the first eos (the model's config has eos 2; here one it emits)."""
    model, server, twin = pair
    torch.manual_seed(8)
    ids = torch.randint(3, 256, (3, 11))
    eos = int(emitted(twin, ids)[1, 2])
    same(*both(model, twin, ids, max_length=11 + 7, min_length=11 + 2, eos_token_id=eos, do_sample=False))
    same(*both(model, twin, ids, max_new_tokens=7, eos_token_id=eos, do_sample=False))
    same(*both(model, twin, ids, max_new_tokens=1, **GREEDY))  # the prefill's token only
    assert loop_stats(server)["requests"] == 3


def test_a_sampling_generation_config_called_greedy_takes_the_fast_path(pair):
    """Llama 3's generation config samples (temperature, top_p); called with do_sample=False, its warpers
    add nothing and the loop serves it."""
    model, server, twin = pair
    for m in (model, twin):
        m.generation_config.do_sample, m.generation_config.temperature, m.generation_config.top_p = True, 0.6, 0.9
    ids = torch.randint(3, 256, (2, 9))
    same(*both(model, twin, ids, max_new_tokens=6, **GREEDY))
    assert loop_stats(server)["requests"] == 1 and not loop_stats(server)["fallbacks"]


def test_requests_it_must_refuse_fall_back_and_say_why(pair):
    from transformers import LogitsProcessor, LogitsProcessorList

    class Ban(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores.index_fill(1, torch.tensor([int(scores.argmax(-1)[0])]), float("-inf"))

    model, server, twin = pair
    ids = torch.randint(3, 256, (2, 9))
    same(*both(model, twin, ids, max_new_tokens=5, num_beams=2, **GREEDY))
    same(*both(model, twin, ids, max_new_tokens=5, repetition_penalty=1.3, **GREEDY))
    same(*both(model, twin, ids, max_new_tokens=5, logits_processor=LogitsProcessorList([Ban()]), **GREEDY))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    same(*both(model, twin, ids, max_new_tokens=5, attention_mask=mask, **GREEDY))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=5, do_sample=True, pad_token_id=0)
    model.generation_config.repetition_penalty = twin.generation_config.repetition_penalty = 1.2
    same(*both(model, twin, ids, max_new_tokens=5, **GREEDY))
    why = loop_stats(server)["fallbacks"]
    assert why == {"generation config sets repetition_penalty": 2, "a logits_processor argument": 1,
                   "a padding attention_mask": 1, "sampling": 1}, why
    assert server.stats()["eager_requests"] == {"beam search": 1}  # refused before the loop is asked
    assert loop_stats(server)["requests"] == 0 and server.stats()["served_requests"] == 5


def test_the_loop_s_buffers_count_in_max_bytes(tiny_llama_dir):
    """max_bytes holds the loop's buffers beside its cache: counted in the server's budget (stats()), and
    with room for the cache alone a plain request leaves the loop, says why, and is served through generate
    (its graphs over the bound too: eager), token-identical to stock."""
    from transformers import StaticCache

    model, twin = load(tiny_llama_dir), load(tiny_llama_dir)
    cache = serving.expected_cache_bytes(model, StaticCache(config=model.config, max_cache_len=64), 1)
    buffers = decodeloop.state_bytes(1, 256, 64)
    ids = torch.randint(1, 256, (1, 9))
    try:
        server = serving.serve(model, max_bytes=cache + buffers, **EMU, **SMALL)
        same(*both(model, twin, ids, max_new_tokens=6, **GREEDY))
        stats = server.stats()
        assert loop_stats(server)["requests"] == 1 and loop_stats(server)["bytes"] == buffers
        assert stats["budget"]["by_kind"]["loop"] == buffers and stats["budget"]["bytes"] <= cache + buffers
        serving.stop(model)
        server = serving.serve(model, max_bytes=cache + buffers - 1, **EMU, **SMALL)
        same(*both(model, twin, ids, max_new_tokens=6, **GREEDY))
        why = f"its decode buffers need {buffers} bytes, over max_bytes={cache + buffers - 1}"
        assert loop_stats(server)["requests"] == 0 and loop_stats(server)["fallbacks"] == {why: 1}
        assert server.stats()["served_requests"] == 1 and server.stats()["budget"]["bytes"] == cache
    finally:
        serving.stop(model)


def test_the_pick_and_the_advance_of_the_positions_take_11_launches():
    """Each op of the greedy pick is a node of every decode graph (and a launch when it replays): the pick
    takes 11 (20 before the positions, slot and counter shared one buffer and the masks became wheres; 13
    before eos's block became one compare and the token was written in place); the tokens-equal tests
    above check what they compute."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                ops.append(str(func))
            return func(*args, **(kwargs or {}))

    state = decodeloop.State(2, 256, 32, torch.device("cpu"))
    state.start(2, 8, decodeloop.Greedy(10, 2, (5,), 0, False, False, False))
    logits = torch.randn(2, 256)
    with Count():
        state.pick(logits)
    assert len(ops) == 11, ops
    assert state.position.flatten().tolist() == [8, 8] and state.where.tolist() == [8] and int(state.count) == 0


def test_plain_decides_from_the_arguments_alone(tiny_llama_dir):
    model = load(tiny_llama_dir)
    ids = torch.randint(3, 256, (2, 9))
    greedy, why = decodeloop.plain(model, ids, {"max_new_tokens": 4, "min_new_tokens": 2, **GREEDY})
    assert why == "" and greedy == decodeloop.Greedy(4, 2, (2,), 0, False, False, False)
    assert decodeloop.plain(model, ids, {"max_new_tokens": 4, "pad_token_id": 5})[0].pad == 5
    assert decodeloop.plain(model, ids, {"max_new_tokens": 4})[0].pad == 2  # the first eos
    assert decodeloop.plain(model, ids, {})[0].new == 20 - 9  # transformers' max_length of 20
    refused = {"no_repeat_ngram_size": 2, "bad_words_ids": [[5]], "forced_eos_token_id": 3, "max_time": 1.0,
               "stop_strings": ["x"], "renormalize_logits": True, "suppress_tokens": [4], "guidance_scale": 2.0,
               "num_return_sequences": 2, "use_cache": False, "streamer": object(), "position_ids": ids}
    for name, value in refused.items():
        greedy, why = decodeloop.plain(model, ids, {"max_new_tokens": 4, **GREEDY, name: value})
        assert greedy is None and why, name
    with_pad = ids.clone()
    with_pad[0, 0] = 0  # transformers would infer a padding mask from the pad token
    assert decodeloop.plain(model, with_pad, {"max_new_tokens": 4, **GREEDY})[0] is None
    assert decodeloop.plain(model, with_pad, {"max_new_tokens": 4, "attention_mask": torch.ones_like(ids),
                                              **GREEDY})[0] is not None


def test_inference_mode_and_no_grad_each_replay_their_own_graph(pair):
    model, server, twin = pair
    ids = torch.randint(3, 256, (2, 9))
    with torch.no_grad():
        ref = twin.generate(ids, max_new_tokens=7, **GREEDY)
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode):
        with mode():
            out = model.generate(ids, max_new_tokens=7, **GREEDY)
        assert torch.equal(out, ref)
    out = model.generate(ids, max_new_tokens=7, **GREEDY)  # generate's own no_grad, as stock's
    assert torch.equal(out, ref) and not out.requires_grad
    stats = loop_stats(server)
    assert stats["graphs"] == 2 and stats["requests"] == 4 and not stats["failures"], stats
    assert stats["buckets"]["decode b2 c64"]["replays"] == 4 * 6 - 2 * 2


def test_inference_mode_replays_give_stock_logits(pair):
    """Every step's logits under inference_mode, after the capture too: the emulated trace once dropped
    `aten.to` (an op that only may alias, seen undecomposed in inference mode), so RoPE's positions
    froze at the capture and the replayed logits drifted (3e-3 over scale) while tokens still agreed."""
    model, server, twin = pair
    ids = torch.randint(3, 256, (3, 9))
    kwargs = {"max_new_tokens": 8, "min_new_tokens": 8, "output_logits": True, "return_dict_in_generate": True}
    for _ in range(2):
        with torch.inference_mode():
            out, ref = model.generate(ids, **kwargs, **GREEDY), twin.generate(ids, **kwargs, **GREEDY)
        same(out, ref)
    assert loop_stats(server)["buckets"]["decode b4 c64"]["replays"] == 2 * 7 - 2


def test_the_emulated_backend_replays_a_conversion_under_inference_mode():
    """`x.float()` of a long tensor is `aten.to.dtype` (returns alias-annotated) under inference_mode:
    a new tensor, which the replay must compute again from the updated input."""
    from forgepack.runtime.graphbackends import EmulatedBackend

    with torch.inference_mode():
        x, out = torch.tensor([1, 2]), torch.zeros(2)
        captured = EmulatedBackend().capture(lambda: out.copy_(x.float() * 2), (), {}, torch.device("cpu"))
        x.add_(10)
        captured.replay()
        assert out.tolist() == [22.0, 24.0]


def test_a_failed_capture_runs_the_same_step_eagerly(pair):
    model, server, twin = pair

    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    server.loop.backend.capture = refuse
    ids = torch.randint(3, 256, (3, 9))
    with pytest.warns(RuntimeWarning, match="decode loop: running eagerly"):
        same(*both(model, twin, ids, max_new_tokens=8, output_logits=True, return_dict_in_generate=True, **GREEDY))
    same(*both(model, twin, ids, max_new_tokens=8, **GREEDY))
    stats = loop_stats(server)
    why = "capture failed: RuntimeError: operation not permitted when stream is capturing"
    assert stats["failures"] == {"decode b4 c64": why}
    assert stats["buckets"]["decode b4 c64"]["eager: capture failed"] == 2 * 7 - 2 and stats["graphs"] == 0


def test_warmup_captures_the_loop_before_the_first_request(tiny_llama_dir):
    model, twin = load(tiny_llama_dir), load(tiny_llama_dir)
    try:
        serving.warmup(model, batch_sizes=(3,), prompt_lengths=(10,), max_new_tokens=(6,), **EMU, **SMALL)
        server = serving.server(model)
        before = loop_stats(server)["buckets"]["decode b4 c64"]
        assert before["captures"] == 1
        ids = torch.randint(3, 256, (3, 12))
        same(*both(model, twin, ids, max_new_tokens=6, **GREEDY))
        after = loop_stats(server)["buckets"]["decode b4 c64"]
        assert after["captures"] == 1 and after["replays"] - before["replays"] == 5
    finally:
        serving.stop(model)


def test_decode_loop_off_serves_through_generate(tiny_llama_dir):
    model, twin = load(tiny_llama_dir), load(tiny_llama_dir)
    server = serving.serve(model, **EMU, **SMALL, decode_loop=False)
    try:
        ids = torch.randint(3, 256, (2, 9))
        same(*both(model, twin, ids, max_new_tokens=6, **GREEDY))
        assert loop_stats(server)["requests"] == 0
        # the forward's counts per bucket, eager calls by reason (read from the graphed forward's counters)
        assert server.stats()["buckets"]["decode b2 c64"] == {"calls": 5, "eager: warm-up": 2, "captures": 1,
                                                              "replays": 3}
    finally:
        serving.stop(model)


# --- real CUDA graphs ----------------------------------------------------------------------------------
#
# On the GPU the reference for tokens is the same weights served with decode_loop=False: the same prompt
# and batch buckets, the same static cache and forward kernels, generate's own loop around them. Stock
# generate (a dynamic cache, the unpadded batch) differs by a few ulps, which flip random weights'
# near-ties: against it the logits are compared teacher-forced.


def teacher_forced_error(twin, out, prompt: int) -> float:
    from forgepack.runtime import compare

    with torch.no_grad():
        ref = twin(input_ids=out.sequences, use_cache=False).logits[:, prompt - 1:-1].transpose(0, 1)
    return compare.scale_error(ref.float(), torch.stack(out.logits).float())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_decode_loop_replays_and_matches_generate(tiny_llama_dir, dtype):
    """Real CUDA graphs of a whole decode step, under no_grad and inference_mode: the tokens and the
    dict fields of generate's own loop on the same served forward, each step's logits equal to its
    and within the pack's tolerance of eager teacher-forced logits."""
    model, other, twin = (load(tiny_llama_dir, "cuda", dtype) for _ in range(3))
    server = serving.serve(model, **SMALL)
    serving.serve(other, **SMALL, decode_loop=False)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2  # the pack's model tolerance in bf16
    try:
        for mode in (torch.no_grad, torch.inference_mode):
            for length in (9, 12, 14, 10):
                ids = torch.randint(3, 256, (3, length), device="cuda")
                kwargs = {"max_new_tokens": 8, "min_new_tokens": 8, "output_logits": True,
                          "return_dict_in_generate": True, **GREEDY}
                with mode():
                    out, ref = model.generate(ids, **kwargs), other.generate(ids, **kwargs)
                same(out, ref)
                assert teacher_forced_error(twin, out, length) < tolerance
        stats = loop_stats(server)
        assert stats["requests"] == 8 and stats["graphs"] == 2 and not stats["failures"], stats
        assert stats["buckets"]["decode b4 c64"]["replays"] == 8 * 7 - 2 * 2, stats
    finally:
        serving.stop(model)
        serving.stop(other)


@pytest.mark.gpu
def test_gpu_eos_and_early_stop(tiny_llama_dir):
    """An eos firing in one row of two (finished rows pad), then one that stops every row early: cut
    where generate's own loop cuts, on replayed graphs."""
    model, other = load(tiny_llama_dir, "cuda"), load(tiny_llama_dir, "cuda")
    server = serving.serve(model, **SMALL)
    serving.serve(other, **SMALL, decode_loop=False)
    try:
        torch.manual_seed(6)
        ids = torch.randint(3, 256, (2, 9), device="cuda")
        tokens = emitted(other, ids, new=20)
        eos = next(int(t) for t in tokens[0, 2:] if t not in tokens[1])
        for _ in range(3):  # warm-ups, the capture, replays
            same(*both(model, other, ids, max_new_tokens=30, eos_token_id=eos, pad_token_id=7, do_sample=False))
        alone = emitted(other, ids[:1], new=20)[0].tolist()
        first = next(i for i in range(2, 20) if alone[i] not in alone[:i])
        out, ref = both(model, other, ids[:1], max_new_tokens=40, eos_token_id=alone[first],
                        do_sample=False)
        same(out, ref)
        assert out.shape[1] < 9 + 40
        stats = loop_stats(server)
        assert stats["requests"] == 4 and stats["graphs"] == 2 and not stats["failures"], stats
    finally:
        serving.stop(model)
        serving.stop(other)


@pytest.mark.parametrize("window,served", [(4096, True), (24, False)])
def test_sliding_window_layers_whose_window_covers_the_cache_are_served_by_the_loop(tmp_path, window, served):
    """Gemma-2 alternates sliding-window layers: a window covering the whole cache (the released 4096)
    never rolls, so the loop serves the model, with stock's tokens and logits; a shorter window is left to
    transformers' own loop, also with stock's tokens."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import heldout_models

    path = heldout_models.save(tmp_path, "tiny-gemma2", sliding_window=window)
    model, twin = load(path), load(path)
    server = serving.serve(model, **EMU, **SMALL)
    try:
        ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
        kw = dict(max_new_tokens=20, min_new_tokens=20, output_logits=True, return_dict_in_generate=True, **GREEDY)
        out, ref = both(model, twin, ids, attention_mask=torch.ones_like(ids), **kw)
        same(out, ref)
        stats = server.stats()["decode_loop"]
        assert (stats["requests"] == 1) == served, stats
        assert ("cache layers other than full-attention static ones" in stats["fallbacks"]) != served, stats
    finally:
        serving.stop(model)


def test_an_eager_attention_model_gets_an_additive_mask_in_the_prefill_and_every_step(tiny_llama_dir):
    """Eager attention adds its 4-D mask to the scores: a boolean mask there adds 1 to the attended slots
    and masks nothing (the loop's prefill gave such a model wrong logits from its first token)."""
    from transformers import AutoModelForCausalLM

    def eager():
        return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32,
                                                    attn_implementation="eager").eval()

    model, twin = eager(), eager()
    server = serving.serve(model, **EMU, **SMALL)
    try:
        ids = torch.randint(3, 200, (2, 11), generator=torch.Generator().manual_seed(3))
        kw = dict(max_new_tokens=12, min_new_tokens=12, output_logits=True, return_dict_in_generate=True, **GREEDY)
        out, ref = both(model, twin, ids, attention_mask=torch.ones_like(ids), **kw)
        same(out, ref)
        assert server.stats()["decode_loop"]["requests"] == 1
    finally:
        serving.stop(model)
