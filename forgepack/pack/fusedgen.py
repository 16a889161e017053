"""A pack's fused kernels: the C++ op the module patches call, `modules.json`, and their staging.

Fusion kernels replace module-level chains (`forgepack.fusion`); the pack runtime's module patches
(`runtime/modules.py`) call them through one op per pack, registered in the shim's namespace
(`TORCH_LIBRARY_FRAGMENT`, so it lives next to the operator shim's control ops, in the same library
or its own):

    <namespace>::fused(int site, Tensor[] inputs) -> Tensor[]
        tries the site's verified variants in order (most calls first): enabled, every input matching
        the variant's dtype, sizes, strides, device and the pointer alignment the kernel states
        (fp_guard.h `match`: the offset modulo 16 bytes it was verified at, or element alignment where
        it was verified there too) or, for a family variant, binding the family's dims (sizes in their served ranges,
        strides by their rules, the pointer alignment the kernel states: fp_guard.h `bind`), one
        device of the pack's arch, no autograd needed; on the first match it allocates the outputs
        from the variant's verified metadata (a family's at the bound dims), calls the kernel on the
        current stream and returns them. No match, or a kernel that returns nonzero: an empty list (the caller then runs
        the original forward).
    <namespace>::fused_load(str root, int[] devices) -> int      dlopen every kernel under root
    <namespace>::fused_stats() -> int[]                          [hits per variant..., errors per variant...]
    <namespace>::fused_set_enabled(int[] flags) -> int           one flag per variant (the gate's ablation)
    <namespace>::fused_variants() -> str[]                       variant ids, in table order

`modules.json` (read by `runtime/modules.PackModules`): namespace, target, the sites (patch target,
source digest, facts, call form, variant ids) and the variants (id, op, sites, kernel file).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forgepack import fusion
from forgepack import needs as needs_mod
from forgepack.cards import Card
from forgepack.needs import Align, Needs
from forgepack.pack import shimgen
from forgepack.runtime import modules as rt

SOURCE = "sources/fused.cpp"
LIBRARY = "shim/libforgepack_fused.so"
FORMAT = 1
MAX_INPUTS = 32


@dataclass(frozen=True)
class FusedVariant:
    card: Card
    kernel_file: str  # e.g. "kernels/fusion_rmsnorm-1a2b3c4d5e.so", relative to the package directory
    needs: Needs | None = None  # what the kernel states it needs (a family kernel's guard checks exactly that)

    def stated_needs(self) -> Needs:
        return self.needs if self.needs is not None else needs_mod.default(self.card)


def check_supported(card: Card, target: str) -> None:
    """Raise `shimgen.Unsupported` if the fused op cannot guard and serve this card."""
    if card.kind != "fusion" or not card.fusion or not card.fusion.sites:
        raise shimgen.Unsupported("not a fusion card with patch sites")
    device = "cuda" if target == "cuda" else "cpu"
    metas = card.tensor_inputs()
    if not metas or any(m is None for m in metas) or len(metas) > MAX_INPUTS:
        raise shimgen.Unsupported(f"fused kernels take 1 to {MAX_INPUTS} tensor inputs")
    for m in [*metas, *card.outputs]:
        shimgen._check_meta(m, device)
    if card.scalars():
        raise shimgen.Unsupported("a fusion card with scalars")


def unsupported_reason(card: Card, target: str) -> str | None:
    try:
        check_supported(card, target)
    except shimgen.Unsupported as err:
        return str(err)
    return None


def spec(variants: list[FusedVariant], namespace: str, target: str) -> dict[str, Any]:
    """The content of `modules.json` for these variants (in guard order within each site)."""
    sites, served = fusion.sites_of([v.card for v in variants])
    files = {v.card.id: v.kernel_file for v in variants}
    site_of: dict[str, list[int]] = {}
    for s in sites:
        for card in served[s.index]:
            site_of.setdefault(card.id, []).append(s.index)
    return {
        "format": FORMAT,
        "namespace": namespace,
        "target": target,
        "library": LIBRARY,
        "sites": [_site_json(s, served[s.index]) for s in sites],
        "variants": [{"id": v.card.id, "op": v.card.op, "signature": v.card.signature(), "calls": v.card.calls,
                      "sites": site_of[v.card.id], "kernel": files[v.card.id],
                      **_shapes(v.card)} for v in variants],
    }


def _site_json(site: rt.Site, cards: list[Card]) -> dict[str, Any]:
    """A site as modules.json holds it; a decode block's (kind "step") also holds its chain, which the
    decode loop matches in its recorded step (`runtime/stepprogram.Chain`): every card of the site has
    the same one (the site's digest is the chain's)."""
    doc = site.to_json()
    if site.kind == rt.STEP_SITE:
        card = cards[0]
        doc["form"] = {"chain": [e.to_json() for e in card.chain], "outputs": [list(r) for r in card.fusion.outputs],
                       "inputs": len(card.tensor_inputs()), "writes": list(card.fusion.writes)}
    return doc


def _shapes(card: Card) -> dict[str, Any]:
    """An exact variant's input sizes, for the runtime's quick size test (`runtime/modules.site_shapes`); a
    family variant lists none, so its site's calls all reach the guard, which binds the family's dims."""
    return {} if card.family is not None else {"shapes": [list(m.shape) for m in card.tensor_inputs()]}


def _variant_specs(k: int, v: FusedVariant) -> tuple[list[str], str]:
    """(constants, table entry) of variant k: exact tensor specs, or a family's specs, dim ranges and the
    check of its derived dims and the kernel's divisibility needs once every input bound its dims."""
    card = v.card
    n_in, n_out = len(card.tensor_inputs()), len(card.outputs)
    head = f"{shimgen.cpp_string(card.id)}, {shimgen.cpp_string(v.kernel_file)}"
    lines = [f"// variant {k}: {card.id}  {card.signature()}"]
    fam = card.family
    needs = v.stated_needs()
    needs_mod.validate(needs, card)
    if fam is None:
        for i, m in enumerate(card.tensor_inputs()):
            lines += shimgen._meta_constants(f"f{k}_in{i}", m, needs.align[i])
        for j, m in enumerate(card.outputs):
            lines += shimgen._meta_constants(f"f{k}_out{j}", m)
        lines.append(f"constexpr fpg::TensorSpec f{k}_ins[] = {{{', '.join(f'f{k}_in{i}' for i in range(n_in))}}};")
        lines.append(f"constexpr fpg::TensorSpec f{k}_outs[] = {{{', '.join(f'f{k}_out{j}' for j in range(n_out))}}};")
        return lines, f"{{{head}, f{k}_ins, {n_in}, f{k}_outs, {n_out}, nullptr, nullptr, nullptr, nullptr}},"
    lines.append(f"// family: {card.family_text()}")
    lines.append(shimgen.dim_ranges(f"f{k}_ranges", fam))
    for i, (m, layout) in enumerate(zip(card.tensor_inputs(), fam.inputs, strict=True)):
        lines += shimgen._family_constants(f"f{k}_in{i}", m, layout, fam, needs.align[i])
    for j, (m, layout) in enumerate(zip(card.outputs, fam.outputs, strict=True)):
        lines += shimgen._family_constants(f"f{k}_out{j}", m, layout, fam, Align())
    lines.append(f"constexpr fpg::FamilySpec f{k}_ins[] = {{{', '.join(f'f{k}_in{i}' for i in range(n_in))}}};")
    lines.append(f"constexpr fpg::FamilySpec f{k}_outs[] = {{{', '.join(f'f{k}_out{j}' for j in range(n_out))}}};")
    checks = shimgen._derive_checks(fam, "dv", f"f{k}_ranges") + shimgen._size_checks(card, needs, "dv")
    lines.append(f"bool f{k}_dims(int64_t* dv) {{ (void)dv; return {' && '.join(checks) or 'true'}; }}")
    return lines, f"{{{head}, nullptr, {n_in}, nullptr, {n_out}, f{k}_ins, f{k}_outs, f{k}_ranges, f{k}_dims}},"


