"""Kernel packs: the wheel builder, the guarded dispatch shim's code generation, the end-to-end gate.

`builder.build_pack(workspace, recipe, margin, gate, out_dir) -> PackResult` is the entry point
(`forgepack build` calls it last). `forgepack/runtime/` holds the files copied into every pack; they
import nothing of forgepack. This file imports nothing: importing one submodule (the manifest, say)
does not load the builder, the gate and the shim generator.
"""
