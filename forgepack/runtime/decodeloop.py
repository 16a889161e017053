"""Decode loop: a plain greedy `generate()` request decoded by replaying one captured graph per step.

Part of the pack runtime: torch, the standard library and its sibling files (`graphbackends` for the
capture, `graphkeys` and `transformers_hooks` for what graph mode already knows about transformers);
transformers itself only lazily, for the output class of `return_dict_in_generate`.

Why: served through `serving.Server` alone, `generate()` still runs transformers' own loop around each
replayed forward (inputs prepared, logits processors, stopping criteria, cache bookkeeping, a host
sync per step), and on the H200 that loop, not the GPU, set the pace: 6.8 ms of wall time per decode
step of which 2.6 ms on the GPU (Llama-1B shape, bf16, `tools/bench_serve.py`). For the requests that
dominate serving this module owns the whole decode:

1. `plain` decides from the call's arguments and generation config whether a request is plain:
   greedy, one beam, one sequence, no streamer, no logits processor or stopping criterion of the
   caller's, every other logits-processor field at its neutral value, no attention mask or one of all
   ones. Anything else (or in doubt) is served as before, and `stats()["fallbacks"]` counts why.
2. The prompt goes through the server's bucketed prefill (`Server._forward`: prompt padded to a rung,
   batch padded to its bucket, the logits at the last real position, the cache rewound).
3. One decode step is one graph per (batch bucket, cache length, grad mode, context): the forward on
   the server's `StaticCache`, the fp32 logits, the min-new-tokens processor as a device-side mask on
   the eos scores, the greedy pick, transformers' finished/pad bookkeeping
   (`next = next * unfinished + pad * (1 - unfinished)`, rows finish on eos), the token written into a
   preallocated [rows, length] buffer, and the device-side positions and step counter advanced. The host
   loop only replays it (the first `warmup` steps of a graph run the same step eagerly, then it is
   captured); with `output_logits`/`output_scores` it also keeps a device copy of each step's logits or
   scores, with no host sync.
4. Every `check_every` steps one host sync reads whether every row has finished (early stop); the
   output is cut exactly where transformers' loop stops: after the step at which every real row has
   finished, or after `max_new_tokens`. Batch padding rows start finished, emit the pad token, and
   are sliced away; they never reach the output.

The result is `generate()`'s: the same `sequences` (shape and values) and, with
`return_dict_in_generate`, the same fields (the server's cache is never handed out: `cache` is None, as
on the server's other path).
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from . import stepprogram
from .graphbackends import Captured, CudaBackend, make_backend
from .graphkeys import first_line, tensor_bytes
from .transformers_hooks import decode_kwargs_of, mask_once

DEFAULT_CHECK_EVERY = 16  # decode steps between the host syncs that look for an early stop

# Generation-config fields the loop implements.
_DECIDED = frozenset({"max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "num_beams",
                      "num_return_sequences", "eos_token_id", "pad_token_id", "use_cache", "output_logits",
                      "output_scores", "return_dict_in_generate"})
# Fields that cannot change a greedy request: warpers apply only when sampling, beam fields only to beams
# (refused), the cache and compile fields are the server's (its own static cache, compile off).
_NO_EFFECT = frozenset({"temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                        "top_h", "length_penalty", "early_stopping", "bos_token_id", "decoder_start_token_id",
                        "cache_implementation", "cache_config", "max_cache_len", "compile_config",
                        "disable_compile", "transformers_version", "_from_model_config", "_commit_hash",
                        "_original_object_hash"})
# Values at which a logits-processor field adds no processor (besides None, False and its default).
_NEUTRAL = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
            "encoder_no_repeat_ngram_size": 0, "guidance_scale": 1.0, "diversity_penalty": 0.0,
            "num_beam_groups": 1}
# generate() arguments the loop accepts besides generation-config fields; `_EMPTY` only when empty.
_ARGUMENTS = frozenset({"input_ids", "attention_mask"})
_EMPTY = frozenset({"logits_processor", "stopping_criteria", "streamer", "synced_gpus"})


@dataclass(frozen=True)
class Greedy:
    """What a plain greedy request asks of the loop."""

    new: int  # tokens to generate at most (max_new_tokens, or max_length less the prompt)
    min_new: int  # eos is blocked while fewer tokens were generated (min_new_tokens, min_length)
    eos: tuple[int, ...]  # rows finish on these; none: rows never finish early
    pad: int  # what a finished row emits (the first eos when no pad token is set)
    logits: bool  # return_dict_in_generate with output_logits
    scores: bool  # return_dict_in_generate with output_scores
    as_dict: bool  # return_dict_in_generate


_DEFAULTS: dict[type, dict[str, Any]] = {}


def _defaults(config: Any) -> dict[str, Any]:
    kind = type(config)
    if kind not in _DEFAULTS:
        _DEFAULTS[kind] = kind().to_dict()
    return _DEFAULTS[kind]


def _neutral(name: str, value: Any, default: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return False
    return value is None or value is False or value == default or value == _NEUTRAL.get(name, object())


def _token_ids(value: Any) -> tuple[int, ...] | None:
    """A token id or list of them as a tuple (None when it is neither)."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    return None


