"""Model + example inputs from a recipe, through the real loading path.

- inline config: built from the config with random weights (no hub is needed), on the target device;
- local directory: `from_pretrained(path)`;
- hub id: `huggingface_hub.snapshot_download` (honours the HF cache and `HF_HUB_OFFLINE`), then
  `from_pretrained` on the downloaded directory.

A checkpoint loads as the model it is: with `workload.task = "auto"` (the default) the class is the
first of its config.json `architectures` and the task follows from it (`resolve_task`); an explicit
task loads through that task's Auto class. A load whose report has missing or unexpected weights is
refused, naming them: random weights where the checkpoint has none would be measured and shipped.

Inputs follow the workload: token ids for language models (prefill: `seq_len` tokens; decode: one step
of `seq_len` tokens after `cache_len` tokens already in the KV cache), pixels for image classifiers.
Prefill runs with `use_cache=False` (the forward's compute, without building a cache object). Decode
keeps the cache at `cache_len` tokens so that repeated steps are identical: a `StaticCache` is written
at the same positions again; a dynamic cache is cropped back after each step.

A serving envelope (`Workload.is_envelope`) loads with one representative shape in `inputs` (the
envelope's largest corner, a prefill for phase generate: what the gate and end-to-end timing run) and
the capture points in `points` (`envelope_points`): the envelope's corners and a few interior, odd
sizes, each prepared outside the capture and then run (phase generate: a real `model.generate()`, so
the decode steps at every cache length are seen too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from forgepack.errors import ForgepackError
from forgepack.recipe import RANGE_FIELDS, Range, Recipe, Workload, high, low
from forgepack.runtime.transformers_hooks import cache_kwarg_of

_TASK_AUTO = {
    "causal-lm": "AutoModelForCausalLM",
    "text-encoder": "AutoModel",
    "image-classification": "AutoModelForImageClassification",
    "sequence-classification": "AutoModelForSequenceClassification",
}
# transformers' own task tables, most specific first: which task a model class serves
_TASK_MAPPINGS = (
    ("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    ("text-encoder", "MODEL_MAPPING_NAMES"),
)


@dataclass
class LoadedModel:
    recipe: Recipe
    model: torch.nn.Module
    inputs: dict[str, Any]
    device: torch.device
    dtype: torch.dtype
    after_step: Callable[[], None] | None = None  # decode: put the cache back to cache_len tokens
    extra: dict[str, Any] = field(default_factory=dict)
    points: list[EnvelopePoint] = field(default_factory=list)  # a serving envelope's capture points

    def forward(self, inputs: dict[str, Any] | None = None) -> Any:
        """One forward (no grad) on the example inputs, or on `inputs`; the cache is left advanced."""
        with torch.no_grad():
            return self.model(**(self.inputs if inputs is None else inputs))

    def reset(self) -> None:
        """Undo a forward's effect on model state (decode: the cache goes back to cache_len tokens)."""
        if self.after_step is not None:
            self.after_step()

    def run(self, inputs: dict[str, Any] | None = None) -> Any:
        """One forward, repeatable: same inputs, same cache state afterwards."""
        out = self.forward(inputs)
        self.reset()
        return out

    def make_inputs(self, seed: int) -> dict[str, Any]:
        """Fresh inputs of the same shapes (same cache state for decode), for the end-to-end gate."""
        gen = torch.Generator().manual_seed(seed)
        fresh = dict(self.inputs)
        for name, value in self.inputs.items():
            if not isinstance(value, torch.Tensor) or name in ("cache_position", "attention_mask", "position_ids"):
                continue
            if value.dtype.is_floating_point:  # empty_like keeps the layout (channels-last pixels)
                fresh[name] = torch.empty_like(value).copy_(torch.randn(value.shape, generator=gen))
            else:
                high = self.extra.get("vocab_size", int(value.max()) + 1)
                fresh[name] = torch.randint(0, high, value.shape, generator=gen).to(value.device)
        return fresh

    def output_tensor(self, out: Any) -> torch.Tensor:
        """The tensor to compare end to end: logits, or the last hidden state for encoders."""
        for name in ("logits", "last_hidden_state"):
            value = getattr(out, name, None)
            if isinstance(value, torch.Tensor):
                return value
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
            return out[0]
        raise ForgepackError(f"cannot find an output tensor in {type(out).__name__}")


