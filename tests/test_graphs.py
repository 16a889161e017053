"""Graph mode (forgepack/runtime/graphs.py).

CPU: enable/disable and the whole call path (warm-up, capture, replay, eviction, fallback with one
warning, verification) through the emulated backend: a recorded aten trace replayed on the same
tensors, which like a CUDA graph runs no Python on replay. GPU (`gpu` marker): the same with real CUDA
graphs on a tiny Llama, including static-cache decode.
"""

from __future__ import annotations

import ast
import copy
import inspect
import warnings
from pathlib import Path

import pytest
import torch
from graph_models import EMU, Accumulates, Box, Mlp, Scaled, Syncs, UsesBox, static_cache, tiny_llama
from torch import nn

from forgepack.runtime import graphs, replaycheck, transformers_hooks

# --- the call path on CPU ------------------------------------------------------------------------------


def test_cuda_backend_on_cpu_tensors_runs_eagerly_and_counts():
    torch.manual_seed(0)
    model = Mlp().eval()
    run = graphs.GraphedForward(model)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(4):
            out = run(x)
            assert torch.equal(out["y"], model(x)["y"])
    stats = run.stats()
    assert stats["eager_calls"] == 4 and stats["captures"] == 0 and stats["replays"] == 0
    (reason,) = stats["reasons"]
    assert reason in ("CUDA is not available", "tensors on cpu (graphs need CUDA)")


def test_warmup_then_one_capture_then_replays_on_fresh_inputs():
    torch.manual_seed(0)
    model = Mlp().eval()
    run = graphs.GraphedForward(model, warmup=2, **EMU)
    with torch.no_grad():
        for step in range(6):
            x = torch.randn(3, 8)
            out = run(x, scale=2.0, extra="e")
            ref = model(x, scale=2.0, extra="e")
            assert torch.allclose(out["y"], ref["y"]) and torch.allclose(out["pair"][0], ref["pair"][0])
            assert out["pair"][1] == "e" and out["note"] == "kept"
            assert run.stats()["captures"] == (1 if step >= 2 else 0)
    stats = run.stats()
    assert (stats["warmups"], stats["captures"], stats["replays"], stats["eager_calls"]) == (2, 1, 4, 2)
    assert stats["graphs"] == 1 and stats["graph_bytes"] > 0


def test_each_signature_gets_its_own_graph():
    model = Mlp().eval()
    run = graphs.GraphedForward(model, warmup=1, **EMU)
    with torch.no_grad():
        for _ in range(3):
            for batch, scale in ((1, 1.0), (2, 1.0), (2, 3.0)):
                x = torch.randn(batch, 8)
                assert torch.allclose(run(x, scale=scale)["y"], model(x, scale=scale)["y"])
    assert run.stats()["captures"] == 3 and run.stats()["replays"] == 6


def test_outputs_are_copies_unless_zero_copy():
    model = Mlp().eval()
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    with torch.no_grad():
        safe = graphs.GraphedForward(model, warmup=1, **EMU)
        safe(x1)
        first = safe(x1)["y"]  # captured
        kept = first.clone()
        second = safe(x2)["y"]
        assert torch.equal(first, kept) and not torch.equal(second, kept)

        fast = graphs.GraphedForward(model, warmup=1, copy_outputs=False, **EMU)
        fast(x1)
        first = fast(x1)["y"]
        kept = first.clone()
        second = fast(x2)["y"]
        assert second is first  # the static output itself...
        assert not torch.equal(first, kept)  # ...overwritten by the next replay, as documented


def test_lru_eviction_by_count_recaptures_what_comes_back():
    model = Mlp().eval()
    run = graphs.GraphedForward(model, warmup=1, max_graphs=2, **EMU)
    with torch.no_grad():
        for batch in (1, 2, 3):
            for _ in range(3):
                x = torch.randn(batch, 8)
                assert torch.allclose(run(x)["y"], model(x)["y"])
        assert run.stats()["evictions"] == 1 and run.stats()["graphs"] == 2
        for _ in range(2):  # batch 1 was evicted: warm-up again, then a new capture
            run(torch.randn(1, 8))
    assert run.stats()["captures"] == 4 and run.stats()["evictions"] == 2


