"""Kernel packs: the wheel builder, the guarded dispatch shim's code generation, the end-to-end gate.

`build_pack(workspace, recipe, margin, gate, out_dir) -> PackResult` is the entry point (`forgepack
build` calls it last). `forgepack/runtime/` holds the files copied into every pack; they import nothing of
forgepack.
"""

from __future__ import annotations

from forgepack.pack.builder import Decision, PackResult, build_pack

__all__ = ["Decision", "PackResult", "build_pack"]
