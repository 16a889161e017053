"""Profile: where a model's time goes on this device, per variant and end to end.

Per variant: eager time of one call measured in isolation (device events, warm-up, L2 flushed before
each repetition, median) on the captured inputs; bytes, FLOPs and roofline time on the measured device
ceilings; baseline class from the device kernels the profiler saw for that call (`vendor`: cuBLAS,
cuDNN, flash/cutlass; `native`: PyTorch's own; `view`: no kernel). End to end: median forward time,
and the GPU-busy fraction (device kernel time over wall time) that says when a model is launch-bound.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from forgepack import capture as capture_mod
from forgepack import devices, families, fusion, opcall, roofline, samples, timing
from forgepack.cards import Card, Profile, variant_id
from forgepack.models import LoadedModel
from forgepack.recipe import Recipe
from forgepack.runtime import stockcall
from forgepack.workspace import Workspace

VENDOR_KERNELS = re.compile(r"gemm|cublas|cutlass|cudnn|flash|fmha|xmma|nvjet|sm\d+_|wgmma|cusparse|cufft", re.I)
CPU_VENDOR_OPS = {"mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "mkldnn_convolution",
                  "_scaled_dot_product_flash_attention_for_cpu", "_addmm_activation"}


@dataclass(frozen=True)
class ModelProfile:
    recipe: str
    device: str
    arch: str | None
    e2e_ms: float
    gpu_busy: float | None  # device kernel time / wall time of one forward; None on cpu
    kernel_ms: float | None
    aten_calls: int
    variants: int
    op_time_ms: float  # summed isolated time of every call
    diagnosis: str
    torch_version: str
    date: str
    recipe_fingerprint: str = ""
    # what the loader resolved from the model argument, so a directory or hub id's guess is visible
    task: str = ""
    model_class: str = ""
    dtype: str = ""
    shapes: str = ""  # the example inputs' shapes, `name=AxB` each
    # decode recipes: the served decode step's launches per (batch, cache) point, stock and with every
    # block found there; and the linear groups and attentions that made no block, with why
    decode_launches: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    blocks_skipped: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def classify(op_name: str, kernels: list[str], device_type: str, is_view: bool) -> str:
    """Baseline class of a variant from the kernels one call launched (cuda) or the op (cpu)."""
    if device_type == "cuda":
        if not kernels:
            return "view"
        return "vendor" if any(VENDOR_KERNELS.search(k) for k in kernels) else "native"
    if is_view:
        return "view"
    return "vendor" if op_name.split(".")[0] in CPU_VENDOR_OPS else "native"


def is_view_op(card: Card) -> bool:
    func = stockcall.resolve(card.op)
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def aliases_input(fn: Callable[[], Any], inputs: list) -> bool:
    """Whether every output shares storage with an input (`_unsafe_view` is a view its schema hides)."""
    outputs = stockcall.flatten_outputs(fn())
    storages = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
    return bool(outputs) and all(o.untyped_storage().data_ptr() in storages for o in outputs)


def diagnose(gpu_busy: float | None, e2e_ms: float, op_ms: float, cards: list[Card]) -> str:
    """One line: what would move this model's end-to-end time most."""
    by_class: dict[str, float] = {}
    for c in cards:
        by_class[c.profile.baseline] = by_class.get(c.profile.baseline, 0.0) + c.profile.share
    vendor = by_class.get("vendor", 0.0)
    if gpu_busy is not None and gpu_busy < 0.6:
        return (f"launch-bound: the GPU is busy {gpu_busy:.0%} of the forward; fewer launches (fusion, graph mode) "
                "pay more than faster kernels")
    if gpu_busy is None and op_ms < 0.6 * e2e_ms:
        return (f"overhead-bound: isolated op time is {op_ms / e2e_ms:.0%} of the forward; dispatch and Python "
                "overhead dominate, so fusion pays more than faster kernels")
    if vendor >= 0.5:
        return f"vendor-bound: {vendor:.0%} of op time is in vendor kernels (matmul/conv), which are rarely beaten"
    return f"kernel-bound in native ops ({by_class.get('native', 0.0):.0%} of op time): faster kernels pay directly"