def test_eviction_by_bytes_and_a_graph_too_large_to_keep():
    model = Mlp().eval()
    with torch.no_grad():
        probe = graphs.GraphedForward(model, warmup=1, **EMU)
        for _ in range(2):
            probe(torch.randn(4, 8))
        one = probe.stats()["graph_bytes"]

        run = graphs.GraphedForward(model, warmup=1, max_bytes=one + one // 2, **EMU)
        for _ in range(2):
            run(torch.randn(4, 8))
        for _ in range(2):
            run(torch.randn(4, 8), scale=2.0)  # a second graph of the same size: over the bound together
        assert run.stats()["evictions"] == 1 and run.stats()["graphs"] == 1

        tiny = graphs.GraphedForward(model, warmup=1, max_bytes=one // 2, **EMU)
        x = torch.randn(4, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # giving up for size is not worth a warning
            outs = [tiny(x)["y"] for _ in range(4)]
    ref = model(x)["y"]
    assert all(torch.allclose(o, ref) for o in outs)
    stats = tiny.stats()
    assert stats["captures"] == 1 and stats["graphs"] == 0 and stats["fallbacks"] == 1
    assert "over max_bytes" in next(iter(stats["failures"].values()))
    assert stats["reasons"]["over max_bytes"] == 2  # why they ran eagerly, not a capture that failed


def test_capture_failure_falls_back_to_eager_with_one_warning_per_signature():
    model = Syncs()
    run = graphs.GraphedForward(model, warmup=1, **EMU)
    x, y = torch.randn(3), torch.randn(5)
    with torch.no_grad():
        run(x)
        with pytest.warns(RuntimeWarning, match="running eagerly.*capture failed.*host") as caught:
            out = run(x)
        assert len(caught) == 1 and torch.equal(out, model(x))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                assert torch.equal(run(x), model(x))
        run(y)
        with pytest.warns(RuntimeWarning):
            run(y)  # another signature: its own single warning
    stats = run.stats()
    assert stats["fallbacks"] == 2 and stats["captures"] == 0 and stats["replays"] == 0
    assert stats["eager_calls"] == 7


def test_writes_to_arguments_and_buffers_repeat_on_replay():
    model = Accumulates()
    twin = copy.deepcopy(model)
    run = graphs.GraphedForward(model, warmup=1, **EMU)
    with torch.no_grad():
        for step in range(5):
            x, x_ref = torch.full((4,), float(step + 1)), torch.full((4,), float(step + 1))
            out = run(x)
            ref = twin(x_ref)
            assert torch.equal(out, ref), step
            assert torch.equal(x, x_ref), step  # the in-place write reached the caller's tensor
    assert torch.equal(model.total, twin.total)
    assert run.stats()["replays"] == 4


def test_argument_objects_are_used_by_reference():
    model = UsesBox()
    box, twin = Box(), Box()
    run = graphs.GraphedForward(model, warmup=1, **EMU)
    with torch.no_grad():
        for step in range(5):
            x = torch.full((4,), float(step))
            out, same = run(x, box)
            ref, _ = model(x, twin)
            assert same is box and torch.equal(out, ref)
    assert torch.equal(box.state, twin.state) and run.stats()["replays"] == 4


def test_grad_mode_runs_eagerly_with_one_warning():
    model = Mlp()
    run = graphs.GraphedForward(model, warmup=1, **EMU)
    x = torch.randn(2, 8)
    with pytest.warns(RuntimeWarning, match="grad mode"):
        out = run(x)
    out["y"].sum().backward()  # autograd still works: it ran eagerly
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(x)
    assert run.stats()["eager_calls"] == 2 and run.stats()["captures"] == 0


def test_training_flag_and_context_key_are_part_of_the_key():
    model = Mlp()
    active = {"kernels": "a"}
    run = graphs.GraphedForward(model, warmup=1, context_key=lambda: active["kernels"], **EMU)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for mode in ("eval", "train", "eval"):
            getattr(model, mode)()
            run(x)
            run(x)
        active["kernels"] = "b"
        run(x)
        run(x)
    assert run.stats()["captures"] == 3 and run.stats()["replays"] == 5  # each capture step replays too


def test_an_active_dispatch_mode_runs_eagerly():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    model = Mlp().eval()
    run = graphs.GraphedForward(model, warmup=1, **EMU)
    x = torch.randn(2, 8)
    with torch.no_grad():
        run(x)
        run(x)
        with Count():
            run(x)
    assert Count.calls > 0  # the mode saw the forward's ops: nothing was replayed behind its back
    assert run.stats()["reasons"]["a TorchDispatchMode is active"] == 1


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="warmup"):
        graphs.GraphedForward(Mlp(), warmup=0)
    with pytest.raises(ValueError, match="backend"):
        graphs.GraphedForward(Mlp(), backend="tpu")
    with pytest.raises(ValueError, match="pool"):
        graphs.GraphedForward(Mlp(), pool="mine")


# --- a real transformers model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def test_llama_prefill_replays_match_eager(llama):
    run = graphs.GraphedForward(llama, **EMU)
    with torch.no_grad():
        for _ in range(5):
            ids = torch.randint(0, 256, (1, 12))
            out, ref = run(input_ids=ids, use_cache=False), llama(input_ids=ids, use_cache=False)
            assert torch.allclose(out.logits, ref.logits, atol=1e-5)
    assert run.stats()["replays"] == 3 and not run.stats()["failures"]


def _attention_masks(run: graphs.GraphedForward) -> list:
    """The attn_mask argument of every attention call in each captured (emulated) graph."""
    masks = []
    for entry in run._cache.entries("graph"):
        for func, args, kwargs, _ in entry.captured.handle.calls:
            if "scaled_dot_product" in func._schema.name:
                i = [a.name for a in func._schema.arguments].index("attn_mask")
                masks.append(args[i] if i < len(args) else kwargs.get("attn_mask"))
    return masks


def test_an_encoder_capture_takes_the_eager_mask_shortcut_too():
    """ViT: under capture transformers 5.17 (the GPU image) expands an all-true bidirectional mask whose
    last dim has stride 0, which no fused SDPA kernel accepts (measured: every backend fell
    back to math). With only pixel values from the caller, the capture passes no mask, as eager does.
    transformers 5.24 skips that mask under capture on its own; the replay must match eager on both."""
    from transformers import ViTConfig, ViTForImageClassification

    model = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                intermediate_size=64, image_size=32, patch_size=8,
                                                attn_implementation="sdpa")).eval()
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        run = graphs.GraphedForward(model, **EMU)
        for _ in range(3):
            out = run(pixel_values=pixels)
        assert torch.allclose(out.logits, model(pixel_values=pixels).logits, atol=1e-5)
        masks = _attention_masks(run)
        assert masks and all(m is None for m in masks), [None if m is None else m.stride() for m in masks]


