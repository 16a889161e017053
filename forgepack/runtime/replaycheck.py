"""Graph replay verification, at build time: replays against eager on fresh inputs (`verify_replay`,
`capture_safe_check`). The pack gate runs it and records the verdict in the manifest; a served pack
never imports this file.

Part of the pack runtime (shipped, so the gate checks the pack's own copy): torch and the standard
library only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .compare import outputs_mismatch, tensor_mismatch
from .graphkeys import HASHABLE, MAX_DEPTH, copy_outputs, first_line
from .graphs import DEFAULT_WARMUP, GraphedForward, eager_forward


def _as_call(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict):
        return tuple(inputs[0]), dict(inputs[1])
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


class _StateSnapshot:
    """Every tensor a call can write (its arguments, tensors held by argument objects, the module's
    buffers) and the attributes of argument objects, saved so that a call can be undone in place."""

    def __init__(self, args: tuple, kwargs: dict, module: torch.nn.Module | None):
        found: dict[int, torch.Tensor] = {}
        self.objects: dict[int, tuple[Any, dict]] = {}
        self._collect((args, kwargs), found, 0)
        if module is not None:
            for b in module.buffers():
                found.setdefault(id(b), b)
        self.tensors = list(found.values())
        self.saved = [t.detach().clone() for t in self.tensors]

    def _collect(self, x: Any, found: dict, depth: int) -> None:
        if depth > MAX_DEPTH or isinstance(x, torch.nn.Module):
            return
        if isinstance(x, torch.Tensor):
            found.setdefault(id(x), x)
        elif isinstance(x, (list, tuple)):
            for v in x:
                self._collect(v, found, depth + 1)
        elif isinstance(x, dict):
            for v in x.values():
                self._collect(v, found, depth + 1)
        elif getattr(x, "__dict__", None) is not None and not isinstance(x, (type, *HASHABLE)):
            if id(x) in self.objects:
                return
            self.objects[id(x)] = (x, dict(vars(x)))
            for v in vars(x).values():
                self._collect(v, found, depth + 1)

    def rebound(self) -> str:
        """Which argument object replaced a tensor it holds ('' if none did)."""
        for obj, attrs in self.objects.values():
            for name, value in attrs.items():
                if isinstance(value, torch.Tensor) and vars(obj).get(name) is not value:
                    return f"{type(obj).__name__}.{name}"
        return ""

    def current(self) -> list[torch.Tensor]:
        return [t.detach().clone() for t in self.tensors]

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in zip(self.tensors, self.saved, strict=True):
                t.copy_(saved)
        for obj, attrs in self.objects.values():
            state = vars(obj)
            state.clear()
            state.update(attrs)



def verify_replay(
    module: Any,
    make_inputs: Callable[[int], Any],
    n: int = 3,
    rtol: float | None = None,
    atol: float | None = None,
    *,
    warmup: int = DEFAULT_WARMUP,
    restore_state: bool = True,
    backend: str = "cuda",
    scale_rtol: float | None = None,
) -> tuple[bool, str]:
    """Replay against eager on fresh inputs: (ok, reason).

    `make_inputs(step)` gives step `step`'s arguments: a kwargs dict, an (args, kwargs) pair, or an args
    tuple; every step must have the same signature (same shapes; the same argument objects, e.g. one
    static cache). Steps 0..warmup-1 warm up, step `warmup` captures, and `n` more steps replay. In each
    step the eager forward runs first, then the call is undone in place (argument tensors, tensors of
    argument objects, the module's buffers, argument objects' attributes) and the graphed forward runs
    on the same state; outputs and resulting state must match (`rtol`/`atol`, defaults per dtype in
    `tolerances.REPLAY_TOLERANCES`; with `scale_rtol`, floating tensors within that fraction of their largest
    magnitude: the pack gate's model tolerance). With `restore_state` (default) every step starts from the state
    `make_inputs` left (decode: the same position every step); without it the graphed call's state
    carries into the next step (decode: positions advance; the cache needs room). Graphs are built in
    a private pool and freed; the module and its state are left as found.
    """
    fn = eager_forward(module)
    owner = module if isinstance(module, torch.nn.Module) else getattr(fn, "__self__", None)
    owner = owner if isinstance(owner, torch.nn.Module) else None
    pool = "private" if backend == "cuda" else None
    trial = GraphedForward(fn, max_graphs=1, warmup=warmup, pool=pool, backend=backend)
    first: _StateSnapshot | None = None
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="forgepack graph mode")  # the reason says it
            for step in range(warmup + 1 + n):
                args, kwargs = _as_call(make_inputs(step))
                snap = _StateSnapshot(args, kwargs, owner)
                first = first or snap
                why = _verify_step(fn, trial, args, kwargs, snap, step, restore_state,
                                   {"rtol": rtol, "atol": atol, "scale_rtol": scale_rtol})
                if why:
                    return False, why
        return True, f"replay matched eager on {n} fresh inputs after capture (warm-up {warmup})"
    except Exception as err:
        return False, f"error during verification: {first_line(err)}"
    finally:
        if first is not None:
            first.restore()
        trial.reset()
        if backend == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()  # the private pool's memory goes back


def _verify_step(fn, trial, args, kwargs, snap, step, restore_state, tol: dict) -> str:
    """One step of `verify_replay`: '' when graphed and eager agree, else why not."""
    keep = frozenset(snap.objects)
    expected = copy_outputs(fn(*args, **kwargs), keep)
    rebound = snap.rebound()
    if rebound:
        return f"the forward replaces tensors its arguments hold ({rebound}): not replayable"
    expected_state = snap.current()
    snap.restore()
    replays = trial.stats()["replays"]
    got = trial(*args, **kwargs)
    got_state = snap.current()
    if restore_state:
        snap.restore()
    phase = "warm-up" if step < trial.warmup else ("capture" if step == trial.warmup else "replay")
    if step >= trial.warmup and trial.stats()["replays"] == replays:
        return f"not graphed at step {step}: {_why_not_graphed(trial.stats())}"
    diff = outputs_mismatch(expected, got, keep, **tol)
    if diff:
        hint = " (two eager calls disagree: Python-side state?)" if phase == "warm-up" else ""
        return f"{phase} step {step}: {diff}{hint}"
    for i, (e, g) in enumerate(zip(expected_state, got_state, strict=True)):
        why = tensor_mismatch(e, g, **tol)
        if why:
            return f"{phase} step {step}: state tensor {i} {list(e.shape)} after the call: {why}"
    return ""


def _why_not_graphed(stats: dict) -> str:
    failures = list(stats["failures"].values())
    if failures:
        return failures[-1]
    reasons = [r for r in stats["reasons"] if r != "warm-up"]
    return reasons[-1] if reasons else "the signature changed between steps (a new argument object each step?)"


def capture_safe_check(fn: Any, args: tuple = (), kwargs: dict | None = None, n: int = 2,
                       rtol: float | None = None, atol: float | None = None,
                       backend: str = "cuda") -> tuple[bool, str]:
    """Build-time check: trial capture and replays of `fn(*args, **kwargs)` compared with eager on the
    same inputs. (False, reason) for host syncs, data-dependent control flow, illegal allocations, CPU
    tensors or any replay mismatch; the pack builder records the reason in the manifest."""
    kwargs = kwargs or {}
    return verify_replay(fn, lambda step: (args, kwargs), n=n, rtol=rtol, atol=atol, backend=backend)


