"""The end-to-end gate over a phase-generate envelope: a decode-only family kernel (the KV cache's cat,
which only generate()'s decode steps call) is used, checked on generate()'s tokens and timed over whole
generate() calls. The gate used to run only the representative prefill, where no decode family fires,
and dropped such a kernel as "never used".

The staged pack holds the real size-generic cat kernel, verified over its family's range; the model and
pack are real, the clock is deterministic (it charges each kernel hit, as `test_pack_gate` does)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from pack_kernels import _record

from forgepack import familyeval, models, profile, samples, tomlwriter
from forgepack import recipe as recipe_mod
from forgepack.accepted import save_all
from forgepack.evaluate import Evaluator
from forgepack.pack import builder
from forgepack.templates import by_name
from forgepack.workspace import Workspace

TINY = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128}
REPO = Path(__file__).resolve().parent.parent

_CLOCKED = r"""
import json, random, sys
sys.path.insert(0, sys.argv[1])
import forgepack_pack_tiny_gen as pack
from forgepack import models, recipe as recipe_mod
from forgepack.pack import gate

class HitClock:
    '''Each timed run costs 10 ms, `save` ms less per hit of the pack's kernels, +-0.5% jitter.'''
    def __init__(self, save):
        self.save, self.t, self.calls, self.rng, self.before = save, 0.0, 0, random.Random(0), 0
    def hits(self):
        return sum(v["hits"] for v in pack.stats().values())
    def __call__(self):
        self.calls += 1
        if self.calls % 2:
            self.before = self.hits()
            return self.t
        ms = 10.0 - self.save * (self.hits() - self.before)
        self.t += ms * (1 + self.rng.uniform(-0.005, 0.005)) / 1e3
        return self.t

with models.quiet_transformers():
    lm = models.load(recipe_mod.load(sys.argv[2]))
    pack.activate(strict=True)
    before = sum(v["hits"] for v in pack.stats().values())
    lm.run()  # the representative prefill alone: what the gate used to run
    prefill_hits = sum(v["hits"] for v in pack.stats().values()) - before
    outcome = gate.evaluate(lm, pack, "full", rounds=5, reps=1, clock=HitClock(0.2))
print(json.dumps({"prefill_hits": prefill_hits, "outcome": outcome.to_json()}))
"""


def test_the_gate_of_a_generate_envelope_uses_checks_and_times_decode_kernels(tmp_path):
    r = recipe_mod.from_dict({"name": "tiny-gen", "model": {"arch": "LlamaForCausalLM", "config": TINY},
                              "workload": {"phase": "generate", "batch": {"min": 1, "max": 2},
                                           "seq_len": {"min": 4, "max": 9}, "new_tokens": 3},
                              "target": {"device": "cpu"}})
    with models.quiet_transformers():
        cap = profile.capture_envelope(models.load(r), lambda *_: None)
    ws = Workspace(tmp_path / "ws").create()
    ws.save_recipe(r)
    for card in cap.cards:
        ws.save_card(dataclasses.replace(card, samples=samples.save_samples(ws.sample_path(card.id),
                                                                             cap.samples[card.id])))
    cat = next(c for c in cap.cards if c.op == "aten.cat.default" and c.family is not None
               and any(d.derived for d in c.family.dims) and c.tensor_inputs()[0].dtype == "float32")
    t = by_name("elementwise.cat")
    source = t.render(cat, "cpu", t.default(cat, "cpu"))
    with Evaluator("cpu") as evaluator:
        verdict = familyeval.evaluate(evaluator, cat, source, bench=False)
    assert verdict.accepted, verdict.reason
    record = _record(ws, cat, source, verdict.binary, verdict.source_hash, 2.0, 1.5, 2.5, 1.0, 0.5,
                     proposer="templates")
    save_all(ws.root, [dataclasses.replace(record, needs=t.needs(cat, "cpu", {}))])
    chosen, dropped = builder.select(ws, r, margin=-0.99)
    assert [c.card.id for c in chosen] == [cat.id], dropped
    builder.stage(ws, r, chosen, tmp_path / "stage", "0.0.1", "pending")
    path = tmp_path / "tiny-gen.toml"
    path.write_text(tomlwriter.dumps(recipe_mod.to_dict(r)))
    proc = subprocess.run([sys.executable, "-c", _CLOCKED, str(tmp_path / "stage"), str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900, check=False,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["prefill_hits"] == 0  # the decode cache's cat: no call in the representative prefill
    outcome = out["outcome"]
    assert outcome["kept"] == [cat.id], outcome["dropped"]
    assert outcome["hits"][cat.id] > 0
    assert "generate() gives stock's 3 tokens" in outcome["outputs"]["note"]
    assert outcome["summary"]["pays"] and outcome["summary"]["timed_under"] == "eager"