def plain(model: Any, ids: torch.Tensor, kwargs: dict) -> tuple[Greedy | None, str]:
    """Whether `model.generate(ids, **kwargs)` is a plain greedy request the loop decodes exactly as
    transformers would: its `Greedy`, or (None, why not). Conservative: anything it does not know refuses."""
    for name, value in kwargs.items():
        if name in _EMPTY and value:
            return None, f"a {name} argument"
    config = model.generation_config
    if kwargs.get("generation_config") is not None:
        return None, "a generation_config argument"
    defaults = _defaults(config)
    given = config.to_dict()
    extra = sorted(k for k in kwargs if k not in defaults and k not in _ARGUMENTS and k not in _EMPTY
                   and k != "generation_config")
    if extra:
        return None, f"the argument {extra[0]}"

    def value(name: str) -> Any:
        return kwargs[name] if name in kwargs else given.get(name, defaults.get(name))

    for name in sorted(set(given) | {k for k in kwargs if k in defaults}):
        if name not in _DECIDED and name not in _NO_EFFECT and not _neutral(name, value(name), defaults.get(name)):
            return None, f"generation config sets {name}"
    if value("do_sample"):
        return None, "sampling"
    if int(value("num_beams") or 1) != 1:
        return None, "beam search"
    if int(value("num_return_sequences") or 1) != 1:
        return None, "num_return_sequences > 1"
    if value("use_cache") is False:
        return None, "use_cache=False"
    prompt = ids.shape[1]
    new = value("max_new_tokens")
    if new is None:
        total = value("max_length")
        new = int(total if total is not None else 20) - prompt  # 20: transformers' max_length when none is set
    if int(new) < 1:
        return None, "no new tokens to generate"
    eos, pad = _token_ids(value("eos_token_id")), _token_ids(value("pad_token_id"))
    if eos is None or pad is None or len(pad) > 1:
        return None, "eos_token_id or pad_token_id is not a token id"
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    pad_id = pad[0] if pad else (eos[0] if eos else 0)  # transformers pads with the first eos
    if vocab and not 0 <= pad_id < vocab:
        return None, "pad_token_id is outside the vocabulary"
    mask = kwargs.get("attention_mask")
    if mask is None:
        if pad and bool((ids == pad_id).any()):  # transformers would infer a padding mask from it
            return None, "no attention_mask and the prompt holds the pad token"
    elif not isinstance(mask, torch.Tensor) or mask.shape != ids.shape or not bool(mask.all()):
        return None, "a padding attention_mask"
    min_new = int(value("min_new_tokens") or 0)
    min_new = max(min_new, int(value("min_length") or 0) - prompt)
    as_dict = bool(value("return_dict_in_generate"))
    return Greedy(int(new), max(min_new, 0), eos, pad_id, as_dict and bool(value("output_logits")),
                  as_dict and bool(value("output_scores")), as_dict), ""