def _call(card: Card, inputs: list, device: torch.device) -> Callable[[], Any]:
    func = stockcall.resolve(card.op)
    args, kwargs = opcall.call_args(card, inputs, device)
    return lambda: func(*args, **kwargs)


def _inputs_for(card: Card, sets: list, device: torch.device) -> list:
    if sets:
        metas = card.tensor_inputs()
        pairs = zip(metas, sets[0][0], strict=True)
        return [None if m is None else samples.materialize(m, t, device) for m, t in pairs]
    return samples.fresh_inputs(card, seed=0, device=device)


def measure_card(card: Card, sets: list, device: torch.device, facts: devices.DeviceFacts,
                 classify_it: bool = True) -> Profile:
    """Time one variant in isolation and place it on the roofline; a call that fails has no time.

    The kernels a call launches (its baseline class) come from a profiler session, which costs more
    than the timing itself on a GPU: a view by schema launches none and skips it, and so does a family
    member other than the one whose class the family takes (`classify_it=False`)."""
    roof = roofline.roofline(card, facts)
    reps = 20 if device.type == "cuda" else 7
    view = is_view_op(card)
    try:
        inputs = _inputs_for(card, sets, device)
        fn = _call(card, inputs, device)
        view = view or aliases_input(fn, inputs)
        eager_us = timing.median(timing.time_us(fn, device, reps=reps, warmup=2))
        named = device.type == "cuda" and classify_it and not view
        kernels = devices.kernel_names(fn) if named else []
    except (RuntimeError, IndexError, ValueError, TypeError):
        eager_us, kernels = 0.0, []
    baseline = classify(card.op_name, kernels, device.type, view)
    return Profile(
        eager_us=eager_us,
        total_us=eager_us * card.calls,
        bytes=roof.bytes,
        flops=roof.flops,
        roofline_us=roof.us,
        headroom=eager_us / roof.us if roof.us > 0 else 1.0,
        baseline=baseline,
        kernels=tuple(dict.fromkeys(kernels))[:4],
    )


MAX_TIMED_POINTS = 8  # a family's points timed one by one; the rest are scaled from the nearest by bytes