@pytest.mark.parametrize("model_name", ["llama", "gpt2"])
def test_prefill_capture_takes_the_eager_mask_shortcut(model_name, llama):
    """Under capture transformers cannot check on the host that nothing is padded or packed, so it
    builds a full mask that every layer's SDPA converts. Without a mask, positions or cache from the
    caller the checks pass by construction, and the capture runs what eager runs: no mask at all."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = llama if model_name == "llama" else GPT2LMHeadModel(
        GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=256, n_positions=64)).eval()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        run = graphs.GraphedForward(model, **EMU)
        for _ in range(3):
            out = run(input_ids=ids, use_cache=False)
        assert torch.allclose(out.logits, model(input_ids=ids, use_cache=False).logits, atol=1e-5)
        assert run.stats()["captures"] == 1 and _attention_masks(run) and not any(
            m is not None for m in _attention_masks(run))
        # A caller's mask (or positions) decides the mask from data: then the capture builds it.
        masked = graphs.GraphedForward(model, **EMU)
        pad = torch.ones_like(ids)
        pad[0, :3] = 0
        for _ in range(3):
            out = masked(input_ids=ids, attention_mask=pad, use_cache=False)
        assert torch.allclose(out.logits, model(input_ids=ids, attention_mask=pad, use_cache=False).logits, atol=1e-5)
        assert all(m is not None for m in _attention_masks(masked))


def test_the_mask_shortcut_is_confined_to_the_capturing_thread_and_undone():
    """Serving code may capture in one thread while another runs transformers: only the capturing
    thread sees the eager answers, and the originals come back when the last capture ends."""
    import threading

    from transformers import masking_utils
    from transformers.utils import import_utils

    originals = (masking_utils.is_tracing, masking_utils.find_packed_sequence_indices,
                 import_utils.is_cuda_stream_capturing)
    packed = torch.tensor([[0, 1, 2, 0, 1]])
    seen = {}

    def other_thread():
        seen["other"] = masking_utils.find_packed_sequence_indices(packed)

    with transformers_hooks.eager_mask_choice((), {"input_ids": packed}) as applied:
        assert applied
        assert masking_utils.find_packed_sequence_indices(packed) is None
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        with transformers_hooks.eager_mask_choice((), {"input_ids": packed}):  # a nested capture keeps the hooks
            pass
        assert masking_utils.find_packed_sequence_indices(packed) is None
    assert seen["other"] is not None and seen["other"].tolist() == [[0, 0, 0, 1, 1]]
    assert (masking_utils.is_tracing, masking_utils.find_packed_sequence_indices,
            import_utils.is_cuda_stream_capturing) == originals
    with transformers_hooks.eager_mask_choice((), {"input_ids": packed, "attention_mask": packed}) as applied:
        assert not applied and masking_utils.find_packed_sequence_indices is originals[1]


def test_llama_static_cache_decode_replays_one_graph_per_step(llama):
    cache, twin = static_cache(llama), static_cache(llama)
    run = graphs.GraphedForward(llama, **EMU)
    with torch.no_grad():
        prompt = torch.randint(0, 256, (1, 9))
        key = graphs.cache_kwarg(llama)
        run(input_ids=prompt, use_cache=True, **{key: cache})  # prefill: another signature
        llama(input_ids=prompt, use_cache=True, **{key: twin})
        token = torch.randint(0, 256, (1, 1))
        for step in range(7):
            out = run(**graphs.decode_kwargs(llama, token, cache, position=9 + step))
            ref = llama(**graphs.decode_kwargs(llama, token, twin, position=9 + step))
            assert getattr(out, key) is cache  # the cache comes back as itself, not a copy
            assert torch.allclose(out.logits, ref.logits, atol=1e-5), step
            token = ref.logits[:, -1:].argmax(-1)
    for mine, theirs in zip(cache.layers, twin.layers, strict=True):
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-6) and torch.allclose(mine.values, theirs.values)
    stats = run.stats()
    assert stats["captures"] == 1 and stats["replays"] == 7 - 2 and stats["graphs"] == 1


def _captured_calls(run: graphs.GraphedForward, name: str) -> list:
    """(args, kwargs) of every aten call named `name` in the captured (emulated) graphs."""
    return [(args, kwargs) for entry in run._cache.entries("graph")
            for func, args, kwargs, _ in entry.captured.handle.calls if func._schema.name == f"aten::{name}"]


def _decode(model, cache, twin, steps: int = 5) -> graphs.GraphedForward:
    """A prefill then `steps` graphed decode steps, each checked against eager on `twin`."""
    run = graphs.GraphedForward(model, **EMU)
    key = graphs.cache_kwarg(model)
    with torch.no_grad():
        prompt = torch.randint(0, 256, (1, 7))
        model(input_ids=prompt, use_cache=True, **{key: cache})
        model(input_ids=prompt, use_cache=True, **{key: twin})
        token = torch.randint(0, 256, (1, 1))
        for step in range(steps):
            out = run(**graphs.decode_kwargs(model, token, cache, position=7 + step))
            ref = model(**graphs.decode_kwargs(model, token, twin, position=7 + step))
            assert torch.allclose(out.logits, ref.logits, atol=1e-5), step
            token = ref.logits[:, -1:].argmax(-1)
    assert run.stats()["replays"] == steps - 2
    return run


def test_decode_capture_converts_the_mask_once(llama):
    """A static cache's decode step builds one boolean mask that every layer's SDPA would convert. The
    captured step converts it once and every layer's attention gets that one additive mask."""
    run = _decode(llama, static_cache(llama), static_cache(llama))
    sdpa = [c for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math")
            for c in _captured_calls(run, name)]
    assert len(sdpa) == llama.config.num_hidden_layers
    masks = {id(kwargs.get("attn_mask", args[3] if len(args) > 3 else None)) for args, kwargs in sdpa}
    mask = sdpa[0][1].get("attn_mask", sdpa[0][0][3] if len(sdpa[0][0]) > 3 else None)
    assert len(masks) == 1 and mask is not None and mask.dtype == torch.float32
    assert len(_captured_calls(run, "masked_fill_")) == 1  # once, not once per layer


