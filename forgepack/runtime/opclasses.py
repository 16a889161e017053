"""Classes of aten ops that graph capture and fusion both need to know, by schema name ("aten::item").

- `HOST_SYNC_OPS`: the host must read the result (a sync under CUDA), or the output's shape depends on
  data. A CUDA graph cannot capture them (the emulated backend refuses them, `host_sync`); fusion
  does not fuse a chain holding one.
- `NO_KERNEL_OPS`: bare allocations, which launch nothing (not counted as launches, not replayed).

Part of the pack runtime (the lowest layer): the build side imports it from here.
"""

from __future__ import annotations

from typing import Any

import torch

# Ops whose result the host must read (a sync under CUDA) or whose output shape depends on data.
HOST_SYNC_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::nonzero",
    "aten::nonzero_numpy", "aten::argwhere", "aten::masked_select", "aten::unique", "aten::_unique",
    "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive",
    "aten::bincount", "aten::_assert_scalar",
})
# Ops that launch no kernel: bare allocations.
NO_KERNEL_OPS = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
                           "aten::new_empty_strided"})


def host_sync(func: Any, args: tuple, kwargs: dict) -> str:
    """Why this aten call would need the host to read device data ('' if it would not)."""
    name = func._schema.name
    if name in HOST_SYNC_OPS:
        return name
    if name == "aten::repeat_interleave" and kwargs.get("output_size") is None and isinstance(args[0], torch.Tensor):
        return name + " without output_size"
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
            return name + " with a boolean mask"
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.Tensor) and arg.device.type == "cpu" and arg.dim() == 0 and any(
            isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args
        ):
            return name + " with a CPU scalar tensor next to CUDA tensors"
    return ""


def needs_decompose(func: Any) -> bool:
    """A composite op with no backend kernel of its own (`linear`, `layer_norm` under inference_mode):
    recorders take its parts instead, the calls a backend override or a chain can be matched against."""
    name = func.name()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    if not has(name, "CompositeImplicitAutograd"):
        return False
    return not any(has(name, key) for key in ("CPU", "CUDA", "CompositeExplicitAutograd"))