def measure_family(card: Card, sample_map: dict[str, list], device: torch.device,
                   facts: devices.DeviceFacts) -> Card:
    """A family card with its envelope-weighted profile: each member at a captured point timed (or, past
    `MAX_TIMED_POINTS`, its time scaled by bytes from the nearest timed one), weighted by the calls capture
    saw there. `Family.point_weights`: each point's share of the family's time; the card's `Profile` is the
    per-call figure over the envelope (`total_us` = sum of calls x time), so the share the allocator reads
    is the family's share of the envelope's time, not of one shape's."""
    family = card.family
    members = [dataclasses.replace(m, calls=n) for m, n in
               zip(families.members_at_points(card), family.point_calls, strict=True)]
    by_bytes = sorted(range(len(members)), key=lambda i: roofline.roofline(members[i], facts).bytes)
    step = max(1, -(-len(members) // MAX_TIMED_POINTS))
    timed_idx = set(by_bytes[::step]) | {by_bytes[-1]}
    rep_idx = max(sorted(timed_idx), key=lambda i: family.point_calls[i])  # the point whose class the family takes
    timed = {i: measure_card(members[i], sample_map.get(members[i].id, []), device, facts, classify_it=i == rep_idx)
             for i in timed_idx}
    profiles = [timed.get(i) or _scaled(members[i], timed, facts) for i in range(len(members))]
    points = list(zip(family.point_calls, profiles, strict=True))
    profile, weights = families.summed_profile(points, timed[rep_idx])
    return dataclasses.replace(card, family=dataclasses.replace(family, point_weights=weights), profile=profile)


def _scaled(member: Card, timed: dict[int, Profile], facts: devices.DeviceFacts) -> Profile:
    roof = roofline.roofline(member, facts)
    near = min(timed.values(), key=lambda p: abs(p.bytes - roof.bytes))
    eager = near.eager_us * roof.bytes / near.bytes if near.bytes else near.eager_us
    return dataclasses.replace(near, eager_us=eager, total_us=eager * member.calls, bytes=roof.bytes,
                               flops=roof.flops, roofline_us=roof.us,
                               headroom=eager / roof.us if roof.us > 0 else 1.0)


def capture_envelope(lm: LoadedModel, note: Callable[[str, int, int], None],
                     per_point: list | None = None) -> capture_mod.Capture:
    """Capture every point of a serving envelope (each prepared outside the capture) and fold the variants
    that differ only in sizes into family cards; a family keeps its most-called member's samples.
    `per_point`, if given, receives each point's own capture (with its dataflow: fusion chains are
    found in it), a callable that runs the point again, and its prompt length (0 if none)."""
    caps = []
    functions = fusion.function_sites(lm.model)
    for i, point in enumerate(lm.points):
        note("capturing " + " ".join(f"{k} {v}" for k, v in point.sizes if v), i, len(lm.points))
        go = point.prepare()
        caps.append(capture_mod.capture(lm.model, go, functions=functions))
        if per_point is not None:
            per_point.append((caps[-1], go, dict(point.sizes).get("seq_len", 0)))
    merged = capture_mod.merge(caps)
    folded = families.fold(merged.cards)
    sample_map = {c.id: merged.samples.get(variant_id(c.op, c.args) if c.family else c.id, []) for c in folded}
    return capture_mod.Capture(folded, sample_map, [], merged.total_calls)


def _with_shares(cards: list[Card]) -> list[Card]:
    total = sum(c.profile.total_us for c in cards) or 1.0
    return [c.with_profile(dataclasses.replace(c.profile, share=c.profile.total_us / total)) for c in cards]


def end_to_end(lm: LoadedModel, reps: int) -> float:
    def step():
        with torch.inference_mode():
            lm.model(**lm.inputs)
        lm.reset()

    return timing.median(timing.time_us(step, lm.device, reps=reps, warmup=3, flush=False)) / 1e3


def kernel_time_ms(lm: LoadedModel) -> float:
    """Device kernel time of one forward, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        lm.run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels if e.device_time > 0) / 1e3


def recipe_fingerprint(recipe: Recipe) -> str:
    """What determines a profile: everything but the build settings."""
    import hashlib
    import json

    from forgepack.recipe import to_dict

    data = {k: v for k, v in to_dict(recipe).items() if k != "build"}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_profile(recipe: Recipe, workspace: Workspace, progress: Callable[[str, int, int], None] | None = None,
                loaded: LoadedModel | None = None):
    """Load (unless `loaded`), time end to end, capture, time every variant, write the workspace.

    End to end is timed first, on the freshly warmed model: the capture's hooks and the profiler's
    CUPTI callbacks come later and cannot slow it down. Returns (ModelProfile, cards).
    """
    from forgepack import models

    note = progress or (lambda *_: None)
    note("loading model", 0, 1)
    with models.quiet_transformers():
        lm = loaded or models.load(recipe)
        lm.run()  # warm-up: lazy initialisation (caches, kernels) is not the model's work
        note("end to end", 0, 1)
        e2e_ms = end_to_end(lm, 30 if lm.device.type == "cuda" else 10)
        per_point: list = []
        if lm.points:
            cap = capture_envelope(lm, note, per_point)
        else:
            # the forward alone: resetting the cache is not its work; hot free functions recorded for fusion
            cap = capture_mod.capture(lm.model, lm.forward, functions=fusion.function_sites(lm.model))
            lm.reset()
    facts = devices.facts(lm.device)
    profiled = []
    for i, card in enumerate(cap.cards):
        note(f"timing {card.op_name}", i, len(cap.cards))
        if card.family is not None:
            profiled.append(measure_family(card, cap.samples, lm.device, facts))
        else:
            profiled.append(card.with_profile(measure_card(card, cap.samples[card.id], lm.device, facts)))
    cards = _with_shares(profiled)

    def forward_once():
        out = lm.forward()
        lm.reset()
        return out

    with models.quiet_transformers():
        # fusion chains come from one shape's dataflow: an envelope's come from each point's own capture
        if lm.points:
            note("fusion chains at each capture point", 0, 1)
            fused = fusion.build_points(lm.model, per_point, lm.device, facts, cards)
        else:
            fused = fusion.build(lm.model, forward_once, cap, lm.device, facts, cards)
    cap.samples.update(fused.samples)
    decoded = _decode_blocks(lm, facts, cards, note)
    if decoded is not None:
        cap.samples.update(decoded.samples)
    kernel_ms = kernel_time_ms(lm) if lm.device.type == "cuda" else None
    busy = min(1.0, kernel_ms / e2e_ms) if kernel_ms is not None else None
    op_ms = sum(c.profile.total_us for c in cards) / 1e3
    result = ModelProfile(
        recipe=recipe.name,
        device=facts.summary(),
        arch=facts.arch,
        e2e_ms=e2e_ms,
        gpu_busy=busy,
        kernel_ms=kernel_ms,
        aten_calls=cap.total_calls,
        variants=len(cards),
        op_time_ms=op_ms,
        diagnosis=diagnose(busy, e2e_ms, op_ms, cards),
        torch_version=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        recipe_fingerprint=recipe_fingerprint(recipe),
        task=lm.recipe.workload.task,
        model_class=type(lm.model).__name__,
        dtype=str(lm.dtype).removeprefix("torch."),
        shapes=input_shapes(lm.inputs),
        decode_launches={k: list(v) for k, v in decoded.launches.items()} if decoded else {},
        blocks_skipped=sorted({f"{s.where}: {s.reason}" for s in decoded.skipped}) if decoded else [],
    )
    block_cards = decoded.cards if decoded else []
    return result, _write(workspace, recipe, result, cards + fused.cards + block_cards, cap)


def _decode_blocks(lm, facts, op_cards: list[Card], note):
    """The decode blocks of a causal LM served step by step from a static cache (a decode recipe with
    `static_cache`, or a generate envelope): `blocks.build`; None for any other recipe."""
    from forgepack import blocks, models

    w = lm.recipe.workload
    served = (w.phase == "decode" and w.static_cache) or w.phase == "generate"
    if not served or w.task != "causal-lm":
        return None
    with models.quiet_transformers():
        return blocks.build(lm.model, lm.recipe, lm.device, facts, op_cards, note)


def input_shapes(inputs: dict[str, Any]) -> str:
    """`name=AxB` for every tensor input, in the order the model receives them."""
    return " ".join(f"{k}={'x'.join(map(str, v.shape))}" for k, v in inputs.items() if isinstance(v, torch.Tensor))


def _write(workspace: Workspace, recipe: Recipe, result: ModelProfile, cards: list[Card], cap) -> list[Card]:
    workspace.create()
    workspace.save_recipe(recipe)
    saved = []
    for card in cards:
        kept = samples.save_samples(workspace.sample_path(card.id), cap.samples[card.id])
        saved.append(dataclasses.replace(card, samples=kept))
        workspace.save_card(saved[-1])
    workspace.write_json("profile.json", result.to_json())
    return saved


def load_profile(workspace: Workspace) -> ModelProfile | None:
    if not workspace.profile_path.exists():
        return None
    return ModelProfile(**workspace.read_json("profile.json"))


def operators_and_chains(cards: list[Card]) -> tuple[list[Card], list[Card]]:
    """(operator cards, fusion chain cards), each largest share first. Operator shares add up to the
    whole; a chain's share overlaps the operator calls it replaces, so the two are shown apart."""
    ranked = sorted(cards, key=lambda c: -(c.profile.share if c.profile else 0.0))
    return [c for c in ranked if c.kind != "fusion"], [c for c in ranked if c.kind == "fusion"]


def top_share(cards: list[Card], n: int) -> list[Card]:
    ranked = sorted(cards, key=lambda c: -c.profile.share)
    return ranked[:n]


def headroom_text(card: Card) -> str:
    h = card.profile.headroom
    return "-" if not math.isfinite(h) or card.profile.baseline == "view" else f"{h:.1f}x"
