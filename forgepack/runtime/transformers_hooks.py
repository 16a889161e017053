"""Everything of graph mode that touches transformers internals: the stand-ins a capture installs, and
the decode step's arguments.

- `eager_mask_choice`: under capture, transformers' mask code is answered as in eager mode (its host
  checks of the mask), so a prompt with no mask or positions gets the same `is_causal` SDPA call.
- `mask_once`: under capture, transformers' "sdpa" registry entry converts a boolean mask once per
  forward instead of once per layer.
- `cache_kwarg_of` / `decode_kwargs_of`: the cache argument's name and a replayable decode step's
  arguments, which differ between transformers versions.

The stand-ins are installed while any thread captures and answer differently only in the capturing
thread (`CaptureHooks`); they find transformers through `sys.modules` and do nothing without it.
Fragile by nature: each names the transformers function it stands in for, so a renamed one turns the
stand-in off (the capture then takes transformers' own capture-safe path). Part of the pack runtime:
torch and the standard library only.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .graphkeys import tensor_version

# Keyword arguments after which an HF model's attention mask depends on nothing but the shapes: no
# padding mask, no positions, no cache from the caller (the model numbers the positions 0..n-1 itself).
_SHAPE_ONLY_MASK_KWARGS = frozenset({"input_ids", "inputs_embeds", "pixel_values", "use_cache", "return_dict",
                                     "output_attentions", "output_hidden_states", "logits_to_keep"})


class CaptureHooks:
    """Stand-ins transformers sees while any thread captures: installed when the first capture begins,
    undone when the last ends. Each stand-in answers differently only in the threads in `threads`."""

    def __init__(self):
        self.threads: collections.Counter[int] = collections.Counter()  # thread -> captures inside
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []

    @contextlib.contextmanager
    def held(self, install: Callable[[], list[Callable[[], None]]]) -> Iterator[None]:
        """`install()` (first capture only) puts the stand-ins in place and returns how to undo each."""
        me = threading.get_ident()
        with self._lock:
            if not self.threads:
                self._undo = install()
            self.threads[me] += 1
        try:
            yield
        finally:
            with self._lock:
                self.threads[me] -= 1
                if not self.threads[me]:
                    del self.threads[me]
                if not self.threads:
                    for undo in reversed(self._undo):
                        undo()
                    self._undo = []


_MASK_HOOKS = CaptureHooks()  # transformers' host checks of the mask, answered as in eager mode


@contextlib.contextmanager
def eager_mask_choice(args: tuple, kwargs: dict) -> Iterator[bool]:
    """Lets transformers choose the attention mask under capture as it does in eager mode.

    In eager mode transformers checks on the host that no token is padded and that the positions it
    numbered are consecutive (not packed sequences), and then lets SDPA apply causality itself
    (`is_causal`, no mask). Under stream capture it cannot read the device, so it builds the full mask,
    and every layer's SDPA converts it (two fills and a `where`) and runs its slower masked kernel:
    on GPT-2 (b4 s256, H200) 66 µs of conversions and 30 µs of attention per forward.
    When the caller passes no mask, no positions and no cache (`_SHAPE_ONLY_MASK_KWARGS`), both checks
    pass by construction: the positions are the model's own arange. Then, in this thread and for the
    capture only, `masking_utils` is answered as in eager mode (its `is_tracing` does not count the
    stream capture, the packed-sequence probe finds none), so the graph runs what an eager call runs.
    Other threads, and transformers outside `masking_utils`, see no change. Yields whether it applied."""
    mu = sys.modules.get("transformers.masking_utils")
    iu = sys.modules.get("transformers.utils.import_utils")
    shape_only = len(args) <= 1 and all(v is None or k in _SHAPE_ONLY_MASK_KWARGS for k, v in kwargs.items())
    hooks = (mu is not None and iu is not None and hasattr(iu, "is_cuda_stream_capturing")
             and all(hasattr(mu, n) for n in ("is_tracing", "find_packed_sequence_indices")))
    if not (shape_only and hooks):
        yield False
        return
    with _MASK_HOOKS.held(lambda: _install_mask_hooks(mu, iu)):
        yield True


def _install_mask_hooks(mu: Any, iu: Any) -> list[Callable[[], None]]:
    """Thread-aware stand-ins for the three transformers functions; returns their undoing."""
    real_tracing, real_packed, real_capturing = (mu.is_tracing, mu.find_packed_sequence_indices,
                                                 iu.is_cuda_stream_capturing)
    hide = threading.local()

    def is_cuda_stream_capturing():
        return False if getattr(hide, "on", False) else real_capturing()

    def is_tracing(tensor=None):
        if threading.get_ident() not in _MASK_HOOKS.threads:
            return real_tracing(tensor)
        hide.on = True
        try:
            return real_tracing(tensor)
        finally:
            hide.on = False

    def find_packed_sequence_indices(position_ids):
        return None if threading.get_ident() in _MASK_HOOKS.threads else real_packed(position_ids)

    undo = []
    for module, name, stand_in in ((iu, "is_cuda_stream_capturing", is_cuda_stream_capturing),
                                   (mu, "is_tracing", is_tracing),
                                   (mu, "find_packed_sequence_indices", find_packed_sequence_indices)):
        undo.append(functools.partial(setattr, module, name, getattr(module, name)))
        setattr(module, name, stand_in)
    return undo


# --- one mask conversion per captured forward ---------------------------------------------------------
#
# With a data-dependent mask (a static cache's decode step, with or without a caller's padding mask)
# transformers builds one boolean mask per forward and passes it to every layer's `sdpa_attention_forward`,
# and SDPA converts it to an additive mask in every layer: two fills and a `where`, 48 kernels per Llama-1B decode step
# (H200, `benchmarks/2026-11-30-h200-llama-decode-graphs`). For a capture, and only in the capturing thread, the
# "sdpa" entry of transformers' attention registry converts a boolean mask once (per mask object and
# version) and hands the additive mask to transformers' own function, which then runs as before.
# Only calls of one query token are converted: that row always has an unmasked position (the token
# itself), where any large negative value gives the same bits. A prompt with padding has rows with
# nothing to attend to, whose result depends on the value SDPA picks per backend: those calls, and calls
# with a position bias (transformers combines the two itself), keep their boolean mask.
# The 2026-11-30-h200-llama-decode-graphs run also tried running decode attention with a group's query heads as query
# rows (no repeated key/value heads): cuDNN then took a 64-row wgmma kernel, 13 µs per layer against 7 µs, so no.

_ROUTE_HOOKS = CaptureHooks()  # transformers' "sdpa" registry entry, converting the mask once
_ROUTE_LOCAL = threading.local()  # .masks: {id(bool mask): (mask, version, additive)} for this capture
# The additive value of a masked position: what SDPA's cuDNN path gives it in half types (finite, so an
# all-masked row cannot turn into NaN), and SDPA's own -inf otherwise. A row with an unmasked position
# comes out the same either way: the masked terms' exponentials are exactly zero.
_MASKED = {torch.float16: -65504.0, torch.bfloat16: -65504.0}


def _sdpa_registry() -> dict | None:
    mu = sys.modules.get("transformers.modeling_utils")
    mapping = getattr(getattr(mu, "AttentionInterface", None), "_global_mapping", None)
    return mapping if isinstance(mapping, dict) and callable(mapping.get("sdpa")) else None


@contextlib.contextmanager
def mask_once() -> Iterator[bool]:
    """For the capture inside, this thread's transformers SDPA calls share one conversion of each
    boolean mask. Yields whether the route is installed (transformers loaded with an "sdpa" entry)."""
    mapping = _sdpa_registry()
    if mapping is None:
        yield False
        return
    outer = getattr(_ROUTE_LOCAL, "masks", None)
    with _ROUTE_HOOKS.held(lambda: _install_converting_sdpa(mapping)):
        _ROUTE_LOCAL.masks = {}
        try:
            yield True
        finally:
            _ROUTE_LOCAL.masks = outer


def _install_converting_sdpa(mapping: dict) -> list[Callable[[], None]]:
    original = mapping["sdpa"]
    mapping["sdpa"] = _converting_sdpa(original)
    return [functools.partial(mapping.__setitem__, "sdpa", original)]


def _converting_sdpa(original: Callable) -> Callable:
    @functools.wraps(original)
    def sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
        masks = getattr(_ROUTE_LOCAL, "masks", None)
        if (masks is not None and isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
                and isinstance(query, torch.Tensor) and query.dim() == 4 and query.shape[2] == 1
                and query.device.type in ("cuda", "cpu") and kwargs.get("position_bias") is None):
            attention_mask = _additive_mask(masks, attention_mask, query.dtype)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    return sdpa_attention_forward


def _additive_mask(masks: dict, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA would convert it, converted once per capture (every layer gets the same
    mask object from the model)."""
    hit = masks.get(id(mask))
    # An inference tensor (a capture under torch.inference_mode()) keeps no version counter: reading
    # `_version` raises, and failed every such capture on the H200. Its version reads as None, and one
    # mask object is not written between the layers of one forward.
    if hit is not None and hit[0] is mask and hit[1] == tensor_version(mask):
        return hit[2]
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        mask.logical_not(), _MASKED.get(dtype, float("-inf")))
    masks[id(mask)] = (mask, tensor_version(mask), additive)  # holds the mask: its id stays its own
    return additive


# ----------------------------------------------------------------------------------------------------
# Decode with a static KV cache


def cache_kwarg_of(forward: Callable) -> str:
    """The forward's cache argument: `cache` (transformers >= 5.2x) or `past_key_values` (earlier)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def decode_kwargs_of(forward: Callable, input_ids: torch.Tensor, cache: Any, position: int | None = None
                     ) -> dict[str, Any]:
    """Arguments of one graph-replayable decode step of `forward` (see `graphs.decode_kwargs`)."""
    kwargs = {"input_ids": input_ids, cache_kwarg_of(forward): cache, "use_cache": True}
    params = inspect.signature(forward).parameters
    takes = "cache_position" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    # transformers 5.17 reads the cache length back to the host when `cache_position` is missing (a sync
    # that fails capture; seen on the H200); 5.2x ignores it. Always give it where it can be passed.
    if takes and position is not None:
        steps = input_ids.shape[-1]
        kwargs["cache_position"] = torch.arange(position, position + steps, device=input_ids.device)
    return kwargs