def generate(variants: list[FusedVariant], namespace: str, target: str, title: str = "") -> str:
    """C++ source of the `fused` op (and its control ops) for these variants."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", namespace):
        raise ValueError(f"bad op namespace {namespace!r}")
    for v in variants:
        check_supported(v.card, target)
    doc = spec(variants, namespace, target)
    index = {v.card.id: k for k, v in enumerate(variants)}
    cuda = target == "cuda"
    lines = [
        f"// Fused kernels{' of ' + title if title else ''}: generated by forgepack.pack.fusedgen.",
        "// <ns>::fused(site, inputs) runs the first verified variant of the site whose guard matches.",
        '#include "fp_guard.h"',
        "",
        "#include <array>",
        "#include <string>",
        "#include <vector>",
        "",
        "namespace fpfused {",
        "",
        f"constexpr bool kCuda = {'true' if cuda else 'false'};",
        f"constexpr c10::DeviceType kDevice = c10::DeviceType::{'CUDA' if cuda else 'CPU'};",
        f"constexpr c10::DispatchKey kBackend = c10::DispatchKey::{'CUDA' if cuda else 'CPU'};",
        f"constexpr size_t kMaxInputs = {MAX_INPUTS};",
        "",
    ]
    table = []
    max_dims = max([len(v.card.family.dims) for v in variants if v.card.family is not None] + [1])
    lines.append(f"constexpr int kMaxDims = {max_dims};")
    for k, v in enumerate(variants):
        consts, row = _variant_specs(k, v)
        lines += consts
        table.append("    " + row)
    flat, begin = [], [0]
    for s in doc["sites"]:
        flat += [index[i] for i in s["variants"]]
        begin.append(len(flat))
    lines += [
        "",
        "struct Variant {",
        "  const char* id;",
        "  const char* kernel_file;",
        "  const fpg::TensorSpec* ins;",
        "  size_t n_in;",
        "  const fpg::TensorSpec* outs;",
        "  size_t n_out;",
        "  // a family variant: its specs (ins/outs are then null), dim ranges, derived dims and size needs",
        "  const fpg::FamilySpec* fins;",
        "  const fpg::FamilySpec* fouts;",
        "  const fpg::DimRange* ranges;",
        "  bool (*dims)(int64_t* dv);",
        "  std::atomic<fpg::KernelFn> fn{nullptr};",
        "  std::atomic<bool> enabled{true};",
        "  std::atomic<int64_t> hits{0};",
        "  std::atomic<int64_t> errors{0};",
        "};",
        "",
        "Variant variants[] = {",
        *table,
        "};",
        f"constexpr int64_t site_variants[] = {{{', '.join(map(str, flat)) or '0'}}};",
        f"constexpr int64_t site_begin[] = {{{', '.join(map(str, begin))}}};",
        f"constexpr int64_t kSites = {len(doc['sites'])};",
        "",
        _BODY,
        "}  // namespace fpfused",
        "",
        f"TORCH_LIBRARY_FRAGMENT({namespace}, m) {{",
        '  m.def("fused(int site, Tensor[] inputs) -> Tensor[]", &fpfused::run);',
        '  m.def("fused_load(str root, int[] devices) -> int", &fpfused::load);',
        '  m.def("fused_stats() -> int[]", &fpfused::stats);',
        '  m.def("fused_set_enabled(int[] flags) -> int", &fpfused::set_enabled);',
        '  m.def("fused_variants() -> str[]", &fpfused::variant_ids);',
        "}",
        "",
    ]
    return "\n".join(lines)


_BODY = r"""
std::mutex mu;
std::atomic<bool> loaded{false};
std::atomic<bool> device_ok_[fpg::kMaxDevices]{};