# ----------------------------------------------------------------------------------------------------
# The step on the device


class State:
    """The static buffers one decode graph reads and writes (addresses fixed for the graph's life)."""

    def __init__(self, rows: int, vocab: int, width: int, device: torch.device):
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.rows, self.vocab, self.width = rows, vocab, width
        # Each row's position, the cache slot and the step counter advance together: one buffer, one add at
        # the start of each pick; they start one behind, since the pick after the prefill advances them too.
        self.counters = zeros(rows + 2)
        self.position, self.where = self.counters[:rows].view(rows, 1), self.counters[rows:rows + 1]
        self.count = self.counters[rows + 1]
        self.token, self.pad = zeros(rows, 1), zeros()
        # per token id, the step count eos stays blocked below (MinNewTokens: min_new at each eos id, -1
        # elsewhere): blocked = eos_until > count, one compare a step
        self.eos_until, self.not_eos = zeros(vocab, dtype=torch.int32), zeros(vocab, dtype=torch.bool)
        self.unfinished, self.alive = zeros(rows, dtype=torch.bool), zeros(width, dtype=torch.bool)
        self.tokens = zeros(rows, width)
        self.logits, self.scores = zeros(rows, vocab, dtype=torch.float32), zeros(rows, vocab, dtype=torch.float32)
        self.lowest = torch.full((), float("-inf"), device=device)
        self.slots, self.mask = torch.arange(width, device=device), zeros(rows, width, dtype=torch.bool)
        self.additive: torch.Tensor | None = None  # the mask as eager attention adds it (`additive_mask`)

    def additive_mask(self, dtype: torch.dtype) -> None:
        """Give the forward an additive mask of `dtype` (0 where a slot is attended, the dtype's lowest
        value elsewhere), as transformers builds one for eager attention, which adds its mask to the
        scores: a boolean mask there would add 1 to the attended slots and mask nothing."""
        device = self.mask.device
        self.additive = torch.zeros(self.rows, self.width, dtype=dtype, device=device)
        self.attended = torch.zeros((), dtype=dtype, device=device)
        self.masked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)

    def start(self, batch: int, prompt: int, greedy: Greedy) -> None:
        """A request's values (host-issued fills, no sync): real rows unfinished, padding rows finished."""
        self.position.fill_(prompt - 1)
        self.where.fill_(prompt - 1)
        self.count.fill_(-1)
        self.pad.fill_(greedy.pad)
        self.eos_until.fill_(-1)
        ids = [e for e in greedy.eos if 0 <= e < self.vocab]  # an id past the vocabulary is never picked
        if ids:
            self.eos_until[torch.tensor(ids, device=self.eos_until.device)] = greedy.min_new
        torch.lt(self.eos_until, 0, out=self.not_eos)
        self.unfinished.fill_(True)
        self.unfinished[batch:] = False

    @torch.no_grad()  # (out= variants refuse inputs that require grad; a pick is never differentiated)
    def pick(self, logits: torch.Tensor) -> None:
        """transformers' greedy step on the device, from the logits of the last position [rows, vocab],
        in few launches (each is a node of the decode graph): 11."""
        self.counters.add_(1)
        self.logits.copy_(logits)  # generate's own fp32 copy
        blocked = self.eos_until > self.count  # MinNewTokens/MinLength: eos scores to -inf
        torch.where(blocked, self.lowest, self.logits, out=self.scores)
        # the next step's input, written in place (the decode graph reads it there)
        torch.where(self.unfinished.view(-1, 1), self.scores.argmax(-1, keepdim=True), self.pad, out=self.token)
        where = self.count.view(1)
        self.tokens.index_copy_(1, where, self.token)
        self.unfinished.logical_and_(self.not_eos.index_select(0, self.token.view(-1)))
        self.alive.index_copy_(0, where, self.unfinished.any().view(1))

    def generated(self, steps: int) -> int:
        """How many tokens transformers' loop would have produced, of the `steps` run (one host sync)."""
        alive = self.alive[:steps].tolist()
        return alive.index(0) + 1 if 0 in alive else steps

    def nbytes(self) -> int:
        return tensor_bytes(t for t in vars(self).values() if isinstance(t, torch.Tensor) and t._base is None)


