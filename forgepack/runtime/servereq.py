"""Serving's per-request helpers: which `generate` calls are served, the KV cache's size and rewind, and
padding a call to its bucket (rows and prompt positions) and slicing the output back.

Shipped inside every pack wheel with `serving`: imports only torch, copy and `graphs`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from . import graphs

# ----------------------------------------------------------------------------------------------------
# Which requests are served


_NOT_SERVED = (("inputs_embeds", "inputs_embeds"), ("assistant_model", "assisted generation"),
               ("prompt_lookup_num_tokens", "assisted generation"), ("prefill_chunk_size", "chunked prefill"),
               ("output_attentions", "attention outputs"), ("output_hidden_states", "hidden-state outputs"))


def _setting(kwargs: dict, config: Any, name: str) -> Any:
    return kwargs[name] if name in kwargs else getattr(config, name, None)


def _unservable(model: Any, ids: Any, args: tuple, kwargs: dict) -> str:
    if args:
        return "positional arguments after the inputs"
    if getattr(model.config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        return "no [batch, length] input_ids"
    config = kwargs.get("generation_config") or model.generation_config
    for name, why in _NOT_SERVED:
        if _setting(kwargs, config, name):
            return why
    if int(_setting(kwargs, config, "num_beams") or 1) > 1:
        return "beam search"
    if _setting(kwargs, config, "use_cache") is False:
        return "use_cache=False"
    return ""


def _new_tokens(kwargs: dict, config: Any, prompt: int) -> int | None:
    new = _setting(kwargs, config, "max_new_tokens")
    if new is not None:
        return int(new)
    total = _setting(kwargs, config, "max_length")
    return int(total) - prompt if total is not None else None


def static_cache(model: Any, length: int) -> Any:
    """A `StaticCache` of `length` slots for `model`, its sliding-window layers plain static ones where the
    window covers the whole cache (the released Gemma-2 and Mistral windows, 4096, over caches up to that):
    such a layer never fills and never rolls, and its sliding mask admits every slot the causal one does,
    so the two layers give the same step; a plain one can be padded, captured and served by blocks."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    cache = StaticCache(config=model.config, max_cache_len=length)
    for i, layer in enumerate(cache.layers):
        if type(layer).__name__ == "StaticSlidingWindowLayer" and layer.max_cache_len >= length:
            cache.layers[i] = StaticLayer(max_cache_len=length)
    return cache


def _plain_static(cache: Any) -> bool:
    """Prompt padding needs full-attention static layers (a sliding window would roll padding in)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer).__name__ == "StaticLayer" for layer in layers)


def _max_len(cache: Any) -> int:
    return int(min(layer.max_cache_len for layer in cache.layers))


def _cache_key(rows: int, length: int, inference: bool) -> tuple:
    return ("kv cache", rows, length, inference)


def cache_bytes(cache: Any) -> int:
    """The bytes a `StaticCache`'s layers hold now (0 before its first prefill allocates them)."""
    layers = getattr(cache, "layers", ())
    if not layers or not all(isinstance(getattr(layer, "keys", None), torch.Tensor) for layer in layers):
        return 0
    return graphs.tensor_bytes(t for layer in layers for t in vars(layer).values() if isinstance(t, torch.Tensor))


def expected_cache_bytes(model: Any, cache: Any, rows: int) -> int:
    """The bytes `cache` will hold once its first prefill allocates its layers (keys and values of each
    layer's length, at the model's dtype; a sliding layer is shorter), before it is allocated."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    size = torch.empty((), dtype=dtype).element_size()
    per_slot = 2 * rows * kv_heads * head_dim * size  # keys and values
    lengths = sum(int(layer.max_cache_len) for layer in cache.layers)
    return per_slot * lengths + 8 * len(cache.layers)  # + each layer's int64 length


def _rewind(cache: Any, steps: int) -> None:
    """Move the cache's device-side length back by the padded positions (in place: same address)."""
    for layer in cache.layers:
        layer.cumulative_length.sub_(steps)


def _without_cache(out: Any, cache: Any) -> Any:
    """forgepack's cache is reused by the next request: it is never handed to the caller."""
    for name in ("cache", "past_key_values"):
        if isinstance(out, dict) and out.get(name) is cache:
            out[name] = None
    return out


# ----------------------------------------------------------------------------------------------------
# Padding and slicing


def _keeps_all(kwargs: dict) -> bool:
    keep = kwargs.get("logits_to_keep", 0)
    return isinstance(keep, int) and keep == 0


_PADDABLE = frozenset({"input_ids", "attention_mask", "position_ids", "cache_position", "logits_to_keep", "cache",
                       "past_key_values", "use_cache", "return_dict"})


def _pads_cleanly(kwargs: dict) -> bool:
    """Only the arguments whose sequence dimension this module knows can be right-padded."""
    keep = kwargs.get("logits_to_keep", 0)
    mask = kwargs.get("attention_mask")
    return (all(k in _PADDABLE or not isinstance(v, torch.Tensor) for k, v in kwargs.items())
            and (isinstance(keep, int) and keep >= 0)
            and (mask is None or (isinstance(mask, torch.Tensor) and mask.dim() in (2, 4))))


def _pad_prompt(kwargs: dict, length: int, padded: int) -> dict:
    """Right-pad the prefill from `length` to `padded` positions. Every argument keeps its layout: the
    padded call has one signature per bucket whatever the prompt's length."""
    extra = padded - length
    ids = kwargs["input_ids"]
    out = dict(kwargs)
    out["input_ids"] = torch.cat([ids, ids.new_zeros(ids.shape[0], extra)], dim=1)
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor):
        step = torch.arange(1, extra + 1, dtype=positions.dtype, device=positions.device)
        out["position_ids"] = torch.cat([positions, positions[..., -1:] + step], dim=-1)
    where = kwargs.get("cache_position")
    if isinstance(where, torch.Tensor):
        out["cache_position"] = torch.cat([where, where[-1:] + torch.arange(1, extra + 1, device=where.device)])
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        # A padded query row attends as the last real row does: never an empty row (NaN in its values would
        # reach real rows through a zero weight); real rows never see padded keys (causality).
        out["attention_mask"] = torch.cat([mask, mask[:, :, -1:].expand(-1, -1, extra, -1)], dim=2)
    elif isinstance(mask, torch.Tensor):
        out["attention_mask"] = torch.cat([mask, mask.new_ones(mask.shape[0], extra)], dim=1)
    keep = kwargs.get("logits_to_keep", 0)
    if keep:  # the last real positions, by value: one graph serves every length of the bucket
        out["logits_to_keep"] = torch.arange(length - keep, length, device=ids.device)
    return out


def _pad_rows(kwargs: dict, batch: int, rows: int) -> dict:
    """Pad every per-row tensor from `batch` to `rows` rows with copies of row 0."""
    if rows == batch:
        return kwargs
    out = dict(kwargs)
    for name, value in kwargs.items():
        per_row = isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch
        if per_row and name != "cache_position":
            out[name] = torch.cat([value, value[:1].expand(rows - batch, *value.shape[1:])], dim=0)
    return out


def _slice_output(out: Any, batch: int, length: int | None) -> Any:
    """The output as `generate` expects it: the real rows (and with every logit kept, real positions)."""
    logits = getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        return out
    sliced = logits[:batch] if length is None else logits[:batch, :length]
    if sliced.shape == logits.shape:
        return out
    new = copy.copy(out)  # never edit the output in place: with copy_outputs=False it is the graph's own
    new["logits"] = sliced
    return new