bool device_ok(c10::Device d) {
  if (!kCuda) return true;
  auto i = d.index();
  return i >= 0 && i < fpg::kMaxDevices && device_ok_[i].load(std::memory_order_relaxed);
}

// A family variant's inputs: each binds the family's dims (sizes in range, pointer as the kernel needs),
// then the derived dims and the kernel's divisibility needs, then every stride by its rule.
bool family_match(const Variant& v, at::TensorList inputs, int64_t* dv) {
  for (int d = 0; d < kMaxDims; ++d) dv[d] = -1;
  for (size_t i = 0; i < v.n_in; ++i) {
    if (!fpg::bind(inputs[i], v.fins[i], kDevice, v.ranges, dv)) return false;
  }
  if (!v.dims(dv)) return false;
  for (size_t i = 0; i < v.n_in; ++i) {
    if (!fpg::strides_ok(inputs[i], v.fins[i], dv)) return false;
  }
  return true;
}

// One variant's guard: every input as verified, one device of the pack's arch, no autograd needed.
bool matches(const Variant& v, at::TensorList inputs, c10::Device* device, int64_t* dv) {
  if (!v.enabled.load(std::memory_order_relaxed) || inputs.size() != v.n_in) return false;
  if (v.fins != nullptr) {
    if (!family_match(v, inputs, dv)) return false;
  } else {
    for (size_t i = 0; i < v.n_in; ++i) {
      if (!fpg::match(inputs[i], v.ins[i], kDevice)) return false;
    }
  }
  fpg::SameDevice same;
  for (const at::Tensor& t : inputs) {
    if (!same.add(t)) return false;
  }
  if (!device_ok(same.device)) return false;
  if (c10::GradMode::is_enabled()) {
    for (const at::Tensor& t : inputs) {
      if (fpg::needs_grad(t)) return false;
    }
  }
  *device = same.device;
  return true;
}

