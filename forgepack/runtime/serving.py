"""Serving: graph mode inside `model.generate()` for causal LMs, with bucketed shapes.

Shipped inside every pack wheel: imports only torch, the standard library, `graphs` and `decodeloop`
(transformers is imported lazily, only for a model that has `generate`).

    server = serving.serve(model)            # or pack.activate(graphs=True, model=model)
    model.generate(ids, max_new_tokens=64)   # decode replays one graph per batch bucket
    serving.warmup(model, batch_sizes=(1, 4), prompt_lengths=(100, 900), max_new_tokens=(64,))
    server.stats()                           # replays per bucket, why any call ran eagerly

Why: graph mode keys a graph by the forward's argument shapes and by the addresses of the state it is
handed. Inside `generate()` with its default `DynamicCache` every decode step is a new signature (the
cache grows by rebinding), so nothing ever replays; with transformers' static cache a new cache object
is built per call, and transformers compiles the forward itself.

How a request is served (`Server.generate`):
1. When the caller passes no cache (or `cache_implementation="static"`), forgepack supplies its own
   `StaticCache`, one per (batch bucket, cache length): the batch rounds up to a bucket (1, 2, 4, 8),
   the cache length to the smallest rung of a ladder holding the padded prompt and the new tokens.
   The cache is `reset()` between requests, in place, so its addresses, and so the graphs captured
   with it, stay valid. A caller's own `StaticCache` is used as given (its rows are the batch).
2. transformers' automatic compile is turned off for the served call (`disable_compile=True`): graph
   mode replays the forward; the two would fight ("torch.compile is tracing").
3. `generate` runs as written (its logits processors, sampling, stopping, streamers); only the forward
   it calls is bucketed. The batch is padded to the bucket with copies of row 0 (finite values, rows of
   their own in the cache) and outputs are sliced back: `generate` never sees a dummy row.
4. The prefill is right-padded to a rung of a geometric ladder of lengths. Attention is causal, so a
   real position never sees a padded one; the logits are taken at the last real position (an index
   tensor for `logits_to_keep`, a value copied into the graph's buffer, so one graph serves every
   length of the bucket). The padded positions wrote the cache slots after the prompt: the cache's
   device-side length is moved back to the real length, so decode writes there next and the causal
   decode mask hides every slot at or after the current position.
5. Every decode step then has one shape per (bucket, cache length) and the same cache object: after
   the graph warm-up each step is one replay.
6. A plain greedy request (`decodeloop.plain`) skips generate's own loop: `decodeloop.DecodeLoop`
   prefills through step 4 and replays one graph per whole decode step, greedy pick and stopping
   included (`ServeOptions.decode_loop=False` serves every request through generate as above).

Memory: `max_bytes` bounds everything the server holds, in one ledger (the graphed forward's
`graphcache.GraphCache`): its graphs, the KV caches it allocates (counted from the model's config before
their first prefill allocates them, as measured after) and the decode loop's graphs and buffers. A new
cache evicts the least recently used ones, each with the graphs and loop captured on it (they hold its
addresses); the cache of a request in flight is pinned. A bucket whose cache cannot fit at all serves
its request eagerly, and a graph that cannot fit beside its cache runs eagerly, both with the reason in
`stats()`. A caller's own cache is the caller's memory, not counted; nor are the transient activations.

Requests it does not serve run `generate` eagerly and say why in `stats()["eager_requests"]`: beam
search, assisted generation, `inputs_embeds`, attention/hidden-state outputs, encoder-decoders, a
caller's cache that is not a `StaticCache`, a batch over the largest bucket, a request longer than the
largest cache, a bucket whose cache is over `max_bytes`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from . import decodeloop, graphs
from .servereq import (  # noqa: F401  (re-exported: tests and callers use serving.<name>)
    _NOT_SERVED,
    _PADDABLE,
    _cache_key,
    _keeps_all,
    _max_len,
    _new_tokens,
    _pad_prompt,
    _pad_rows,
    _pads_cleanly,
    _plain_static,
    _rewind,
    _setting,
    _slice_output,
    _unservable,
    _without_cache,
    cache_bytes,
    expected_cache_bytes,
    static_cache,
)

_LOG = logging.getLogger(__name__)

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8)
DEFAULT_MAX_CACHE_LEN = 4096
DEFAULT_MAX_GRAPHS = 128  # (batch buckets x prompt rungs) prefill graphs + (batch x cache) decode graphs


def ladder(low: int, high: int, ratio: float = 1.5, multiple: int = 16) -> tuple[int, ...]:
    """A geometric ladder of lengths from `low` to at least `high`, each a multiple of `multiple`:
    padding a prompt to the next rung wastes at most `ratio - 1` of its length (16, 32, 48, 64, 96,
    128, 192, 256, ... for the defaults)."""
    rungs, n = [], max(multiple, low)
    while True:
        rungs.append(n)
        if n >= high:
            return tuple(rungs)
        n = max(n + multiple, round(n * ratio / multiple) * multiple)


DEFAULT_PROMPT_BUCKETS = ladder(16, 4096)
DEFAULT_CACHE_LENGTHS = ladder(256, 1 << 17, ratio=2.0, multiple=256)  # cut at max_cache_len


@dataclass(frozen=True)
class ServeOptions:
    """How requests are bucketed. Graph options (`max_bytes`, `warmup`, `pool`, `backend`,
    `context_key`, `copy_outputs`) go to the model's `GraphedForward`."""

    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    prompt_buckets: tuple[int, ...] = DEFAULT_PROMPT_BUCKETS
    cache_lengths: tuple[int, ...] = DEFAULT_CACHE_LENGTHS
    max_cache_len: int = DEFAULT_MAX_CACHE_LEN
    disable_compile: bool = True
    decode_loop: bool = True  # plain greedy requests decoded by decodeloop.DecodeLoop

    def __post_init__(self):
        for name in ("batch_buckets", "prompt_buckets", "cache_lengths"):
            values = tuple(sorted(int(v) for v in getattr(self, name)))
            if not values or values[0] < 1:
                raise ValueError(f"{name} must be positive lengths, got {getattr(self, name)!r}")
            object.__setattr__(self, name, values)
        if self.max_cache_len < 1:
            raise ValueError(f"max_cache_len must be at least 1, got {self.max_cache_len}")

    def batch_bucket(self, batch: int) -> int | None:
        return next((b for b in self.batch_buckets if b >= batch), None)

    def prompt_bucket(self, length: int) -> int:
        """The rung a prompt is padded to (the length itself above the last rung)."""
        return next((p for p in self.prompt_buckets if p >= length), length)

    def cache_length(self, needed: int, cap: int) -> int | None:
        """The smallest cache length on the ladder holding `needed` tokens, at most `cap`."""
        limit = min(self.max_cache_len, cap)
        rung = next((c for c in self.cache_lengths if c >= needed), None)
        if rung is not None and rung <= limit:
            return rung
        return limit if needed <= limit else None


