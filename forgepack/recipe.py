"""Recipes: what to build a pack for, as data that round-trips through TOML.

A recipe names a model (hub id, local directory, or an inline config with random weights), a workload
(task, phase, batch, lengths, dtype), a target and build settings. Unknown keys and bad values are
rejected with a message naming them. `load -> save -> load` gives an equal object.

A workload is either one shape (single ints: exactly one signature, as always) or a serving envelope:
`batch`, `seq_len` and `cache_len` may be a `Range` (`{ min = 1, max = 8 }` in TOML, "1-8" on the
command line), and phase "generate" serves a whole `generate()` (prefill and decode steps) in one pack.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from forgepack import tomlwriter
from forgepack.errors import UsageError

BUILTIN_DIR = Path(__file__).parent / "recipes"
DEFAULT_RECIPE = "tiny-llama"

# "auto": the checkpoint's own task, from its config.json `architectures` (`models.resolve_task`)
TASKS = ("auto", "causal-lm", "text-encoder", "image-classification", "sequence-classification")
PHASES = ("prefill", "decode", "generate")  # generate: prefill + decode steps, one pack
DTYPES = ("float32", "float16", "bfloat16")
MEMORY_FORMATS = ("contiguous", "channels_last")
TARGETS = ("cpu", "cuda", "auto")  # auto: cuda when a GPU is visible, else cpu (resolved on use)
PROPOSERS = ("templates", "anthropic", "openai")


@dataclass(frozen=True)
class Range:
    """Sizes served from `min` to `max` inclusive (a workload field of a serving envelope)."""

    min: int
    max: int

    def __str__(self) -> str:
        return f"{self.min}-{self.max}"


_RANGE_MIN = {"batch": 1, "seq_len": 1, "cache_len": 0}  # a range's min where the recipe leaves it out
RANGE_FIELDS = tuple(_RANGE_MIN)


def low(value: int | Range) -> int:
    return value.min if isinstance(value, Range) else value


def high(value: int | Range) -> int:
    return value.max if isinstance(value, Range) else value


def parse_size(text: str, key: str = "size") -> int | Range:
    """A CLI size: "8" is one size, "1-8" a range (a range of one size is that size)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if m is None:
        raise UsageError(f"--{key.replace('_', '-')} must be a size like 8 or a range like 1-8, got {text!r}")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if hi < lo:
        raise UsageError(f"--{key.replace('_', '-')} range {text!r} has its max below its min")
    return lo if lo == hi else Range(lo, hi)


@dataclass(frozen=True)
class ModelSpec:
    """Exactly one of `hub`, `path`, `config` says where the model comes from."""

    hub: str | None = None
    revision: str | None = None
    path: str | None = None
    config: dict[str, Any] | None = None
    arch: str | None = None  # transformers class for an inline config, e.g. "LlamaForCausalLM"
    seed: int = 0

    def source(self) -> str:
        if self.hub:
            return f"hub:{self.hub}"
        if self.path:
            return f"path:{self.path}"
        return f"inline:{self.arch or self.config.get('model_type', '?')}"


@dataclass(frozen=True)
class Workload:
    task: str = "auto"
    phase: str = "prefill"
    batch: int | Range = 1
    seq_len: int | Range = 32  # generate: prompt lengths
    cache_len: int | Range = 0  # decode: tokens already in the KV cache; generate: its max bounds prompt + new
    new_tokens: int = 4  # generate: tokens generated at each capture point
    image_size: int = 224
    dtype: str = "float32"
    static_cache: bool = False  # decode: transformers StaticCache, so each step has fixed shapes
    # Image models: "channels_last" serves the model with channels-last weights and inputs (as
    # `model.to(memory_format=torch.channels_last)` does in serving code): cuDNN's fast fp16 convs are
    # NHWC, and every activation between them then is too. The cards, kernels and guards follow it.
    memory_format: str = "contiguous"

    @property
    def is_envelope(self) -> bool:
        """Whether this serves more than one shape: a range anywhere, or a whole generate()."""
        return self.phase == "generate" or any(isinstance(getattr(self, k), Range) for k in RANGE_FIELDS)

    def at(self, **sizes: int) -> Workload:
        """One shape of the envelope (fields not given at their min)."""
        fixed = {k: low(getattr(self, k)) for k in RANGE_FIELDS}
        return dataclasses.replace(self, **{**fixed, **sizes})


@dataclass(frozen=True)
class Target:
    device: str = "cpu"
    arch: str | None = None  # e.g. "sm_90"; detected from the GPU when omitted


@dataclass(frozen=True)
class BuildSettings:
    budget: int = 16
    proposer: str = "templates"
    margin: float = 0.05
    max_cost: float | None = None  # USD, for LLM proposers
    time_limit: float | None = None  # seconds of profile + search; the pack step comes after
    llm_model: str = "claude-sonnet-4-6"
    gate: bool = True


