"""Encode an aten call's arguments into a card, and call the stock op again from a card (an operator
card's op; a fusion card's chain of aten calls, replayed by a `ChainPlan`).

Capture encodes every schema argument (defaults filled in) so that a variant is the full signature;
the verifier, the profiler and the pack's self-test decode them to call `torch.ops.aten` again,
through the runtime's one decoder (`forgepack.runtime.stockcall`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from forgepack.cards import Arg, Card
from forgepack.runtime import stockcall
from forgepack.runtime.modules import STEP_SITE


def is_tensor_list(value: Any) -> bool:
    return isinstance(value, list | tuple) and len(value) > 0 and all(isinstance(v, torch.Tensor) for v in value)


def call_args(card: Card, tensors: list[torch.Tensor | None], device: torch.device | str) -> tuple[list, dict]:
    """Positional and keyword arguments to call the card's op with these tensor inputs (ABI order)."""
    return stockcall.call_args(stockcall.resolve(card.op), recorded(card.args), tensors, torch.device(device))


def recorded(args: tuple[Arg, ...]) -> list[stockcall.Recorded]:
    """A card's arguments as the stock-call decoder reads them."""
    return [(a.kind, len(a.tensors), a.value) for a in args]


def run_stock(card: Card, tensors: list[torch.Tensor | None], device: torch.device | str) -> list[torch.Tensor]:
    """Call the stock aten op; outputs as a flat list of tensors (ABI output order). A fusion card's
    stock is its chain of aten calls, replayed (`run_chain`)."""
    return stock_call(card, tensors, device)()


def run_wide(card: Card, tensors: list[torch.Tensor | None], device: torch.device | str) -> list[torch.Tensor]:
    """`run_stock` for float64 inputs: a fused attention (cuDNN, flash, memory-efficient), which has no
    float64 kernel, runs as the math attention it stands for. The verifier's exact reference: cuDNN's
    attention drifts from the exact result on large query and key values (pytorch#139298), so without
    one a kernel more accurate than stock there would be judged against stock's error."""
    if card.kind == "fusion":
        return ChainPlan(card, torch.device(device), wide=True)(tensors)
    args, kwargs = call_args(card, tensors, device)
    func = _WIDE.get(card.op) or stockcall.resolve(card.op)
    return stockcall.flatten_outputs(func(*args, **kwargs))


def _math_attention(op: str) -> Callable:
    """The math attention, called with the arguments of the fused attention `op` (its output, its log-sum-exp
    left out: a fused op's other outputs are bookkeeping)."""
    names = [a.name for a in stockcall.resolve(op)._schema.arguments]

    def call(*args, **kwargs):
        bound = {**dict(zip(names, args, strict=False)), **kwargs}
        q, k, v = bound["query"], bound["key"], bound["value"]
        mask = bound.get("attn_bias", bound.get("attn_mask"))
        if mask is not None and mask.is_floating_point():  # a bias the chain made in the model's dtype
            mask = mask.to(q.dtype)
        out, _ = torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, mask, bound.get("dropout_p", 0.0), bound.get("is_causal", False), scale=bound.get("scale"),
            enable_gqa=q.shape[-3] != k.shape[-3])
        return (out,)

    return call


_WIDE = {op: _math_attention(op) for op in ("aten._scaled_dot_product_cudnn_attention.default",
                                           "aten._scaled_dot_product_efficient_attention.default",
                                           "aten._scaled_dot_product_flash_attention.default")
         if hasattr(torch.ops.aten, op.split(".")[1])}


def stock_call(card: Card, tensors: list[torch.Tensor | None], device: torch.device | str
               ) -> Callable[[], list[torch.Tensor]]:
    """A zero-argument callable running the card's stock computation on these inputs (arguments decoded
    once, outside the call: for timing); it returns the outputs as `run_stock` does."""
    if card.kind == "fusion":
        plan = chain_plan(card, torch.device(device))
        return lambda: plan(tensors)
    args, kwargs = call_args(card, tensors, device)
    func = stockcall.resolve(card.op)
    return lambda: stockcall.flatten_outputs(func(*args, **kwargs))