SERVE_OPTIONS = frozenset(f for f in ServeOptions.__dataclass_fields__)  # the rest are graph options


@dataclass
class _Request:
    batch: int  # rows generate sees
    rows: int  # rows the forward runs (the bucket)
    cache: Any
    own: bool  # forgepack's cache (reset, sized by us, counted in max_bytes) or the caller's
    pad_prompt: bool
    cache_len: int
    calls: int = 0
    mode: bool = False  # inference mode when planned (forgepack's caches are per mode)


class _Bucketed:
    """The forward `generate` calls while a request is served: pads to the bucket, calls the graphed
    forward, slices back. Outside a served request (another thread) it is the graphed forward."""

    def __init__(self, server: Server):
        self.server = server
        functools.update_wrapper(self, server.eager, updated=())  # transformers reads the forward's parameters

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = getattr(self.server._local, "request", None)
        if request is None or args:
            return self.server.graphed(*args, **kwargs)
        return self.server._forward(request, kwargs)


class _ServedGenerate:
    """`model.generate` while served. A deep copy of the model gets its class's own `generate` back
    (a plain function would be shared by the copy, and serve the original model)."""

    def __init__(self, server: Server):
        self.server = server
        functools.update_wrapper(self, server._original, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.server.generate(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        twin = memo.get(id(self.server.model))
        if twin is None:
            return self
        return type(twin).generate.__get__(twin)


class Server:
    """Graph mode inside one model's `generate()`. Use `serve(model)` to install one."""

    def __init__(self, model: Any, options: ServeOptions, graph_options: dict[str, Any]):
        self.model = model
        self.options = options
        graph_options = {"max_graphs": DEFAULT_MAX_GRAPHS, **graph_options}
        self.graphed = graphs.graphed(model) or graphs.enable(model, **graph_options)
        if self.graphed is None:  # FORGEPACK_DISABLE=1
            raise RuntimeError("graph mode is disabled (FORGEPACK_DISABLE)")
        self.eager = graphs.eager_forward(model)
        self.cache_key = graphs.cache_kwarg(model)
        # One ledger for the budget: the graphed forward's graph cache also holds the KV caches this server
        # allocates and the decode loop's graphs and buffers, all bounded together by `max_bytes`.
        self.pool = self.graphed._cache
        self._sizes: dict[tuple, int] = {}  # a cache's bytes as measured once its layers were allocated
        self._lock = threading.RLock()
        self._local = threading.local()
        self._requests: collections.Counter = collections.Counter()
        self._eager_requests: collections.Counter = collections.Counter()
        self._buckets: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.loop = decodeloop.DecodeLoop(self)
        had = "generate" in vars(model)
        self._restore = (had, vars(model).get("generate"))
        own = vars(model)["generate"] if had else type(model).generate.__get__(model)
        base = getattr(getattr(own, "__func__", None), _CLASS_MARK, None)  # a served class's patch: unwrap it
        self._original = base.__get__(model) if base is not None else own
        vars(model)["generate"] = _ServedGenerate(self)
        _SERVERS[model] = self
        if options.disable_compile:
            _LOG.info("%s", compile_off_message(model))

    # -- a request ---------------------------------------------------------------------------------------

    def generate(self, inputs: Any = None, *args: Any, **kwargs: Any) -> Any:
        """`model.generate`, served through bucketed graphs where the request allows it."""
        return self._serve(inputs, args, kwargs, None)

    def _serve(self, inputs: Any, args: tuple, kwargs: dict, cache_len: int | None) -> Any:
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        plan, why = self._plan(ids, args, kwargs, cache_len)
        if plan is None:
            self._eager_requests[why] += 1
            return self._run(None, inputs, args, kwargs)
        self._requests["served"] += 1
        key = _cache_key(plan.rows, plan.cache_len, plan.mode) if plan.own else None
        if key is not None:
            self.pool.pin(key)  # in use: never evicted by this request's own graphs
        try:
            fast = self.loop.generate(plan, ids, kwargs) if self.options.decode_loop else None
            return fast if fast is not None else self._run(plan, inputs, args, kwargs)
        finally:
            if key is not None:
                self.pool.unpin(key)
                self._measured(key, plan.cache)

    def _run(self, request: _Request | None, inputs: Any, args: tuple, kwargs: dict) -> Any:
        kwargs = dict(kwargs)
        if request is not None:
            if request.own:  # in place of what a generation config may ask for (transformers refuses both)
                kwargs["cache_implementation"] = None
                kwargs.pop("past_key_values", None)
                kwargs[self.cache_key] = request.cache
            if self.options.disable_compile:
                kwargs["disable_compile"] = True
        with self._lock:
            previous = vars(self.model).get("forward")
            vars(self.model)["forward"] = _Bucketed(self) if request is not None else self.eager
            self._local.request = request
            try:
                out = self._original(inputs, *args, **kwargs)
            finally:
                self._local.request = None
                if previous is None:
                    vars(self.model).pop("forward", None)
                else:
                    vars(self.model)["forward"] = previous
        if request is not None and request.own:
            out = _without_cache(out, request.cache)
        return out

    def _plan(self, ids: Any, args: tuple, kwargs: dict, cache_len: int | None) -> tuple[_Request | None, str]:
        """The request's buckets and cache, or (None, why it runs eagerly)."""
        why = _unservable(self.model, ids, args, kwargs)
        if why:
            return None, why
        config = self.model.generation_config
        given = kwargs.get("generation_config") or config
        rows = ids.shape[0] * max(1, int(_setting(kwargs, given, "num_return_sequences") or 1))
        new = _new_tokens(kwargs, given, ids.shape[1])
        if new is None:
            return None, "no max_new_tokens or max_length"
        cache = kwargs.get(self.cache_key, kwargs.get("past_key_values"))
        if cache is not None:
            if type(cache).__name__ != "StaticCache":
                return None, f"the caller's {type(cache).__name__} is not replayable (pass a StaticCache or none)"
            return _Request(rows, rows, cache, False, _plain_static(cache), _max_len(cache)), ""
        implementation = _setting(kwargs, given, "cache_implementation")
        if implementation not in (None, "static"):
            return None, f"cache_implementation={implementation!r}"
        bucket = self.options.batch_bucket(rows)
        if bucket is None:
            return None, f"batch {rows} is over the largest bucket ({self.options.batch_buckets[-1]})"
        prompt = self.options.prompt_bucket(ids.shape[1])
        cap = int(getattr(self.model.config, "max_position_embeddings", None) or self.options.max_cache_len)
        length = cache_len or self.options.cache_length(max(prompt, ids.shape[1] + new), cap)
        if length is None:
            limit = self.options.max_cache_len
            return None, f"prompt {ids.shape[1]} + {new} new tokens is over the largest cache ({limit})"
        cache, why = self._cache(bucket, length)
        if cache is None:
            return None, why
        cache.reset()  # in place: the graphs captured with this cache stay valid
        return _Request(rows, bucket, cache, True, _plain_static(cache), length,
                        mode=torch.is_inference_mode_enabled()), ""

    def _cache(self, rows: int, length: int) -> tuple[Any, str]:
        """forgepack's cache for the bucket (made and counted in the pool if new), or (None, why not)."""
        # Tensors made under inference_mode cannot be written outside it (reset() would raise), so each
        # mode has caches of its own (their graphs are apart anyway: the mode is part of every key).
        key = _cache_key(rows, length, torch.is_inference_mode_enabled())
        with self.pool._lock:
            cache = self.pool.get(key)
            if cache is not None:
                return cache, ""
            cache = static_cache(self.model, length)  # layers allocate on first use
            nbytes = self._sizes.get(key) or expected_cache_bytes(self.model, cache, rows)
            if not self.pool.fits(nbytes):
                limit = self.pool.max_bytes
                return None, f"its KV cache (b{rows} c{length}) needs {nbytes} bytes, over max_bytes={limit}"
            self.pool.put(key, cache, nbytes, "cache")  # least recently used caches go, with their graphs
            return cache, ""

    def _measured(self, key: tuple, cache: Any) -> None:
        """After a request: the cache's bytes as allocated replace the estimate (evicted if now over)."""
        nbytes = cache_bytes(cache)
        if not nbytes:
            return
        self._sizes[key] = nbytes
        with self.pool._lock:
            if self.pool.get(key) is not cache or nbytes == self.pool.nbytes(key):
                return  # dropped meanwhile (graph mode reset), or measured as estimated
            if self.pool.fits(nbytes, key):
                self.pool.put(key, cache, nbytes, "cache", ())
            else:
                self.pool.evict(key)

    # -- a forward call of a served request --------------------------------------------------------------

    def _forward(self, request: _Request, kwargs: dict) -> Any:
        ids = kwargs.get("input_ids")
        first = request.calls == 0
        request.calls += 1
        length = ids.shape[1]
        padded = length
        call = dict(kwargs)
        if first and request.pad_prompt and _pads_cleanly(call):
            padded = self.options.prompt_bucket(length)
            if padded > request.cache_len or (not request.own and padded != length
                                              and int(request.cache.get_seq_length()) + padded > request.cache_len):
                padded = length
            call = _pad_prompt(call, length, padded)
        call = _pad_rows(call, request.batch, request.rows)
        phase = f"prefill b{request.rows} s{padded}" if first else f"decode b{request.rows}"
        out = self._counted(f"{phase} c{request.cache_len}", call)
        if padded > length:
            _rewind(request.cache, padded - length)
        return _slice_output(out, request.batch, length if _keeps_all(kwargs) else None)

    def _counted(self, bucket: str, call: dict) -> Any:
        # the graphed forward's live counters, read before and after (stats() built four dicts per call)
        tally, reasons = self.graphed._counts, self.graphed._reasons
        replays, captures, eager = tally["replays"], tally["captures"], tally["eager_calls"]
        before = reasons.copy()
        out = self.graphed(**call)
        counts = self._buckets[bucket]
        counts["calls"] += 1
        if tally["replays"] > replays:
            counts["replays"] += 1
        if tally["captures"] > captures:
            counts["captures"] += 1
        if tally["eager_calls"] > eager:
            counts.update(f"eager: {r}" for r, n in reasons.items() if n > before[r])
        return out

    # -- warm-up and introspection -----------------------------------------------------------------------

    def warmup(self, batch_sizes=None, prompt_lengths=(16,), max_new_tokens=(64,), shapes=None) -> dict[str, Any]:
        """Capture the graphs of these buckets before the first request: for every batch size, prompt
        length and number of new tokens (or every (batch, prompt length, new tokens) in `shapes`), a few
        short greedy `generate` calls on random tokens with the cache length such a request gets (warm-up
        calls, then the capture). Run it in the mode requests come in (`torch.inference_mode()` keys
        graphs and caches of its own). Returns `stats()`."""
        if shapes is None:
            new_tokens = (max_new_tokens,) if isinstance(max_new_tokens, int) else tuple(max_new_tokens)
            lengths = (prompt_lengths,) if isinstance(prompt_lengths, int) else tuple(prompt_lengths)
            shapes = [(b, p, n) for b in batch_sizes or self.options.batch_buckets for p in lengths for n in new_tokens]
        device = next(self.model.parameters()).device
        cap = int(getattr(self.model.config, "max_position_embeddings", None) or self.options.max_cache_len)
        steps = self.graphed.warmup + 2  # decode: warm-ups, the capture, a replay
        vocab = int(getattr(self.model.config, "vocab_size", 2) or 2)
        done = set()
        for rows, length, new in shapes:
            bucket = self.options.batch_bucket(rows) or rows
            prompt = self.options.prompt_bucket(length)
            cache_len = self.options.cache_length(max(prompt, length + new), cap)
            if cache_len is None or (bucket, prompt, cache_len) in done:
                continue
            done.add((bucket, prompt, cache_len))
            ids = torch.randint(0, vocab, (bucket, length), device=device)
            # a fresh cache's first prefill is a signature of its own (no buffers yet): one more round
            for _ in range(self.graphed.warmup + 2):
                self._serve(ids, (), {"attention_mask": torch.ones_like(ids), "max_new_tokens": steps,
                                      "min_new_tokens": steps, "do_sample": False, "pad_token_id": 0}, cache_len)
        return self.stats()

    def stats(self) -> dict[str, Any]:
        """Requests served and run eagerly (with why), per bucket its calls, replays, captures and eager
        calls by reason, the caches held (rows, length, inference mode) and their bytes and evictions, the
        memory budget (`max_bytes` against everything the pool holds, by kind), and the graphed forward's
        and the decode loop's own counters."""
        pool = self.pool
        return {"served_requests": self._requests["served"], "eager_requests": dict(self._eager_requests),
                "buckets": {k: dict(v) for k, v in sorted(self._buckets.items())},
                "caches": sorted(k[1:] for k in pool.keys("cache")), "cache_bytes": pool.bytes_of("cache"),
                "cache_evictions": pool.evictions["cache"],
                "budget": {"max_bytes": pool.max_bytes, "bytes": pool.total_bytes,
                           "by_kind": {kind: pool.bytes_of(kind) for kind in graphs.KINDS},
                           "evictions": {kind: pool.evictions[kind] for kind in graphs.KINDS}},
                "graphs": self.graphed.stats(), "decode_loop": self.loop.stats()}

    def close(self) -> None:
        """Give `generate` back, free the caches and graphs (graph mode itself is disabled by the caller)."""
        had, previous = self._restore
        if had:
            vars(self.model)["generate"] = previous
        else:
            vars(self.model).pop("generate", None)
        self.pool.clear("cache")  # and every graph captured with one
        self.loop.clear()
        _SERVERS.pop(self.model, None)


_SERVERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compile_off_message(model: Any) -> str:
    """The one log line a served model gets: its compile is off, and how to have it back (named by this
    copy's own module path: a pack's, or forgepack's runtime)."""
    package = __name__.rpartition(".")[0]
    pack = "the pack's deactivate()" if package == "forgepack.runtime" else f"{package}.deactivate()"
    return (f"forgepack graph mode serves {type(model).__name__}.generate(): transformers' automatic torch.compile "
            f"is off for this model while it is served; {__name__}.stop(model) gives generate() back as "
            f"transformers runs it, compile included (so does {pack}, which also turns the kernels off)")


_COMPILE_OFF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its disable_compile before


def compile_off(model: Any) -> bool:
    """Graph mode on a model's forward without a server (`activate(graphs=True, model=..., serve=False)`):
    transformers' automatic compile is turned off in the model's generation config, since it would
    compile the graphed forward ("torch.compile is tracing": no replay), with one log line saying how to
    get it back. `compile_back_all()` (the pack's `deactivate()`) restores the config."""
    config = getattr(model, "generation_config", None)
    if config is None or model in _COMPILE_OFF:
        return False
    _COMPILE_OFF[model] = getattr(config, "disable_compile", False)
    config.disable_compile = True
    package = __name__.rpartition(".")[0]
    _LOG.info("forgepack graph mode replays %s.forward: transformers' automatic torch.compile is off for this "
              "model (generation_config.disable_compile=True); %s.deactivate() gives it back",
              type(model).__name__, "the pack's" if package == "forgepack.runtime" else package)
    return True


def compile_back_all() -> int:
    """Undo every `compile_off`: each model's generation config as it was."""
    restored = list(_COMPILE_OFF.items())
    for model, previous in restored:
        model.generation_config.disable_compile = previous
    _COMPILE_OFF.clear()
    return len(restored)


def serve(model: Any, **options: Any) -> Server:
    """Serve `model.generate()` through bucketed graphs (idempotent: the first server stays). Options:
    those of `ServeOptions`, and `graphs.GraphedForward`'s (`max_graphs` defaults to 128 here); a model
    whose class is served (`serve_class`) gets the class's options under these."""
    current = _SERVERS.get(model)
    if current is not None:
        return current
    _STOPPED.discard(model)
    options = {**_class_options(type(model)), **options}
    serve_options = {k: v for k, v in options.items() if k in SERVE_OPTIONS}
    graph_options = {k: v for k, v in options.items() if k not in SERVE_OPTIONS}
    return Server(model, ServeOptions(**serve_options), graph_options)


def server(model: Any) -> Server | None:
    """The server installed on `model`, if any."""
    return _SERVERS.get(model)


def warmup(model: Any, batch_sizes=None, prompt_lengths=(16,), max_new_tokens=(64,), shapes=None,
           **options: Any) -> dict:
    """Capture before the first request (installs a server with `options` first if there is none)."""
    return serve(model, **options).warmup(batch_sizes, prompt_lengths, max_new_tokens, shapes)


def stop(model: Any) -> bool:
    """Undo `serve(model)`: `generate` is the model's own again; graph mode is disabled on it (and a
    served class does not serve it again: `serve(model)` would)."""
    current = _SERVERS.get(model)
    if current is None:
        return False
    if _class_options(type(model)):
        _STOPPED.add(model)
    current.close()
    graphs.disable(model)
    return True


def stop_all() -> int:
    """Undo every `serve` (the pack's `deactivate()` calls this)."""
    return sum(stop(m) for m in list(_SERVERS.keys()))


# ----------------------------------------------------------------------------------------------------
# Every instance of a class: `activate(graphs=True)` without `model=`


_CLASS_MARK = "_forgepack_served_class"
_CLASSES: dict[type, tuple[Any, dict]] = {}  # served class -> (its own `generate`, or _MISSING; options)
_STOPPED: weakref.WeakSet = weakref.WeakSet()  # instances `stop(model)` took off a served class
_MISSING = object()


def serve_class(cls: type, **options: Any) -> bool:
    """Serve `generate()` of every instance of `cls` (and its subclasses): on an instance's first call a
    server is installed on it (`serve(instance, **options)`), then that call and every later one are
    served. Only a causal LM is served (`servable`); any other instance runs the class's own `generate`.
    `stop_classes()` (the pack's `deactivate()`) puts the class's `generate` back. Returns whether the
    class was patched now (False: already served, or it has no `generate`)."""
    if cls in _CLASSES or not callable(getattr(cls, "generate", None)):
        return False
    base = _class_generate(cls)

    @functools.wraps(base)
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        current = _SERVERS.get(self)
        # cls in _CLASSES: a copy's bound patch (`_ServedGenerate.__deepcopy__`) must not serve after stop_classes()
        if current is None and cls in _CLASSES and self not in _STOPPED and servable(self):
            try:
                current = serve(self)
            except RuntimeError:  # graph mode disabled (FORGEPACK_DISABLE): the class's own generate
                current = None
        if current is not None:
            return current.generate(*args, **kwargs)
        return base(self, *args, **kwargs)

    setattr(generate, _CLASS_MARK, base)
    _CLASSES[cls] = (cls.__dict__.get("generate", _MISSING), dict(options))
    cls.generate = generate
    _LOG.info("forgepack graph mode serves %s.generate() for every instance (its server is installed on its "
              "first call; transformers' automatic torch.compile is off for a served model)", cls.__name__)
    return True


def stop_classes() -> int:
    """Undo every `serve_class`: each class's `generate` exactly as it was (servers already installed on
    instances stay until `stop`/`stop_all`)."""
    restored = list(_CLASSES.items())
    for cls, (own, _) in restored:
        if own is _MISSING:
            delattr(cls, "generate")
        else:
            cls.generate = own
    _CLASSES.clear()
    _STOPPED.clear()
    return len(restored)


def _class_generate(cls: type) -> Any:
    """`cls.generate` as transformers defines it (under a `serve_class` patch, the function it wraps)."""
    method = cls.generate
    return getattr(method, _CLASS_MARK, method)


def _class_options(cls: type) -> dict:
    served = next((c for c in cls.__mro__ if c in _CLASSES), None)
    return dict(_CLASSES[served][1]) if served is not None else {}


def servable(model: Any) -> bool:
    """Whether `model` is a causal LM whose `generate` this module can serve."""
    config = getattr(model, "config", None)
    return (isinstance(model, torch.nn.Module) and callable(getattr(model, "generate", None)) and config is not None
            and not getattr(config, "is_encoder_decoder", False) and hasattr(model, "generation_config"))


@contextlib.contextmanager
def served(model: Any, **options: Any):
    """`with serving.served(model):` graph-mode `generate` inside the block, the model's own after."""
    had = server(model) is not None
    srv = serve(model, **options)
    try:
        yield srv
    finally:
        if not had:
            stop(model)