std::vector<at::Tensor> run(int64_t site, at::TensorList inputs) {
  if (!loaded.load(std::memory_order_acquire) || site < 0 || site >= kSites) return {};
  for (int64_t k = site_begin[site]; k < site_begin[site + 1]; ++k) {
    Variant& v = variants[site_variants[k]];
    c10::Device device{kDevice};
    int64_t dv[kMaxDims];
    if (!matches(v, inputs, &device, dv)) continue;
    c10::OptionalDeviceGuard guard;
    if constexpr (kCuda) guard.reset_device(device);
    std::vector<at::Tensor> outs;
    outs.reserve(v.n_out);
    std::array<fp_tensor, kMaxInputs> in{};
    std::array<fp_tensor, kMaxInputs> out{};
    for (size_t i = 0; i < v.n_in; ++i) {
      fpg::describe(in[i], inputs[i], v.fins != nullptr ? v.fins[i].abi_dtype : v.ins[i].abi_dtype);
    }
    for (size_t j = 0; j < v.n_out; ++j) {
      outs.push_back(v.fouts != nullptr ? fpg::alloc(kBackend, device, v.fouts[j], dv)
                                        : fpg::alloc(kBackend, device, v.outs[j]));
      fpg::describe(out[j], outs[j], v.fouts != nullptr ? v.fouts[j].abi_dtype : v.outs[j].abi_dtype);
    }
    const fp_call call{FP_ABI_VERSION, static_cast<int32_t>(v.n_in), static_cast<int32_t>(v.n_out), 0,
                       in.data(), out.data(), nullptr, fpg::current_stream(device)};
    if (v.fn.load(std::memory_order_relaxed)(&call) == FP_OK) {
      fpg::count(v.hits);
      return outs;
    }
    fpg::count(v.errors);  // the kernel refused: the caller runs the original forward
    return {};
  }
  return {};
}

int64_t load(const std::string& root, std::vector<int64_t> devices) {
  std::lock_guard<std::mutex> lock(mu);
  for (auto& flag : device_ok_) flag.store(false);
  for (int64_t d : devices) {
    if (d >= 0 && d < fpg::kMaxDevices) device_ok_[d].store(true);
  }
  for (auto& v : variants) {
    if (v.fn.load() != nullptr) continue;
    std::string path = root + "/" + v.kernel_file;
    // Handles stay open for the process's life: a call in flight never runs unmapped code.
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(handle != nullptr, "forgepack: cannot load kernel ", path, ": ", dlerror());
    void* sym = dlsym(handle, "forgepack_kernel");
    TORCH_CHECK(sym != nullptr, "forgepack: ", path, " has no forgepack_kernel symbol");
    v.fn.store(reinterpret_cast<fpg::KernelFn>(sym));
  }
  loaded.store(true, std::memory_order_release);
  return static_cast<int64_t>(std::size(variants));
}

std::vector<int64_t> stats() {
  std::vector<int64_t> out;
  for (auto& v : variants) out.push_back(v.hits.load());
  for (auto& v : variants) out.push_back(v.errors.load());
  return out;
}

int64_t set_enabled(std::vector<int64_t> flags) {
  TORCH_CHECK(flags.size() == std::size(variants), "forgepack: fused_set_enabled needs ", std::size(variants),
              " flags, got ", flags.size());
  int64_t on = 0;
  for (size_t k = 0; k < flags.size(); ++k) {
    variants[k].enabled.store(flags[k] != 0, std::memory_order_relaxed);
    on += flags[k] != 0;
  }
  return on;
}

std::vector<std::string> variant_ids() {
  std::vector<std::string> out;
  for (auto& v : variants) out.emplace_back(v.id);
  return out;
}
"""


def stage(pkg: Path, items: list[tuple[Card, Path, Path | None, Needs | None]], namespace: str, target: str,
          title: str = "") -> dict[str, Any]:
    """Into the package directory `pkg`: each fusion kernel's verified object (copied, never rebuilt)
    and source, the generated `sources/fused.cpp` compiled to `shim/libforgepack_fused.so`, and
    `modules.json`. `items`: (card, compiled object, source or None, the kernel's stated needs or None: the
    default), most called first. Returns the spec written to `modules.json`."""
    variants = []
    for card, binary, source, needs in items:
        kernel = f"kernels/{card.id}.so"
        (pkg / "kernels").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(binary, pkg / kernel)
        if source is not None and Path(source).is_file():
            (pkg / "sources").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, pkg / "sources" / f"{card.id}{Path(source).suffix}")
        variants.append(FusedVariant(card, kernel, needs))
    code = generate(variants, namespace, target, title)
    sources = pkg / "sources"
    sources.mkdir(parents=True, exist_ok=True)
    (pkg / SOURCE).write_text(code)
    for header in (shimgen.GUARD_HEADER, shimgen.ABI_HEADER):
        if not (sources / header.name).exists():
            shutil.copyfile(header, sources / header.name)
    (pkg / "shim").mkdir(parents=True, exist_ok=True)
    shimgen.compile_shim(pkg / SOURCE, pkg / LIBRARY, [sources])
    doc = spec(variants, namespace, target)
    (pkg / rt.SPEC_FILE).write_text(json.dumps(doc, indent=1) + "\n")
    return doc
