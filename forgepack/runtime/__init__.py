"""A forgepack kernel pack: verified kernels for one model's operator calls, behind C++ guards.

    import forgepack_pack_<name> as pack
    pack.activate()              # one line in serving code; idempotent
    pack.activate(graphs=True)   # also replay the model's forward from CUDA graphs (see graphs.py)
    with pack.active(): ...      # or only inside a block
    pack.stats()                 # hits, misses and kernel errors per variant
    with pack.record_misses() as rec: ...  # the calls the guards sent to stock, by signature (misses.py)
    pack.deactivate()            # the stock kernels again, exactly

Each overridden aten op checks, in C++ at its backend dispatch key, whether a call is one of the
variants whose kernel was verified (dtypes, sizes, strides, pointer alignment, device and compute
capability, non-tensor arguments, no autograd needed); anything else runs the stock kernel captured
when the pack was activated, so its results are bit-identical to stock PyTorch.

The pack never breaks its caller: on another torch version, CUDA version or GPU arch it warns and
does nothing. It refuses to load a file whose sha256 differs from the manifest, a file the manifest
does not list, and a manifest whose own digest is not its content's (a warning that names the file;
`activate(strict=True)` raises instead). `FORGEPACK_DISABLE=1` turns `activate()` into a
logged no-op. `python -m <package> selftest` re-verifies every kernel on this machine.

This file is forgepack's pack runtime, copied into every pack; it imports only torch and the
standard library.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from .packinfo import PackInfo, file_sha256

HERE = Path(__file__).resolve().parent
_LOG = logging.getLogger(__name__)
_LOCK = threading.RLock()
_STATE: dict[str, Any] = {"manifest": None, "verified": False, "loaded": False, "active": False,
                          "graphs": False, "generation": 0, "fused": None, "mismatch": False, "enabled": None}


class PackError(RuntimeError):
    """Raised by `activate(strict=True)` when the pack cannot be used here; the message says why."""


# --- the manifest ------------------------------------------------------------------------------------


def manifest() -> PackInfo:
    """The pack's manifest.toml as the runtime reads it (`packinfo.PackInfo`, read once)."""
    if _STATE["manifest"] is None:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib
        _STATE["manifest"] = PackInfo.from_dict(tomllib.loads((HERE / "manifest.toml").read_text()))
    return _STATE["manifest"]


def _readable_manifest() -> PackInfo | None:
    """The manifest, or None when it cannot be read (for stats() after a refused activate)."""
    try:
        return manifest()
    except Exception:  # a refused activate() already said why
        return None


def _op_ids() -> list[str]:
    return [v.id for v in manifest().variants]


def _fused():
    """The pack's module patches (fused kernels for module-level chains), or None if it has none."""
    if _STATE["fused"] is None:
        from . import modules

        _STATE["fused"] = modules.PackModules.read(HERE) or False
    return _STATE["fused"] or None


def variant_ids() -> list[str]:
    fused = _fused()
    return _op_ids() + (fused.variant_ids if fused else [])


# --- may this pack run here? --------------------------------------------------------------------------