def _attention_args(original):
    """A stand-in for transformers' registered function that records the mask it is handed."""
    import threading

    seen = []

    def record(module, query, key, value, attention_mask, *args, **kwargs):
        seen.append((threading.get_ident(), attention_mask))
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    return record, seen


def test_one_conversion_is_confined_to_the_capturing_thread_and_undone(llama):
    """Only the capturing thread's one-token calls get the converted mask, the same tensor for every
    call with the same mask; other threads, calls with a position bias or several query tokens, and
    calls after the capture get theirs."""
    import threading

    from transformers.modeling_utils import AttentionInterface

    original = AttentionInterface._global_mapping["sdpa"]
    record, seen = _attention_args(original)
    AttentionInterface._global_mapping["sdpa"] = record
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8)
    keep = torch.tensor([True, True, True, False, False]).view(1, 1, 1, 5)
    module = types_module(num_key_value_groups=2, is_causal=True)
    try:
        with transformers_hooks.mask_once() as applied:
            assert applied
            routed = AttentionInterface._global_mapping["sdpa"]
            routed(module, q, k, k, keep, scaling=0.5)
            routed(module, q, k, k, keep, scaling=0.5)
            worker = threading.Thread(target=lambda: routed(module, q, k, k, keep))
            worker.start()
            worker.join()
            routed(module, q, k, k, keep, position_bias=torch.zeros(1, 4, 1, 5))
            prompt = torch.randn(1, 4, 3, 8)  # several query tokens: padded rows may see nothing
            routed(module, prompt, k, k, keep.expand(1, 1, 3, 5))
        assert AttentionInterface._global_mapping["sdpa"] is record
        record(module, q, k, k, keep)
    finally:
        AttentionInterface._global_mapping["sdpa"] = original
    (_, first), (_, second), (other, third), (_, biased), (_, several), (_, after) = seen
    assert first.dtype == torch.float32 and second is first
    assert first[0, 0, 0].tolist() == [0.0, 0.0, 0.0, float("-inf"), float("-inf")]
    assert other == worker.ident and third is keep and biased is keep and after is keep
    assert several.dtype == torch.bool