@dataclass(frozen=True)
class Recipe:
    name: str
    model: ModelSpec
    workload: Workload = field(default_factory=Workload)
    target: Target = field(default_factory=Target)
    build: BuildSettings = field(default_factory=BuildSettings)

    @property
    def slug(self) -> str:
        return slugify(self.name)

    def replace(self, **sections: dict[str, Any]) -> Recipe:
        """A copy with some fields of some sections changed, validated like a file: CLI overrides."""
        data = to_dict(self)
        for section, values in sections.items():
            if section == "name":
                data["name"] = values
                continue
            data.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
        return from_dict(data, origin="command line")


def slugify(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    if not slug:
        raise UsageError(f"recipe name {name!r} has no letters or digits to make a slug from")
    return slug


_SECTIONS = {"model": ModelSpec, "workload": Workload, "target": Target, "build": BuildSettings}


def from_dict(data: dict[str, Any], origin: str = "recipe") -> Recipe:
    """Validate a parsed TOML document; every error names the key and the value."""
    unknown = set(data) - {"name", *_SECTIONS}
    if unknown:
        raise UsageError(f"{origin}: unknown key {sorted(unknown)[0]!r} (known: name, {', '.join(_SECTIONS)})")
    if "name" not in data or not isinstance(data["name"], str):
        raise UsageError(f"{origin}: 'name' is required and must be a string")
    if "model" not in data:
        raise UsageError(f"{origin}: a [model] section is required")
    parts = {name: _section(origin, name, cls, data.get(name, {})) for name, cls in _SECTIONS.items()}
    recipe = Recipe(name=data["name"], **parts)
    _check(origin, recipe)
    return recipe


def _section(origin: str, name: str, cls: type, values: Any) -> Any:
    if not isinstance(values, dict):
        raise UsageError(f"{origin}: [{name}] must be a table, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = dict(values)
    for key, value in values.items():
        if key not in fields:
            raise UsageError(f"{origin}: unknown key '{name}.{key}' (known: {', '.join(fields)})")
        if cls is Workload and key in RANGE_FIELDS and isinstance(value, str) and origin == "command line":  # 1-8
            values[key] = value = parse_size(value, key)
        if cls is Workload and key in RANGE_FIELDS and isinstance(value, dict | Range):
            values[key] = _range(origin, key, value)
            continue
        _check_type(origin, f"{name}.{key}", fields[key].type, value)
    return cls(**values)


def _range(origin: str, key: str, value: dict | Range) -> Range:
    if isinstance(value, Range):
        value = dataclasses.asdict(value)
    unknown = set(value) - {"min", "max"}
    if unknown:
        raise UsageError(f"{origin}: unknown key 'workload.{key}.{sorted(unknown)[0]}' (known: min, max)")
    if "max" not in value:
        raise UsageError(f"{origin}: 'workload.{key}' range needs a 'max'")
    lo, hi = value.get("min", _RANGE_MIN[key]), value["max"]
    for part, v in (("min", lo), ("max", hi)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise UsageError(f"{origin}: 'workload.{key}.{part}' must be int, got {v!r}")
    if hi < lo:
        raise UsageError(f"{origin}: 'workload.{key}' has max {hi} below min {lo}")
    return Range(lo, hi)


_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool, "dict": dict}


def _check_type(origin: str, key: str, annotation: str, value: Any) -> None:
    allowed = [t.strip() for t in str(annotation).split("|")]
    if value is None and "None" in allowed:
        return
    for name in allowed:
        base = name.split("[")[0]
        expected = _TYPES.get(base)
        if expected is None:
            continue
        if isinstance(value, bool) and base != "bool":
            continue
        if isinstance(value, expected):
            return
    raise UsageError(f"{origin}: '{key}' must be {' or '.join(allowed)}, got {value!r}")


def _check(origin: str, r: Recipe) -> None:
    m, w, t, b = r.model, r.workload, r.target, r.build
    sources = [s for s in (m.hub, m.path, m.config) if s]
    if len(sources) != 1:
        raise UsageError(f"{origin}: [model] needs exactly one of 'hub', 'path' or 'config'")
    if m.config is not None and not m.config.get("model_type"):
        raise UsageError(f"{origin}: 'model.config' needs a 'model_type' (e.g. \"llama\")")
    _one_of(origin, "workload.task", w.task, TASKS)
    _one_of(origin, "workload.phase", w.phase, PHASES)
    _one_of(origin, "workload.dtype", w.dtype, DTYPES)
    _one_of(origin, "workload.memory_format", w.memory_format, MEMORY_FORMATS)
    if w.memory_format != "contiguous" and w.task != "image-classification":
        raise UsageError(f"{origin}: 'workload.memory_format' = {w.memory_format!r} needs task "
                         f"\"image-classification\", got {w.task!r}")
    _one_of(origin, "target.device", t.device, TARGETS)
    _one_of(origin, "build.proposer", b.proposer, PROPOSERS)
    for key, value in (("batch", low(w.batch)), ("seq_len", low(w.seq_len)), ("image_size", w.image_size)):
        if value < 1:
            raise UsageError(f"{origin}: 'workload.{key}' must be at least 1, got {value}")
    if low(w.cache_len) < 0:
        raise UsageError(f"{origin}: 'workload.cache_len' must be 0 or more, got {w.cache_len}")
    if w.new_tokens < 1:
        raise UsageError(f"{origin}: 'workload.new_tokens' must be at least 1, got {w.new_tokens}")
    if w.phase in ("decode", "generate") and w.task not in ("causal-lm", "auto"):  # auto: checked again once resolved
        raise UsageError(f"{origin}: 'workload.phase' = \"{w.phase}\" needs task \"causal-lm\", got {w.task!r}")
    if w.task == "image-classification" and any(isinstance(x, Range) for x in (w.seq_len, w.cache_len)):
        raise UsageError(f"{origin}: an image model's envelope is 'workload.batch' only")
    if w.phase == "generate" and high(w.cache_len) and high(w.cache_len) < high(w.seq_len) + w.new_tokens:
        raise UsageError(f"{origin}: 'workload.cache_len' max {high(w.cache_len)} is below the longest prompt "
                         f"({high(w.seq_len)}) plus 'workload.new_tokens' ({w.new_tokens})")
    if t.arch is not None and not re.fullmatch(r"sm_\d{2,3}a?", t.arch):
        raise UsageError(f"{origin}: 'target.arch' must look like \"sm_90\", got {t.arch!r}")
    if b.budget < 0:
        raise UsageError(f"{origin}: 'build.budget' must be 0 or more, got {b.budget}")
    if not -1.0 < b.margin < 10.0:
        raise UsageError(f"{origin}: 'build.margin' must be between -1 and 10, got {b.margin}")
    if b.time_limit is not None and not b.time_limit > 0:
        raise UsageError(f"{origin}: 'build.time_limit' must be a number of seconds above 0, got {b.time_limit}")


def _one_of(origin: str, key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UsageError(f"{origin}: '{key}' must be one of {', '.join(allowed)}; got {value!r}")


def to_dict(recipe: Recipe) -> dict[str, Any]:
    """Plain data for TOML: None values are left out (TOML has no null)."""

    def clean(obj: Any) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(obj).items() if v is not None}
        if isinstance(obj, Workload) and obj.phase != "generate":
            del data["new_tokens"]  # only generate reads it: fixed-shape recipes and their fingerprints as before
        return data

    return {"name": recipe.name, **{name: clean(getattr(recipe, name)) for name in _SECTIONS}}


def loads(text: str, origin: str = "recipe") -> Recipe:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"{origin}: not valid TOML: {err}") from None
    return from_dict(data, origin)


def load(path: str | Path) -> Recipe:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise UsageError(f"cannot read recipe {path}: {err.strerror}") from None
    return loads(text, origin=str(path))


def dumps(recipe: Recipe) -> str:
    return tomlwriter.dumps(to_dict(recipe))


def save(recipe: Recipe, path: str | Path) -> None:
    Path(path).write_text(dumps(recipe))


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


def concrete(recipe: Recipe) -> Recipe:
    """The recipe with target "auto" replaced by the device this machine has."""
    if recipe.target.device != "auto":
        return recipe
    import torch

    return recipe.replace(target={"device": "cuda" if torch.cuda.is_available() else "cpu"})


def resolve(spec: str | None) -> Recipe:
    """A recipe from a CLI argument: a .toml path, a built-in recipe name, or a model id / directory.

    A bare model id or directory becomes a recipe with default workload settings; the loader decides
    later whether it can be reached.
    """
    if spec is None:
        spec = DEFAULT_RECIPE
    path = Path(spec)
    if spec.endswith(".toml"):
        if not path.is_file():
            raise UsageError(f"recipe file {spec} does not exist")
        return concrete(load(path))
    if spec in builtin_names():
        return concrete(load(BUILTIN_DIR / f"{spec}.toml"))
    if path.exists() or spec.startswith((".", "/", "~")):
        data = {"name": path.resolve().name or "model", "model": {"path": spec}, "target": {"device": "auto"}}
        return concrete(from_dict(data, origin=spec))
    if re.fullmatch(r"[\w.\-]+/[\w.\-]+", spec):
        data = {"name": spec.split("/")[-1], "model": {"hub": spec}, "target": {"device": "auto"}}
        return concrete(from_dict(data, origin=spec))
    known = ", ".join(builtin_names())
    raise UsageError(f"{spec!r} is not a recipe file, a built-in recipe ({known}), a directory or a hub id")