def _major_minor(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    parts = version.split("+")[0].split(".")[:2]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        return None


def _arch_of(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def environment_problem() -> tuple[str | None, list[int]]:
    """(why this pack cannot run in this process, or None; the CUDA devices whose arch is the pack's)."""
    m = manifest()
    if _major_minor(torch.__version__) != _major_minor(m.torch):
        return f"built for torch {m.torch}, this is torch {torch.__version__}", []
    if bool(torch._C._GLIBCXX_USE_CXX11_ABI) != m.cxx11_abi:
        return "built for the other C++ ABI of torch (_GLIBCXX_USE_CXX11_ABI differs)", []
    if m.device != "cuda":
        return None, []
    if _major_minor(torch.version.cuda) != _major_minor(m.cuda):
        return f"built for CUDA {m.cuda}, this torch uses CUDA {torch.version.cuda}", []
    if not torch.cuda.is_available():
        return "built for CUDA GPUs, and no CUDA GPU is visible", []
    want = m.arch.removesuffix("a")
    devices = [i for i in range(torch.cuda.device_count()) if _arch_of(torch.cuda.get_device_capability(i)) == want]
    if not devices:
        have = sorted({_arch_of(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())})
        return f"built for {want} GPUs, the GPUs here are {', '.join(have)}", []
    return None, devices


def file_problem() -> str | None:
    """What fails the pack's integrity check, named: the manifest's own digest, a file whose digest is
    not the manifest's, or a file the manifest does not list; None when everything checks out."""
    m = manifest()
    if m.digest != m.content_digest:
        return "manifest.toml does not match its own digest (modified or corrupt): refusing to load"
    listed = {entry.path for entry in m.files}
    for entry in m.files:
        path = HERE / entry.path
        if not path.is_file():
            return f"{entry.path} is missing from the pack"
        if file_sha256(path) != entry.sha256:
            return f"{entry.path} does not match its sha256 in the manifest (modified or corrupt): refusing to load"
    for path in sorted(HERE.rglob("*")):
        rel = path.relative_to(HERE).as_posix()
        if path.is_file() and rel != "manifest.toml" and "__pycache__" not in path.parts and rel not in listed:
            return f"{rel} is not listed in the manifest: refusing to load"
    return None


# --- activation ---------------------------------------------------------------------------------------


def _ops():
    return getattr(torch.ops, manifest().namespace)


def _refuse(reason: str, strict: bool, depth: int = 4) -> bool:
    message = f"{__name__}: {reason}; running stock PyTorch"
    if strict:
        raise PackError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=depth)  # points at the caller of activate()
    return False


def disabled() -> bool:
    """FORGEPACK_DISABLE is set: activate() is a logged no-op."""
    return os.environ.get("FORGEPACK_DISABLE", "").strip().lower() not in ("", "0", "false", "no")


def fused_kernels() -> list[dict[str, Any]]:
    """The pack's fused kernels (module-level chains) as modules.json lists them: id, op, signature,
    calls, sites."""
    fused = _fused()
    return list(fused.spec.get("variants", [])) if fused else []


def activate(strict: bool = False, graphs: bool = False, model: Any = None, **graph_options: Any) -> bool:
    """Install the pack's guarded kernels; True when active. Idempotent.

    Where the pack does not apply (torch/CUDA version, GPU arch, a file that fails its digest) it
    warns and returns False, so the caller keeps running on stock PyTorch; `strict=True` raises
    `PackError` instead.

    `graphs=True` also replays the model's forward from CUDA graphs, one per input signature, with the
    pack's kernels inside (`graphs.GraphedForward`; `graph_options` are its options): for `model` if
    given, else for every instance of the model class the pack was built for (and then each causal LM
    instance's `generate()` is served from its first call: `serving.serve_class`). Where the build
    found the forward unsafe to capture, the manifest says why and graph mode stays off (one warning).
    For a causal LM `model`, `generate()` is served too (`serving.py`): forgepack's static cache per
    batch bucket, padded batch and prompt buckets, one replay per decode step, and transformers'
    automatic torch.compile turned off for that model (one log line says so). To get transformers'
    own `generate()` back, compile included: `deactivate()`, or `serving.stop(model)` to keep the
    kernels (a later `activate(graphs=False)` changes nothing: activation is idempotent).
    `serve=False` keeps graph mode to the forward (the old behaviour), transformers' compile off for
    that model too (its generation config, put back by `deactivate()`). Bucket and memory options
    (`batch_buckets`, `prompt_buckets`, `cache_lengths`, `max_cache_len`, `max_bytes`) join
    `graph_options`; `max_bytes` bounds a served model's graphs, the KV caches forgepack allocates for
    it and its decode loop's buffers together; `warmup(model, ...)` captures before the first request.

    Given `model`, it also checks that the model is laid out as the pack was built for: a pack built
    for a channels-last model on an NCHW one would be correct but useless (every guard misses), so
    that gets a warning saying how to convert it.
    """
    with _LOCK:
        if disabled():
            _LOG.warning("%s: FORGEPACK_DISABLE is set; not activating (stock PyTorch runs)", __name__)
            return False
        try:
            ok = _STATE["active"] or _activate(strict)
            problem = layout_problem(model, manifest().memory_format) if ok and model is not None else None
            if problem:
                warnings.warn(f"{__name__}: {problem}", RuntimeWarning, stacklevel=3)
            if ok and graphs:
                _enable_graphs(model, graph_options)
            return ok
        except PackError:
            raise
        except Exception as err:  # a pack must never break the process it was imported into
            first = (str(err).splitlines() or [""])[0]
            return _refuse(f"could not activate ({type(err).__name__}: {first})", strict, depth=3)


def layout_problem(model: Any, memory_format: str) -> str | None:
    """Why `model` will not hit this pack's kernels for its layout, or None: the pack was built for a
    channels-last model (`memory_format`, the manifest's) and some 4-d weight (a convolution's) is not
    channels-last."""
    if memory_format != "channels_last" or not hasattr(model, "parameters"):
        return None
    weights = [p for p in model.parameters() if p.dim() == 4]
    if all(p.is_contiguous(memory_format=torch.channels_last) for p in weights):
        return None
    return ("this pack was built for a channels-last model, and this one is not: its kernels' guards "
            "will miss and stock PyTorch will run. Convert it once before serving: "
            "model = model.to(memory_format=torch.channels_last) (and its image inputs likewise)")


def _model_class() -> type | None:
    name = manifest().model_arch
    if not name:
        return None
    import transformers

    return getattr(transformers, name, None)


def _enable_graphs(model: Any, options: dict[str, Any]) -> None:
    from . import graphs as graphs_mod

    verdict = manifest().graphs
    # the verdict is about CUDA graphs; the emulation (backend="emulate", any device) replays recorded calls
    if verdict.enabled is False and options.get("backend") != "emulate":
        warnings.warn(f"{__name__}: graph mode is off for this model: {verdict.reason or 'no reason given'}",
                      RuntimeWarning, stacklevel=4)
        return
    target = model if model is not None else _model_class()
    if target is None:
        warnings.warn(f"{__name__}: graph mode needs activate(graphs=True, model=...) for this pack",
                      RuntimeWarning, stacklevel=4)
        return
    # A graph replays the kernels it was captured with: a new generation after every (de)activation
    # keys fresh graphs, so a stale one is never replayed.
    options.setdefault("context_key", lambda: (_STATE["generation"], _STATE["enabled"]))
    from . import serving

    serve = options.pop("serve", True)
    if serve and model is not None and serving.servable(model):
        serving.serve(model, **options)  # graph mode inside model.generate() (serving.py)
    elif model is None:
        # Every instance of the class: graph mode on its forward, and its generate() served on first call
        # (a causal LM only): the server needs an instance, so it is made there, with these options.
        graphs_mod.enable(target, **{k: v for k, v in options.items() if k not in serving.SERVE_OPTIONS})
        if serve:
            serving.serve_class(target, **options)
    else:
        graphs_mod.enable(target, **options)
        serving.compile_off(model)  # generate() would compile the graphed forward: the two would fight
    _STATE["graphs"] = True


def _activate(strict: bool) -> bool:
    reason, devices = environment_problem()
    if reason:
        return _refuse(reason, strict)
    if not _STATE["verified"]:
        bad = file_problem()  # before anything of the pack is loaded into the process
        if bad:
            return _refuse(bad, strict)
        _STATE["verified"] = True
    if _op_ids():
        if not _STATE["loaded"]:
            torch.ops.load_library(str(HERE / manifest().library))
            _STATE["loaded"] = True
        if list(_ops().variants()) != _op_ids():
            _STATE["mismatch"] = True  # its counters are not the manifest's variants': stats() reports none
            return _refuse("the shim's variants are not the manifest's", strict)
        _ops().activate(str(HERE), devices)
    fused = _fused()
    skipped = fused.activate(HERE, devices) if fused else {}
    if skipped:
        # Serving the op kernels without some of the module patches would be a pack other than the one
        # the gate passed (and another pack may hold those patches): all of it or none.
        _undo()
        off = "; ".join(f"{target}: {why}" for target, why in skipped.items())
        return _refuse(f"not activated, its fused kernels could not patch {off}", strict)
    _STATE["active"] = True
    _STATE["generation"] += 1
    _LOG.info("%s: active, %d kernels", __name__, len(variant_ids()))
    return True


def warmup(model: Any, batch_sizes=None, prompt_lengths=(16,), max_new_tokens=(64,), shapes=None,
           **options: Any) -> dict:
    """Capture `model.generate()`'s graphs for these buckets before the first request (see serving.py);
    returns the server's `stats()`."""
    from . import serving

    return serving.warmup(model, batch_sizes, prompt_lengths, max_new_tokens, shapes, **options)


def deactivate() -> None:
    """Remove the overrides: every op dispatches to the kernel it had before `activate()`."""
    with _LOCK:
        if _STATE["graphs"]:
            from . import graphs as graphs_mod
            from . import serving

            serving.stop_all()  # generate() is the model's own again
            serving.stop_classes()  # and every served class's
            serving.compile_back_all()  # and transformers' compile as the model had it
            graphs_mod.disable_all()  # before the kernels go: a graph would replay them
            _STATE["graphs"] = False
        _undo()
        _STATE["active"] = False
        _STATE["generation"] += 1


def _undo() -> None:
    if _STATE["loaded"] and not _STATE["mismatch"]:
        _ops().deactivate()
    if _STATE["fused"]:
        _STATE["fused"].deactivate()


def is_active() -> bool:
    return bool(_STATE["active"])


@contextlib.contextmanager
def active(strict: bool = False):
    """`with pack.active():` the pack's kernels inside the block (if it applies here), stock after."""
    was = is_active()
    activate(strict=strict)
    try:
        yield
    finally:
        if not was:
            deactivate()


def stats() -> dict[str, dict[str, Any]]:
    """Per variant: its op, `hits` (calls its kernel served), `misses` (calls of its op it did not
    serve), `errors` (calls its kernel refused, served by stock). A variant kept for a sub-range of its
    family also has `served` (that sub-range) and `outside` (misses inside its verified range but outside
    the sub-range: stock served them because the kernel does not pay there). Counters live as long as
    the process."""
    info = _readable_manifest()
    variants = info.variants if info is not None else ()
    ops = list(dict.fromkeys(v.op for v in variants))
    n = len(variants)
    # Before a load, or when the loaded shim is not the manifest's (refused), nothing has served a call.
    counted = _STATE["loaded"] and not _STATE["mismatch"]
    raw = list(_ops().stats()) if counted else [0] * (3 * n + len(ops))
    calls = dict(zip(ops, raw[3 * n:], strict=True))
    out = {}
    for k, v in enumerate(variants):
        hits, errors = raw[k], raw[n + k]
        out[v.id] = {"op": v.op, "hits": hits, "misses": calls[v.op] - hits, "errors": errors}
        if v.served:  # a kernel kept for a sub-range: the misses stock served because it does not pay there
            out[v.id]["outside"] = raw[2 * n + k]
            out[v.id]["served"] = v.served
    if _STATE["fused"]:  # only once read: a refused activate() may have refused an unreadable pack
        out.update(_STATE["fused"].stats())
    return out


def record_misses():
    """`with pack.record_misses() as rec:` the calls of the ops the pack overrides that no kernel served
    inside the block, by signature: `rec.top(20)`, `rec.hits`, `rec.misses`, `rec.table()` (misses.py;
    `fold=True` to either: the views a decode takes of a growing tensor, one row for all its steps).
    The pack must be active; its fused module sites keep serving under the recorder."""
    if not is_active():
        raise PackError(f"{__name__} is not active; activate() before record_misses()")
    from . import misses

    variants: dict[str, list[int]] = {}
    for k, v in enumerate(manifest().variants):  # a variant's hit counter is stats()[k]
        variants.setdefault(v.op, []).append(k)
    counters = _ops().stats.default if variants else list  # a pack of fused kernels only has no shim
    return misses.MissRecorder({op: tuple(ks) for op, ks in variants.items()}, counters)


def enable_only(ids: set[str] | None) -> None:
    """Serve only these variants (None: all). For ablation in forgepack's end-to-end gate."""
    fused = _fused()
    if not _STATE["loaded"] and not (fused and fused.loaded):
        raise PackError(f"{__name__} is not loaded; activate() first")
    if _STATE["loaded"]:
        _ops().set_enabled([1 if ids is None or i in ids else 0 for i in _op_ids()])
    if fused:
        fused.enable_only(ids)
    # a graph holds the kernels it was captured with: graphs are keyed by the enabled set too
    _STATE["enabled"] = None if ids is None else tuple(sorted(ids))