def types_module(**attrs):
    import types

    return types.SimpleNamespace(**attrs)


@pytest.mark.parametrize("heads,kv_heads,per_head", [(4, 2, False), (4, 4, False), (8, 2, True), (4, 1, False)])
def test_one_conversion_matches_sdpa_on_a_boolean_mask(heads, kv_heads, per_head):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    torch.manual_seed(0)
    b, length, dim = 2, 9, 16
    q = torch.randn(b, heads, 1, dim)
    k, v = torch.randn(b, kv_heads, length, dim), torch.randn(b, kv_heads, length, dim)
    keep = torch.rand(b, heads if per_head else 1, 1, length) > 0.4
    keep[..., 0] = True
    module = types_module(num_key_value_groups=heads // kv_heads, is_causal=True)
    ref, _ = sdpa_attention_forward(module, q, k, v, keep, dropout=0.0, scaling=0.25)
    with transformers_hooks.mask_once():
        out, _ = AttentionInterface._global_mapping["sdpa"](module, q, k, v, keep, dropout=0.0, scaling=0.25)
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-6), (out - ref).abs().max()


def test_gate_style_verification_on_a_loaded_decode_recipe():
    from forgepack import models, recipe

    r = recipe.resolve("tiny-llama").replace(
        workload={"phase": "decode", "seq_len": 1, "cache_len": 12, "static_cache": True})
    lm = models.load(r)
    before = lm.output_tensor(lm.run()).clone()
    ok, reason = replaycheck.verify_replay(lm.model, lm.make_inputs, n=3, backend="emulate")
    assert ok, reason
    assert torch.equal(lm.output_tensor(lm.run()), before)  # the cache was left where it was


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-bert", "tiny-resnet"])
def test_gate_style_verification_on_the_tiny_recipes(name):
    from forgepack import models, recipe

    lm = models.load(recipe.resolve(name))
    ok, reason = replaycheck.verify_replay(lm.model, lm.make_inputs, n=2, backend="emulate")
    assert ok, reason