def served_stock_call(card: Card, tensors: list[torch.Tensor | None], device: torch.device | str
                      ) -> Callable[[], list[torch.Tensor]]:
    """`stock_call` as the model serves the stock computation, for timing it: a decode block's chain runs
    inside the decode loop's CUDA graph, so on CUDA it is timed as a graph replay. Replayed op by op from
    Python, a block of 20-odd launches costs the host's dispatch of each (the H100's Llama-1B qkv block
    read 20x dearer than its fused kernel, which served under the graph pays nothing of it); a chain that
    cannot be captured is timed as it replays."""
    call = stock_call(card, tensors, device)
    if card.kind != "fusion" or torch.device(device).type != "cuda" or card.fusion is None:
        return call
    if not any(site.kind == STEP_SITE for site in card.fusion.sites):
        return call
    return _graphed(call) or call


def _graphed(call: Callable[[], list[torch.Tensor]]) -> Callable[[], list[torch.Tensor]] | None:
    """`call` captured into a CUDA graph (warmed on a side stream first, as capture requires): a replay
    returns the outputs the capture allocated. None when the calls cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            call()
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = call()
    except RuntimeError:
        torch.cuda.synchronize()
        return None

    def replay() -> list[torch.Tensor]:
        graph.replay()
        return outputs

    return replay


# --- a fusion card's stock: its chain of aten calls, replayed ---------------------------------------


def run_chain(card: Card, tensors: list[torch.Tensor | None], device: torch.device | str | None = None
              ) -> list[torch.Tensor]:
    """Replay the chain with stock aten ops on these inputs (ABI order); its outputs, in order.

    An input the chain writes in place (`h += residual`) is cloned first, so the caller's tensors are
    never changed (the fused kernel does not change them either)."""
    if device is None:
        device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
    return chain_plan(card, torch.device(device))(tensors)


Layouts = list[tuple[tuple[int, ...], tuple[int, ...], int]]


def _meta_inputs(card: Card) -> list[torch.Tensor | None]:
    """The card's inputs on the meta device, in their exact layouts (no memory, no values)."""
    tensors = []
    for m in card.tensor_inputs():
        if m is None:
            tensors.append(None)
            continue
        base = torch.empty(m.storage_offset + m.span(), dtype=getattr(torch, m.dtype), device="meta")
        tensors.append(base.as_strided(m.shape, m.stride, m.storage_offset))
    return tensors


def _layouts(outs: list[torch.Tensor]) -> Layouts:
    return [(tuple(t.shape), tuple(t.stride()), t.storage_offset()) for t in outs]


def chain_layouts(card: Card) -> list[Layouts]:
    """Each chain entry's outputs as (sizes, strides, storage offset) at the card's input sizes: the chain
    replayed on the meta device (what a family member's chain looks like at sizes no capture saw)."""
    plan = ChainPlan(card, torch.device("meta"))
    return [_layouts(outs) for outs in plan.values(_meta_inputs(card))]


def output_layouts(card: Card) -> tuple[Layouts, list[str]]:
    """An operator card's outputs as the stock op lays them out at the card's input sizes, and their
    dtypes: the op run on the meta device. Raises what the op raises (sizes it refuses: RuntimeError;
    no meta kernel: NotImplementedError)."""
    args, kwargs = call_args(card, _meta_inputs(card), "meta")
    outs = stockcall.flatten_outputs(stockcall.resolve(card.op)(*args, **kwargs))
    return _layouts(outs), [str(t.dtype).removeprefix("torch.") for t in outs]