def additive_mask_dtype(model: Any) -> torch.dtype | None:
    """None when the model's attention takes a boolean mask as given (SDPA, flash, flex); else the dtype of
    the additive mask its eager attention adds to the scores (the model's)."""
    impl = str(getattr(model.config, "_attn_implementation", None) or "eager")
    if impl == "sdpa" or "flash" in impl or "flex" in impl:
        return None
    return next(model.parameters()).dtype


def step_kwargs(forward: Any, state: State, cache: Any) -> dict[str, Any]:
    """The forward's arguments for one decode step on `cache`, all read from `state`'s buffers."""
    kwargs = decode_kwargs_of(forward, state.token, cache, 0)
    kwargs["position_ids"] = state.position
    # The 4D mask generate builds for a static cache (every slot up to the position), made inside the
    # graph: transformers uses a 4D mask as given, so no mask code of its own runs under capture.
    mask = state.mask if state.additive is None else state.additive
    kwargs["attention_mask"] = mask.view(state.rows, 1, 1, state.width)
    if "cache_position" in kwargs:
        kwargs["cache_position"] = state.where
    return kwargs


def run_step(forward: Any, state: State, kwargs: dict[str, Any]) -> None:
    """One decode step: the mask, the forward, the greedy pick, the positions advanced (what a decode
    graph holds; the build records the same step to find its blocks)."""
    torch.le(state.slots, state.position, out=state.mask)
    if state.additive is not None:
        torch.where(state.mask, state.attended, state.masked, out=state.additive)
    out = forward(**kwargs)
    state.pick(out.logits[:, -1])  # which also advances the positions


def state_bytes(rows: int, vocab: int, width: int) -> int:
    """The bytes of a decode graph's buffers, before allocating them (measured on the meta device)."""
    return State(rows, vocab, width, torch.device("meta")).nbytes()


@dataclass
class _Loop:
    """One decode graph: its buffers, the forward's arguments, and the graph once captured."""

    state: State
    cache: Any
    kwargs: dict
    bucket: str
    key: tuple  # its key in the pool
    counts: collections.Counter = field(default_factory=collections.Counter)  # the bucket's, kept across loops
    graph: Captured | None = None
    warm: int = 0
    failed: str = ""  # why its steps run eagerly: "capture failed", "over max_bytes"
    program: stepprogram.Program | None = None  # the recorded step with blocks in place (an active pack's)