def test_verification_lets_decode_positions_advance_when_asked(llama):
    cache = static_cache(llama, length=32)
    key = graphs.cache_kwarg(llama)
    with torch.no_grad():
        llama(input_ids=torch.randint(0, 256, (1, 6)), use_cache=True, **{key: cache})
    gen = torch.Generator().manual_seed(0)

    def make(step):
        return graphs.decode_kwargs(llama, torch.randint(0, 256, (1, 1), generator=gen), cache)

    ok, reason = replaycheck.verify_replay(llama, make, n=4, restore_state=False, backend="emulate")
    assert ok, reason
    assert int(cache.layers[0].cumulative_length) == 6  # left as found


def test_a_dynamic_cache_is_not_replayable_and_says_why(llama):
    from transformers import DynamicCache

    cache = DynamicCache()
    key = graphs.cache_kwarg(llama)
    with torch.no_grad():
        llama(input_ids=torch.randint(0, 256, (1, 6)), use_cache=True, **{key: cache})
    ok, reason = replaycheck.verify_replay(
        llama, lambda step: {"input_ids": torch.randint(0, 256, (1, 1)), key: cache, "use_cache": True},
        backend="emulate")
    assert not ok and "replaces tensors" in reason


def test_cache_kwarg_follows_the_installed_transformers(llama):
    params = inspect.signature(type(llama).forward).parameters
    assert graphs.cache_kwarg(llama) == ("cache" if "cache" in params else "past_key_values")


# --- enable / disable --------------------------------------------------------------------------------


def test_enable_and_disable_an_instance_restore_exactly(llama):
    cls_forward = type(llama).forward
    params = list(inspect.signature(llama.forward).parameters)
    gf = graphs.enable(llama, warmup=1, **EMU)
    assert isinstance(llama.forward, graphs.GraphedForward) and graphs.graphed(llama) is gf
    assert graphs.enable(llama) is gf  # twice: the first stays
    assert list(inspect.signature(llama.forward).parameters) == params  # transformers reads it
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        outs = [llama(input_ids=ids, use_cache=False).logits for _ in range(3)]
    assert gf.stats()["replays"] == 2 and all(torch.allclose(o, outs[0]) for o in outs)
    assert graphs.disable(llama) and not graphs.disable(llama)
    assert "forward" not in vars(llama) and llama.forward.__func__ is cls_forward
    assert gf.stats()["graphs"] == 0


def test_disable_restores_an_instance_level_forward():
    model = Mlp()

    def own(x):
        return {"own": x}

    model.forward = own
    graphs.enable(model, **EMU)
    assert graphs.disable(model)
    assert vars(model)["forward"] is own


def test_enable_a_class_patches_every_instance_and_restores(monkeypatch):
    class Base(nn.Module):
        def forward(self, x):
            return x * 2

    class Child(Base):
        pass

    original = Base.__dict__["forward"]
    graphs.enable(Base, warmup=1, **EMU)
    a, b = Base(), Base()
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(a(torch.ones(2)), torch.full((2,), 2.0))
        b(torch.ones(3))
    assert graphs.graphed(a).stats()["replays"] == 2 and graphs.graphed(b) is not graphs.graphed(a)
    assert graphs.eager_forward(a).__func__ is original
    graphs.enable(Child, **EMU)  # inherited forward
    assert "forward" in Child.__dict__
    assert graphs.disable_all() == 2
    assert Base.__dict__["forward"] is original and "forward" not in Child.__dict__
    assert graphs.graphed(a) is None and not graphs.disable(Base)


def test_kill_switch_leaves_the_forward_alone(monkeypatch):
    monkeypatch.setenv("FORGEPACK_DISABLE", "1")
    model = Mlp()
    assert graphs.enable(model) is None and "forward" not in vars(model)


def test_deepcopy_of_an_enabled_module_gets_its_own_wrapper():
    model = Mlp().eval()
    gf = graphs.enable(model, warmup=1, **EMU)
    clone = copy.deepcopy(model)
    assert isinstance(clone.forward, graphs.GraphedForward) and clone.forward is not gf
    assert clone.forward.fn.__self__ is clone
    with torch.no_grad():
        clone.b.weight.add_(1)
        x = torch.randn(1, 8)
        assert not torch.allclose(clone(x)["y"], model(x)["y"])
    graphs.disable(model)
    graphs.disable(clone)


# --- the runtime imports nothing of forgepack ----------------------------------------------------------