@dataclass(frozen=True)
class EnvelopePoint:
    """One shape of a serving envelope that capture visits: `prepare()` (run outside the capture: a
    decode cache is filled there) returns the run to capture."""

    sizes: tuple[tuple[str, int], ...]  # workload field -> value, e.g. (("batch", 2), ("seq_len", 13))
    prepare: Callable[[], Callable[[], Any]]


def target_device(recipe: Recipe) -> torch.device:
    from forgepack.recipe import concrete

    if concrete(recipe).target.device == "cuda":
        if not torch.cuda.is_available():
            raise ForgepackError("target 'cuda' needs a CUDA GPU, and none is visible here; use --target cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a dtype the device cannot run, before loading gigabytes of weights."""
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ForgepackError(f"dtype bfloat16 is not supported on {name}; use float16 or float32")
    try:
        a = torch.ones(4, 4, dtype=dtype, device=device)
        (a @ a).sum().item()
    except RuntimeError as err:
        first = str(err).splitlines()[0]
        raise ForgepackError(f"dtype {dtype} cannot run on {device.type}: {first}") from None


def task_of(class_name: str, config: dict[str, Any]) -> str | None:
    """The workload task a transformers model class serves, from transformers' task tables; None when
    it is none of forgepack's (a base model counts as a text encoder only with a token vocabulary)."""
    from transformers.models.auto import modeling_auto

    for task, table in _TASK_MAPPINGS:
        names = getattr(modeling_auto, table, {}).values()
        served = any(class_name == n or (isinstance(n, tuple) and class_name in n) for n in names)
        if served and (task != "text-encoder" or "vocab_size" in config):
            return task
    return None


def resolve_task(recipe: Recipe) -> Recipe:
    """The recipe with `workload.task = "auto"` made concrete, and for a checkpoint `model.arch` set
    to the class its config.json names (`architectures`); an explicit task (`--task`) is kept as is.
    Reads only config.json (for a hub model from the cache or the hub)."""
    if recipe.workload.task != "auto":
        return recipe
    spec = recipe.model
    if spec.config is not None:
        config = dict(spec.config)
        arch = spec.arch
    else:
        config = _read_config(spec)
        arch = spec.arch or next(iter(config.get("architectures") or ()), None)
    if arch is None:
        if spec.config is not None:  # an inline config without a class: a language model, as always
            return recipe.replace(workload={"task": "causal-lm"})
        raise ForgepackError(f"{spec.source()}: config.json names no architectures; "
                             f"say which task to load it for (--task, one of {', '.join(_TASK_AUTO)})")
    task = task_of(arch, config)
    if task is None:
        raise ForgepackError(f"{spec.source()}: {arch} is not a model for any task forgepack runs "
                             f"({', '.join(_TASK_AUTO)}); pass --task to load it as one")
    return recipe.replace(workload={"task": task}, model={"arch": arch})


def _read_config(spec) -> dict[str, Any]:
    import json

    if spec.path:
        path = Path(spec.path).expanduser() / "config.json"
        if not path.parent.is_dir():
            raise ForgepackError(f"model directory {spec.path} does not exist")
    else:
        path = Path(_download(spec.hub, spec.revision, filename="config.json"))
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ForgepackError(f"cannot read {path}: {err}") from None


def load(recipe: Recipe) -> LoadedModel:
    recipe = resolve_task(recipe)
    device = target_device(recipe)
    dtype = getattr(torch, recipe.workload.dtype)
    check_dtype(dtype, device)
    model = _build(recipe, device, dtype)
    model.eval()
    if recipe.workload.memory_format == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    if not recipe.workload.is_envelope:
        return _with_inputs(recipe, model, device, dtype)
    phase = "prefill" if recipe.workload.phase == "generate" else None
    lm = _with_inputs(_at(recipe, representative(recipe.workload), phase), model, device, dtype)
    lm.recipe = recipe
    lm.points = [EnvelopePoint(tuple(p.items()), _preparer(recipe, p, model, device, dtype))
                 for p in envelope_points(recipe.workload)]
    return lm


# --- serving envelopes --------------------------------------------------------------------------------


def _at(recipe: Recipe, sizes: dict[str, int], phase: str | None = None) -> Recipe:
    w = recipe.workload.at(**sizes)
    return dataclasses.replace(recipe, workload=dataclasses.replace(w, phase=phase or w.phase))


def representative(w: Workload) -> dict[str, int]:
    """The shape an envelope's gate and end-to-end timing run: its largest corner (generate: the prompt)."""
    sizes = {k: high(getattr(w, k)) for k in RANGE_FIELDS}
    if w.phase == "generate":
        sizes["cache_len"] = 0
    return sizes


def _inside(r: Range, count: int) -> list[int]:
    """`count` sizes strictly inside the range, odd and prime where it has them, spread over it."""
    inner = list(range(r.min + 1, r.max))
    if not inner:
        return []
    primes = [v for v in inner if v > 2 and all(v % d for d in range(2, int(v**0.5) + 1))]
    primes = primes if len(primes) >= count else inner
    picks = [primes[min(len(primes) - 1, (len(primes) * (i + 1)) // (count + 1))] for i in range(count)]
    return list(dict.fromkeys(picks))


def envelope_points(w: Workload) -> list[dict[str, int]]:
    """The shapes capture runs: every corner of the ranged fields, then interior odd sizes, chosen so that
    no two fields (nor batch x length, a flattened matmul row count) take equal values at every point:
    `families.fold` names a dim per distinct value vector, so equal vectors would merge dims that the
    envelope lets vary apart. Phase generate ranges batch and prompt length; when `cache_len` has a max
    beyond the longest prompt plus the new tokens, two more points reach it (prompt cache max - new)."""
    ranged = [k for k in RANGE_FIELDS if isinstance(getattr(w, k), Range) and not
              (w.phase == "generate" and k == "cache_len")]
    fixed = {k: low(getattr(w, k)) for k in RANGE_FIELDS}
    if w.phase == "generate":
        fixed["cache_len"] = 0
    points = [{**fixed, **dict(zip(ranged, corner, strict=True))}
              for corner in itertools.product(*[(low(getattr(w, k)), high(getattr(w, k))) for k in ranged])]
    inner = {k: _inside(getattr(w, k), 4) for k in ranged}
    for i in range(4):
        if len(points) >= len(ranged) + 4 and _apart(points, ranged):
            break
        point = dict(fixed)
        for j, k in enumerate(ranged):
            values = inner[k] or [low(getattr(w, k))]
            point[k] = values[(i + j) % len(values)]
        points.append(point)
    if w.phase == "generate" and high(w.cache_len) > high(w.seq_len) + w.new_tokens:
        long = high(w.cache_len) - w.new_tokens
        points += [{**fixed, "batch": b, "seq_len": long} for b in dict.fromkeys((low(w.batch), high(w.batch)))]
    unique = {tuple(sorted(p.items())): p for p in points}
    return list(unique.values())


def _apart(points: list[dict[str, int]], ranged: list[str]) -> bool:
    vectors = [tuple(p[k] for p in points) for k in ranged]
    if "batch" in ranged and "seq_len" in ranged:
        vectors.append(tuple(p["batch"] * p["seq_len"] for p in points))
    return len(set(vectors)) == len(vectors)


def _preparer(recipe: Recipe, sizes: dict[str, int], model, device, dtype) -> Callable[[], Callable[[], Any]]:
    def prepare() -> Callable[[], Any]:
        if recipe.workload.phase == "generate":
            return _generate_run(recipe, sizes, model, device)
        return _with_inputs(_at(recipe, sizes), model, device, dtype).run
    return prepare


def _generate_run(recipe: Recipe, sizes: dict[str, int], model, device) -> Callable[[], Any]:
    """A greedy `generate()` of `new_tokens` tokens from a random prompt of this batch and length."""
    ids = generate_prompt(model, sizes, device)
    return lambda: generate(model, ids, recipe.workload.new_tokens)


def generate_prompt(model, sizes: dict[str, int], device) -> torch.Tensor:
    """The random prompt an envelope point's `generate()` runs (seeded by its batch and length)."""
    gen = torch.Generator().manual_seed(1234 + 31 * sizes["batch"] + sizes["seq_len"])
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(0, vocab, (sizes["batch"], sizes["seq_len"]), generator=gen).to(device)


def generate(model, ids: torch.Tensor, new_tokens: int, logits: bool = False) -> Any:
    """Greedy `generate()` of exactly `new_tokens` tokens (never fewer: random weights may emit
    end-of-text) with the default dynamic cache; the token ids, or with `logits` the generate output
    whose `.logits` holds each step's [batch, vocab] logits."""
    pad = getattr(model.generation_config, "pad_token_id", None)
    pad = pad if pad is not None else 0
    extra = {"output_logits": True, "return_dict_in_generate": True} if logits else {}
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad, **extra)


def _build(recipe: Recipe, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    spec = recipe.model
    if spec.config is not None:
        return _from_config(recipe, device, dtype)
    if spec.path and not Path(spec.path).expanduser().is_dir():
        raise ForgepackError(f"model directory {spec.path} does not exist")
    path = str(Path(spec.path).expanduser()) if spec.path else _download(spec.hub, spec.revision)
    name = spec.arch or _TASK_AUTO[recipe.workload.task]
    auto = getattr(transformers, name, None)
    if auto is None:
        raise ForgepackError(f"{spec.source()}: {name} is not a transformers model class (transformers "
                             f"{transformers.__version__})")
    try:
        model, report = auto.from_pretrained(path, dtype=dtype, output_loading_info=True)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0]
        raise ForgepackError(f"cannot load a model from {path}: {first}") from None
    problem = weights_problem(report)
    if problem:
        raise ForgepackError(f"{spec.source()} as {type(model).__name__}: {problem}; refusing a model with "
                             "random weights in place of the checkpoint's (is --task right?)")
    return model.to(device)


def weights_problem(report: dict[str, Any]) -> str | None:
    """What a `from_pretrained` loading report says is wrong with the weights, naming them, or None."""
    parts = []
    for key, what in (("missing_keys", "missing from the checkpoint"), ("unexpected_keys", "not used by the model"),
                      ("mismatched_keys", "of another shape than the model's")):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in report.get(key) or ())
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            parts.append(f"{len(names)} weights {what} ({shown})")
    return "; ".join(parts) or None


def _from_config(recipe: Recipe, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    spec = recipe.model
    values = dict(spec.config)
    model_type = values.pop("model_type")
    try:
        config = transformers.AutoConfig.for_model(model_type, **values)
    except ValueError:
        raise ForgepackError(f"unknown model_type {model_type!r} in 'model.config'") from None
    class_name = spec.arch or _TASK_AUTO[recipe.workload.task]
    cls = getattr(transformers, class_name, None)
    if cls is None:
        raise ForgepackError(f"'model.arch' = {class_name!r} is not a transformers model class")
    torch.manual_seed(spec.seed)
    with torch.device(device):  # initialise on the target: seconds instead of minutes for 1B params
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    return model.to(dtype)


def _download(repo_id: str, revision: str | None, filename: str | None = None) -> str:
    """The snapshot directory (or one file of it) from the HF cache or the hub."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        if filename:
            return hf_hub_download(repo_id, filename, revision=revision)
        return snapshot_download(repo_id, revision=revision)
    except RevisionNotFoundError:
        raise ForgepackError(f"model {repo_id!r} has no revision {revision!r} on the Hugging Face Hub") from None
    except RepositoryNotFoundError:
        raise ForgepackError(f"unknown model {repo_id!r}: no such repository on the Hugging Face Hub") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        kind = type(err).__name__
        offline = getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)()
        if offline:  # offline already: only the cache counts, and it lacks this
            raise ForgepackError(
                f"cannot reach the Hugging Face Hub for {what}: HF_HUB_OFFLINE is set and it is not in the HF "
                f"cache ({constants.HF_HUB_CACHE}; {kind}): download it once with network access, or use a "
                "local directory (model.path)"
            ) from None
        raise ForgepackError(
            f"cannot reach the Hugging Face Hub for {what} ({kind}): use a local directory "
            "(model.path) or a model already in the HF cache (HF_HUB_OFFLINE=1)"
        ) from None


def with_inputs(recipe: Recipe, model: torch.nn.Module) -> LoadedModel:
    """`model` (already loaded, e.g. by `load` for another shape) with the inputs of `recipe`'s concrete
    workload: one model timed at many shapes without loading it again."""
    return _with_inputs(recipe, model, target_device(recipe), getattr(torch, recipe.workload.dtype))


def _with_inputs(recipe: Recipe, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    w = recipe.workload
    gen = torch.Generator().manual_seed(1234)
    config = model.config
    if w.task == "image-classification":
        size = w.image_size
        channels = getattr(config, "num_channels", 3)
        pixels = torch.randn(w.batch, channels, size, size, generator=gen).to(device, dtype)
        if w.memory_format == "channels_last":
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        return LoadedModel(recipe, model, {"pixel_values": pixels}, device, dtype)
    vocab = config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (w.batch, w.seq_len), generator=gen).to(device)
    extra = {"vocab_size": vocab}
    if w.task in ("text-encoder", "sequence-classification"):
        mask = torch.ones_like(ids)
        return LoadedModel(recipe, model, {"input_ids": ids, "attention_mask": mask}, device, dtype, extra=extra)
    if w.phase == "prefill":
        return LoadedModel(recipe, model, {"input_ids": ids, "use_cache": False}, device, dtype, extra=extra)
    return _decode(recipe, model, ids, device, dtype, gen, extra)


def _decode(recipe, model, ids, device, dtype, gen, extra) -> LoadedModel:
    from transformers import DynamicCache, StaticCache

    w = recipe.workload
    vocab = extra["vocab_size"]
    if w.static_cache:
        cache = StaticCache(config=model.config, max_cache_len=w.cache_len + w.seq_len)
    else:
        cache = DynamicCache()
    if w.cache_len:
        prompt = torch.randint(0, vocab, (w.batch, w.cache_len), generator=gen).to(device)
        with torch.no_grad():
            model(input_ids=prompt, use_cache=True, cache_position=torch.arange(w.cache_len, device=device),
                  **{cache_kwarg_of(model.forward): cache})
    positions = torch.arange(w.cache_len, w.cache_len + w.seq_len, device=device)
    inputs = {"input_ids": ids, cache_kwarg_of(model.forward): cache, "use_cache": True, "cache_position": positions}
    extra["cache"] = cache
    state = snapshot(cache)
    return LoadedModel(recipe, model, inputs, device, dtype, after_step=lambda: restore(cache, state), extra=extra)


def _holders(cache: Any) -> list[Any]:
    return [cache, *getattr(cache, "layers", ())]


def snapshot(cache: Any) -> list[dict[str, Any]]:
    """The cache's position state: counters (ints, 0-d tensors) by value, key/value tensors by reference.

    Restoring it makes the next decode step repeat this one on any transformers version: a dynamic cache
    gets its shorter key/value tensors back, a static cache its length counters (copied in place, so
    their addresses stay fixed for CUDA graphs); stale entries past the position are overwritten.
    """
    states = []
    for holder in _holders(cache):
        state = {}
        for name, value in vars(holder).items():
            if isinstance(value, torch.Tensor):
                state[name] = value.clone() if value.numel() <= 1 else value
            elif isinstance(value, int) and not isinstance(value, bool):
                state[name] = value
        states.append(state)
    return states


def restore(cache: Any, states: list[dict[str, Any]]) -> None:
    for holder, state in zip(_holders(cache), states, strict=True):
        for name, saved in state.items():
            current = getattr(holder, name, None)
            if isinstance(saved, torch.Tensor) and saved.numel() <= 1 and isinstance(current, torch.Tensor):
                current.copy_(saved)
            elif current is not saved:
                setattr(holder, name, saved)


@contextlib.contextmanager
def quiet_transformers():
    """transformers logs warnings for random-weight models; they are expected here."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