class ChainPlan:
    """A chain with its ops resolved and its non-tensor arguments decoded once, compiled into one
    straight-line Python function (a local per value, the ops and constants bound as names), so that a
    replay costs the aten calls and little else: the benchmark times a fusion kernel against it as the
    model's code runs the chain. Interpreting the chain instead (refs resolved per call, closures and
    lists per step) made the tiny Llama's act(gate) * up 10.2 us against 6.9 us as its module runs it."""

    def __init__(self, card: Card, device: torch.device, wide: bool = False):
        self.steps = []
        calls = []
        for entry in card.chain:
            func = stockcall.resolve(entry.op)
            positional, keyword = [], []
            for schema_arg, a in zip(func._schema.arguments, entry.args, strict=True):
                if a.kind == "tensor":
                    written = schema_arg.alias_info is not None and schema_arg.alias_info.is_write
                    item = ("ref", a.ref, written)
                elif a.kind == "tensors":
                    item = ("refs", a.refs, False)
                elif a.kind == "none":
                    item = ("const", None, False)
                else:
                    item = ("const", stockcall.decode_value(schema_arg, a.value, device), False)
                if schema_arg.kwarg_only:
                    keyword.append((schema_arg.name, item))
                else:
                    positional.append(item)
            self.steps.append((func, tuple(positional), tuple(keyword)))
            calls.append(_WIDE.get(entry.op, func) if wide else func)
        self.outputs = card.fusion.outputs
        self._replay = _compiled(self.steps, self.outputs, calls)

    def __call__(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor]:
        return self._replay(tensors)[2]  # an input written in place is a clone in the replay's inputs

    def values(self, tensors: list[torch.Tensor | None]) -> list[list[torch.Tensor]]:
        """Every chain entry's outputs, in chain order."""
        return self._run(tensors)[1]

    def _run(self, tensors: list[torch.Tensor | None]) -> tuple[list, list[list[torch.Tensor]]]:
        """(the inputs, an input the chain writes in place cloned first; every entry's outputs)."""
        inputs, values, _ = self._replay(tensors)
        return inputs, values


def _compiled(steps: list, outputs: tuple, calls: list) -> Callable[[list], tuple[list, list, list]]:
    """The chain as one function of its inputs: (inputs, every entry's outputs, the chain's outputs).

    Arguments are taken in order, each into a local, and an input an entry writes is cloned just
    before that argument is taken (the caller's tensors are never changed; an argument taken before it
    is the original). `calls`: what each step calls (its op, or a stand-in taking the op's arguments).
    Generated code names only locals, the ops and constants: no text of the card."""
    names: dict[str, Any] = {"_flat": stockcall.flatten_outputs}
    lines = ["def replay(tensors):", "    inputs = list(tensors)"]
    cloned: set[int] = set()

    def ref(r: tuple) -> str:
        return f"inputs[{r[1]}]" if r[0] == "in" else f"v{r[1]}[{r[2]}]"

    def take(item: tuple, local: str) -> str:
        kind, payload, written = item
        if kind == "const":
            names[local] = payload
            return local
        if kind == "refs":
            lines.append(f"    {local} = [{', '.join(ref(r) for r in payload)}]")
            return local
        if written and payload[0] == "in" and payload[1] not in cloned:
            lines.append(f"    inputs[{payload[1]}] = inputs[{payload[1]}].clone()")
            cloned.add(payload[1])
        lines.append(f"    {local} = {ref(payload)}")
        return local

    for p, (func, positional, keyword) in enumerate(steps):
        names[f"op{p}"] = calls[p]
        args = [take(item, f"a{p}_{k}") for k, item in enumerate(positional)]
        args += [f"{name}={take(item, f'k{p}_{k}')}" for k, (name, item) in enumerate(keyword)]
        call = f"op{p}({', '.join(args)})"
        returns = func._schema.returns
        single = len(returns) == 1 and str(returns[0].type) == "Tensor"
        lines.append(f"    v{p} = [{call}]" if single else f"    v{p} = _flat({call})")
    lines.append(f"    return inputs, [{', '.join(f'v{p}' for p in range(len(steps)))}], "
                 f"[{', '.join(ref(r) for r in outputs)}]")
    exec(compile("\n".join(lines), "<forgepack chain replay>", "exec"), names)  # the code built above
    return names["replay"]


_PLANS: dict[tuple[str, str], ChainPlan] = {}


def chain_plan(card: Card, device: torch.device) -> ChainPlan:
    """The card's replay plan (cached per card id and device: the id covers the whole chain)."""
    key = (card.id, str(device))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 256:
            _PLANS.clear()
        plan = _PLANS[key] = ChainPlan(card, device)
    return plan