def test_runtime_modules_import_only_torch_the_standard_library_and_each_other():
    import sys

    runtime = Path(graphs.__file__).parent
    names = {f.stem for f in runtime.glob("*.py")}
    for path in sorted(runtime.glob("*.py")):
        roots = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level:
                # relative: another runtime file, which the pack holds beside this one
                assert node.level == 1, (path.name, "only siblings: the pack copies the runtime flat")
                inside = [node.module] if node.module else [alias.name for alias in node.names]
                assert {m.split(".")[0] for m in inside} <= names, (path.name, inside)
            elif isinstance(node, ast.ImportFrom):
                roots.add(node.module.split(".")[0])
        assert roots - {"torch", "__future__", "transformers", "tomli"} <= set(sys.stdlib_module_names), (path, roots)


# --- real CUDA graphs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_llama():
    return tiny_llama().cuda()


@pytest.mark.gpu
def test_gpu_prefill_capture_and_replay(cuda_llama):
    run = graphs.GraphedForward(cuda_llama)
    with torch.no_grad():
        for _ in range(6):
            ids = torch.randint(0, 256, (2, 16), device="cuda")
            out, ref = run(input_ids=ids, use_cache=False), cuda_llama(input_ids=ids, use_cache=False)
            assert torch.allclose(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    stats = run.stats()
    assert (stats["captures"], stats["replays"], stats["fallbacks"]) == (1, 4, 0), stats
    assert stats["graph_bytes"] > 0


@pytest.mark.gpu
def test_gpu_static_cache_decode_replays_with_advancing_positions(cuda_llama):
    cache, twin = static_cache(cuda_llama), static_cache(cuda_llama)
    key = graphs.cache_kwarg(cuda_llama)
    run = graphs.GraphedForward(cuda_llama)
    with torch.no_grad():
        prompt = torch.randint(0, 256, (1, 9), device="cuda")
        run(input_ids=prompt, use_cache=True, **{key: cache})
        cuda_llama(input_ids=prompt, use_cache=True, **{key: twin})
        token = torch.randint(0, 256, (1, 1), device="cuda")
        for step in range(10):
            out = run(**graphs.decode_kwargs(cuda_llama, token, cache, position=9 + step))
            ref = cuda_llama(**graphs.decode_kwargs(cuda_llama, token, twin, position=9 + step))
            assert torch.allclose(out.logits, ref.logits, rtol=1e-4, atol=1e-4), step
            token = ref.logits[:, -1:].argmax(-1)
    for mine, theirs in zip(cache.layers, twin.layers, strict=True):
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-5)
    assert int(cache.layers[0].cumulative_length) == 19
    stats = run.stats()
    assert stats["captures"] == 1 and stats["replays"] == 8 and stats["fallbacks"] == 0, stats


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_one_conversion_matches_sdpa_on_a_boolean_mask(dtype):
    """Llama-1B's decode attention on the GPU (32 heads over 8, a 512-long static cache's boolean
    mask): transformers' function with the mask converted once gives what it gives with SDPA
    converting it, to the bit (the masked terms' exponentials are zero either way)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    torch.manual_seed(0)
    q = torch.randn(1, 32, 1, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, 8, 512, 64, device="cuda", dtype=dtype) for _ in range(2))
    keep = (torch.arange(512, device="cuda") <= 300).view(1, 1, 1, 512)
    module = types_module(num_key_value_groups=4, is_causal=True)
    with torch.no_grad():
        ref, _ = sdpa_attention_forward(module, q, k, v, keep, dropout=0.0, scaling=0.125)
        with transformers_hooks.mask_once():
            out, _ = AttentionInterface._global_mapping["sdpa"](module, q, k, v, keep, dropout=0.0, scaling=0.125)
    assert torch.equal(out, ref), (out.float() - ref.float()).abs().max()


@pytest.mark.gpu
def test_gpu_capture_unsafe_forward_falls_back_once():
    model = Syncs().cuda()
    run = graphs.GraphedForward(model, warmup=1)
    x = torch.randn(64, device="cuda")
    with torch.no_grad():
        run(x)
        with pytest.warns(RuntimeWarning, match="capture failed"):
            out = run(x)
        assert torch.equal(out, model(x))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(3):
                assert torch.equal(run(x), model(x))
    assert run.stats()["fallbacks"] == 1 and run.stats()["replays"] == 0
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # the capture stream was left
    y = torch.randn(32, 32, device="cuda")
    assert torch.allclose(y @ y, (y.cpu() @ y.cpu()).cuda(), atol=1e-3)  # CUDA still works


@pytest.mark.gpu
def test_gpu_verify_replay_and_capture_safe_check(cuda_llama):
    cache = static_cache(cuda_llama, length=40)
    key = graphs.cache_kwarg(cuda_llama)
    with torch.no_grad():
        cuda_llama(input_ids=torch.randint(0, 256, (1, 8), device="cuda"), use_cache=True, **{key: cache})

    def decode(step):
        return graphs.decode_kwargs(cuda_llama, torch.randint(0, 256, (1, 1), device="cuda"), cache)

    for restore in (True, False):
        ok, reason = replaycheck.verify_replay(cuda_llama, decode, n=3, restore_state=restore)
        assert ok, reason
    assert int(cache.layers[0].cumulative_length) == 8

    model = Scaled().cuda()

    def scaled(step):
        model.scale = 1.0 + step
        return (torch.randn(8, device="cuda"),)

    ok, reason = replaycheck.verify_replay(model, scaled)
    assert not ok and "replay step" in reason
    ok, reason = replaycheck.capture_safe_check(Syncs().cuda(), (torch.randn(8, device="cuda"),))
    assert not ok and "capture failed" in reason


@pytest.mark.gpu
def test_gpu_eviction_shared_pool_and_zero_copy():
    model = Mlp(64).cuda().eval()
    run = graphs.GraphedForward(model, warmup=1, max_graphs=2)
    other = graphs.GraphedForward(model, warmup=1)
    assert run._backend.pool_for(torch.device("cuda", 0)) is other._backend.pool_for(torch.device("cuda", 0))
    with torch.no_grad():
        for batch in (1, 2, 3):
            for _ in range(3):
                x = torch.randn(batch, 64, device="cuda")
                assert torch.allclose(run(x)["y"], model(x)["y"], atol=1e-5)
        assert run.stats()["evictions"] == 1 and run.stats()["graphs"] == 2

        fast = graphs.GraphedForward(model, warmup=1, copy_outputs=False)
        x1, x2 = torch.randn(4, 64, device="cuda"), torch.randn(4, 64, device="cuda")
        fast(x1)
        first = fast(x1)["y"]
        kept = first.clone()
        assert fast(x2)["y"] is first and not torch.equal(first, kept)

        small = graphs.GraphedForward(model, warmup=1, max_bytes=1)
        for _ in range(3):
            assert torch.allclose(small(x1)["y"], model(x1)["y"], atol=1e-5)
        assert small.stats()["graphs"] == 0 and small.stats()["fallbacks"] == 1


@pytest.mark.gpu
def test_gpu_input_writes_and_enable_on_a_model(cuda_llama):
    model = Accumulates().cuda()
    twin = copy.deepcopy(model)
    run = graphs.GraphedForward(model, warmup=1)
    with torch.no_grad():
        for step in range(4):
            x, x_ref = (torch.full((4,), float(step + 1), device="cuda") for _ in range(2))
            assert torch.equal(run(x), twin(x_ref)) and torch.equal(x, x_ref)
    gf = graphs.enable(cuda_llama)
    try:
        ids = torch.randint(0, 256, (1, 7), device="cuda")
        with torch.no_grad():
            outs = [cuda_llama(input_ids=ids, use_cache=False).logits for _ in range(4)]
        assert gf.stats()["replays"] == 2 and all(torch.allclose(o, outs[0], atol=1e-4) for o in outs)
    finally:
        graphs.disable(cuda_llama)


@pytest.mark.gpu
def test_gpu_a_failed_capture_leaves_the_shared_pool_and_the_rng_usable():
    """Regression (torch 2.11): a capture invalidated by a host sync left the shared pool "already
    recording" and the CUDA generator in capture mode, so the next capture and every random op failed."""
    bad = graphs.GraphedForward(Syncs().cuda(), warmup=1)
    model = Mlp(64).cuda().eval()
    good = graphs.GraphedForward(model, warmup=1)
    x = torch.randn(8, device="cuda")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            assert torch.equal(bad(x), Syncs()(x))
    assert bad.stats()["fallbacks"] == 1
    torch.randn(4, device="cuda").uniform_()  # the generator left capture mode
    y = torch.randn(2, 64, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            assert torch.allclose(good(y)["y"], model(y)["y"], atol=1e-5)
    assert good.stats()["captures"] == 1 and good.stats()["fallbacks"] == 0, good.stats()