class DecodeLoop:
    """The decode loop of one `serving.Server` (`server.loop`): `generate(request, ids, kwargs)` decodes a
    plain request or returns None (the server's other path serves it)."""

    def __init__(self, server: Any, check_every: int = DEFAULT_CHECK_EVERY):
        self.server = server
        self.check_every = check_every
        graphed = server.graphed
        self.warmup = graphed.warmup
        self.backend = make_backend(graphed.options["backend"], graphed.options["pool"])
        self.context_key = graphed.context_key
        # transformers 5.17 takes `cache_position` (and reads the cache length back to the host without it)
        probe = decode_kwargs_of(server.eager, torch.zeros(1, 1, dtype=torch.long), None, 0)
        self.positions = "cache_position" in probe
        self.keeps = "logits_to_keep" in inspect.signature(server.eager).parameters
        # The loops live in the server's pool (the graph ledger bounded by max_bytes): a loop needs its
        # cache, so evicting the cache evicts the loop; counts and failures outlive an evicted loop.
        self.pool = server.pool
        self._counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._failures: dict[str, str] = {}
        self._requests = 0
        self._fallbacks: collections.Counter = collections.Counter()
        self._programs: dict[str, dict[str, int]] = {}  # per bucket: launches of its step, stock and with blocks

    # -- a request ---------------------------------------------------------------------------------------

    def generate(self, request: Any, ids: torch.Tensor, kwargs: dict) -> Any:
        greedy, why = self._admit(request, ids, kwargs)
        if greedy is None:
            self._fallbacks[why] += 1
            return None
        self._requests += 1
        with self.server._lock, torch.no_grad():
            return self._decode(request, ids, greedy)

    def _admit(self, request: Any, ids: torch.Tensor, kwargs: dict) -> tuple[Greedy | None, str]:
        model = self.server.model
        if not request.own:
            return None, "the caller's cache"
        if not request.pad_prompt:
            return None, "cache layers other than full-attention static ones"
        if model.training:
            return None, "the model is in training mode"
        if ids.dtype != torch.long:
            return None, "input_ids are not int64"
        device = next(model.parameters()).device
        if ids.device != device:
            return None, f"input_ids on {ids.device}, the model on {device}"
        if self.backend.needs_cuda and device.type != "cuda":
            return None, f"the model is on {device.type} (graphs need CUDA)"
        greedy, why = plain(model, ids, kwargs)
        if greedy is not None and self.pool.get(self._key(request)) is None:
            vocab = int(getattr(model.config, "vocab_size", 0) or 0)
            nbytes = state_bytes(request.rows, vocab, request.cache_len)
            if not self.pool.fits(nbytes):
                return None, f"its decode buffers need {nbytes} bytes, over max_bytes={self.pool.max_bytes}"
        return greedy, why

    def _decode(self, request: Any, ids: torch.Tensor, greedy: Greedy) -> Any:
        batch, prompt = ids.shape
        last = self._prefill(request, ids)
        loop = self._loop(request, last.shape[-1], ids.device)
        state = loop.state
        state.start(batch, prompt, greedy)
        state.pick(torch.cat([last, last[:1].expand(request.rows - batch, -1)]) if request.rows > batch else last)
        logits = [state.logits[:batch].clone()] if greedy.logits else None
        scores = [state.scores[:batch].clone()] if greedy.scores else None
        steps = 1
        with self._pool(ids.device):
            while steps < greedy.new:
                self._step(loop, ids.device)
                if logits is not None:
                    logits.append(state.logits[:batch].clone())
                if scores is not None:
                    scores.append(state.scores[:batch].clone())
                steps += 1
                if steps % self.check_every == 0 and steps < greedy.new and not bool(state.alive[steps - 1]):
                    break
        loop.counts["steps"] += steps - 1
        n = state.generated(steps)
        sequences = torch.cat([ids, state.tokens[:batch, :n]], dim=1)
        if not greedy.as_dict:
            return sequences
        return _output(sequences, None if scores is None else tuple(scores[:n]),
                       None if logits is None else tuple(logits[:n]))

    def _prefill(self, request: Any, ids: torch.Tensor) -> torch.Tensor:
        """The server's bucketed prefill; the fp32-castable logits of the last real position [batch, vocab]."""
        batch, prompt = ids.shape
        positions = torch.arange(prompt, device=ids.device)
        causal = torch.arange(request.cache_len, device=ids.device) <= positions.unsqueeze(1)  # [prompt, slots]
        mask = causal[None, None].repeat(batch, 1, 1, 1)  # as generate's for a static cache
        dtype = additive_mask_dtype(self.server.model)
        if dtype is not None:  # an eager attention adds its mask to the scores (`State.additive_mask`)
            mask = torch.zeros(mask.shape, dtype=dtype, device=ids.device).masked_fill_(~mask, torch.finfo(dtype).min)
        call = {"input_ids": ids, "position_ids": positions.unsqueeze(0).repeat(batch, 1),
                "attention_mask": mask, self.server.cache_key: request.cache, "use_cache": True}
        if self.positions:
            call["cache_position"] = positions
        if self.keeps:
            call["logits_to_keep"] = 1
        return self.server._forward(request, call).logits[:, -1]

    def _key(self, request: Any) -> tuple:
        autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cuda", "cpu"))
        extra = self.context_key() if self.context_key is not None else None
        return ("decode loop", request.rows, request.cache_len, torch.is_inference_mode_enabled(), autocast, extra)

    def _loop(self, request: Any, vocab: int, device: torch.device) -> _Loop:
        key = self._key(request)
        loop = self.pool.get(key)
        if loop is None or loop.cache is not request.cache or loop.state.vocab != vocab:
            state = State(request.rows, vocab, request.cache_len, device)
            dtype = additive_mask_dtype(self.server.model)
            if dtype is not None:
                state.additive_mask(dtype)
            kwargs = step_kwargs(self.server.eager, state, request.cache)
            bucket = f"decode b{request.rows} c{request.cache_len}"
            loop = _Loop(state, request.cache, kwargs, bucket, key, self._counts[bucket])
            if not self._hold(loop):  # _admit checked it at the config's vocabulary: the logits' is larger
                self._give_up(loop, "over max_bytes", f"decode buffers of {state.nbytes()} bytes, over "
                              f"max_bytes={self.pool.max_bytes} (kept for this request only)")
        return loop

    def _hold(self, loop: _Loop) -> bool:
        """Count the loop in the pool (its buffers, its graph once captured); False when it does not fit."""
        nbytes = loop.state.nbytes() + (loop.graph.nbytes if loop.graph is not None else 0)
        if not self.pool.fits(nbytes, loop.key):
            return False
        self.pool.put(loop.key, loop, nbytes, "loop", self.pool.keys_holding((loop.cache,)))
        return True

    # -- one decode step ---------------------------------------------------------------------------------

    def _run(self, loop: _Loop) -> None:
        """The decode step itself: what the graph holds, and what an eager step runs."""
        run_step(self.server.eager, loop.state, loop.kwargs)

    def _step(self, loop: _Loop, device: torch.device) -> None:
        if loop.graph is not None:
            loop.graph.replay()
            loop.counts["replays"] += 1
            return
        if loop.failed or loop.warm < self.warmup:
            loop.warm += 1
            loop.counts[f"eager: {loop.failed or 'warm-up'}"] += 1
            self._run(loop)
            return
        try:
            captured = self._capture(loop, device)
        except Exception as err:  # the step still runs, eagerly, from now on
            self._give_up(loop, "capture failed", f"capture failed: {first_line(err)}")
            warnings.warn(f"forgepack decode loop: running eagerly for {loop.bucket}: {self._failures[loop.bucket]}",
                          RuntimeWarning, stacklevel=2)
            self._run(loop)
            return
        loop.graph = captured
        if not self._hold(loop):  # graph and buffers beside the cache: over the bound
            loop.graph = None
            nbytes = loop.state.nbytes() + captured.nbytes
            self._give_up(loop, "over max_bytes", f"graph and buffers hold {nbytes} bytes beside "
                          f"{self.pool.pinned_bytes()} bytes in use, over max_bytes={self.pool.max_bytes}")
            self._run(loop)  # a capture executes nothing (the emulation undoes its writes)
            return
        # a capture executes nothing (the emulation undoes its writes): replay it now
        loop.counts["captures"] += 1
        loop.graph.replay()
        loop.counts["replays"] += 1

    def _capture(self, loop: _Loop, device: torch.device) -> Captured:
        """The step's graph. With an active pack's decode blocks: the step recorded as a program, each
        verified chain found in it replaced by its block's kernel (`stepprogram.rewrite`), and the graph
        captured from that; the masks then stay boolean for each attention to read (`mask_once` would
        convert them once, before the layers, where no block sees it)."""
        offered = stepprogram.kernels()
        if not offered:
            with mask_once():
                return self.backend.capture(self._run, (loop,), {}, device)
        program, rewritten, placed, sites = self._blocks_in_place(loop, offered)
        self._programs[loop.bucket] = {"launches": program.launches(), "with_blocks": rewritten.launches(),
                                       "blocks": len(placed), "module_sites": sites}
        loop.program = rewritten
        if not isinstance(self.backend, CudaBackend):
            # The emulation records aten calls, and a pack's kernel runs inside its op's C++ body, which a
            # dispatch mode never sees: the program itself is the replay (it calls the kernels each time).
            return Captured(rewritten.run, None, 0, rewritten)
        return self.backend.capture(rewritten.run, (), {}, device)

    def _blocks_in_place(self, loop: _Loop, offered: list) -> tuple[stepprogram.Program, stepprogram.Program,
                                                                      list, str]:
        """The step recorded and rewritten with the blocks (`_capture`): with the pack's fused module sites
        on, and, where a site was installed, with them off (a site inside a block, such as a fused norm or
        activation, replaces calls of the block's chain, which then no longer matches). When the sites cut
        blocks, each site's target is then switched back on alone and kept on where every block still
        places (a site outside the blocks, such as the rotary tables, still saves its launches). Most blocks
        win; a tie keeps more sites on."""
        def recorded(sites: str) -> tuple:
            program = stepprogram.record(run_step, self.server.eager, loop.state, loop.kwargs)
            return (program, *stepprogram.rewrite(program, offered), sites)

        on = recorded("on")
        with stepprogram.stock_sites() as switched:
            if not switched:  # no site to switch off: the same recording again
                return on
            best = recorded("off")
        if len(on[2]) >= len(best[2]):
            return on
        kept: frozenset[str] = frozenset()
        for target in stepprogram.site_targets():
            with stepprogram.stock_sites(kept | {target}):
                trial = recorded("on: " + ", ".join(sorted(kept | {target})))
            if len(trial[2]) >= len(best[2]):
                kept, best = kept | {target}, trial
        return best

    @contextlib.contextmanager
    def _pool(self, device: torch.device):
        """CUDA: the graph pool's lock for the whole loop (graphs sharing a pool share its intermediate
        memory), ordered after the pool's previous stream."""
        if not isinstance(self.backend, CudaBackend):
            yield
            return
        pool = self.backend.pool_for(device)
        with pool.lock:
            pool.enter()
            yield

    # -- introspection -----------------------------------------------------------------------------------

    def _give_up(self, loop: _Loop, reason: str, detail: str) -> None:
        """The loop's steps run eagerly from now on (counted under `reason`; `detail` in failures)."""
        loop.failed = reason
        loop.counts[f"eager: {reason}"] += 1
        self._failures[loop.bucket] = detail

    def stats(self) -> dict[str, Any]:
        """Requests decoded by the loop, requests left to the other path by why, per bucket its steps,
        replays, captures and eager steps by reason, and the graphs and bytes (buffers included) held."""
        loops = self.pool.entries("loop")
        graphs = [loop.graph for loop in loops if loop.graph is not None]
        return {"requests": self._requests, "fallbacks": dict(self._fallbacks),
                "buckets": {k: dict(v) for k, v in sorted(self._counts.items())},
                "graphs": len(graphs), "graph_bytes": sum(g.nbytes for g in graphs),
                "bytes": self.pool.bytes_of("loop"), "evictions": self.pool.evictions["loop"],
                "failures": dict(self._failures), "programs": {k: dict(v) for k, v in self._programs.items()}}

    def step_programs(self) -> dict[str, stepprogram.Program]:
        """Per bucket, the last recorded step with the pack's blocks in place (each `Kernel` keeps the
        calls it replaced, and its hits and misses): what `forgepack.stepcoverage` weighs."""
        return {loop.bucket: loop.program for loop in self.pool.entries("loop") if loop.program is not None}

    def clear(self) -> None:
        """Drop every graph and buffer (the server's caches are going)."""
        self.pool.clear("loop")


def _output(sequences: torch.Tensor, scores: tuple | None, logits: tuple | None) -> Any:
    """generate()'s dict output for a decoder-only model, with the server's cache withheld."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    out = GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits)
    name = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
    out[name] = None  # as the server's other path leaves it: the key present, the cache kept
    return out
