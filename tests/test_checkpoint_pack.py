"""An exact-shape CPU pack built from a checkpoint on disk serves the model it was built from.

`from_pretrained` leaves a checkpoint's weights where the safetensors file puts them: Qwen2's biases
shift what follows them, and its RMSNorm weights sit at 8 mod 16 bytes. The guard of an exact kernel
checked each input at the offset modulo 16 bytes its verification used (16-byte-aligned buffers), so
the fused RMSNorm of a CPU pack missed every call in its own model, at its own shape (issue 20's third
finding, still true of exact packs after the envelope work). A CPU render is plain loops: its template
states element alignment, the search verifies the accepted kernel with its inputs moved one element
along, and the guard then admits such a weight. Built through the CLI, imported from the wheel in a
fresh process; the logits are compared with stock's, not only counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_envelope_e2e import build_pack

REPO = Path(__file__).resolve().parent.parent
SHAPE = '''
[workload]
task = "causal-lm"
phase = "prefill"
batch = 1
seq_len = 24
dtype = "float32"

[target]
device = "cpu"

[build]
budget = 6
proposer = "templates"
margin = -0.99
gate = false
'''

MAIN = r"""
import json, sys
import torch
from forgepack import models, recipe
import PACKAGE as pack
with models.quiet_transformers():
    lm = models.load(recipe.load(RECIPE_PATH))
norm = lm.model.model.layers[0].input_layernorm.weight
with torch.no_grad():
    stock = lm.run().logits.clone()
    assert pack.activate()
    served = lm.run().logits.clone()
    pack.deactivate()
err = ((served - stock).abs().max() / stock.abs().max()).item()
print(json.dumps({"norm_mod_16": norm.data_ptr() % 16, "err": err, "stats": pack.stats()}))
"""


@pytest.mark.slow
def test_an_exact_cpu_pack_serves_its_own_checkpoints_weights_at_8_mod_16(tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    from heldout_models import save

    path = tmp_path / "qwen2.toml"
    path.write_text(f'name = "qwen2-checkpoint"\n\n[model]\npath = "{save(tmp_path, "tiny-qwen2")}"\n' + SHAPE)
    site, package, env = build_pack(tmp_path, path, timeout=1200)
    code = MAIN.replace("PACKAGE", package).replace("RECIPE_PATH", repr(str(path)))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**env, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert res["norm_mod_16"] == 8  # what this test is about: the weight where from_pretrained left it
    norm = next(s for s in res["stats"].values() if s["op"] == "fusion.rmsnorm.default")
    assert norm["hits"] == 5 and norm["misses"] == 0 and norm["errors"] == 0, res["stats"]  # 2 layers x 2 + final
    assert res["err"] < 1e-5, res["err"]
