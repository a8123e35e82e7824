"""The reference-free weight checks (`verify`'s, no checksum needed), wherever weights are served or written.

- finite: no NaN or inf in a floating-point weight;
- magnitude: each tensor's largest |w| against its siblings' (the same tensor of the other experts and layers): an
  exponent flip makes a weight 10^4-10^6 times its siblings, so one above `OUTLIER_RATIO` times the group's lower
  quartile (robust while fewer than 3/4 of a group are damaged) is an outlier.

Where they run (a failure is an `InputError` naming the tensor, unless the user says `--integrity off`; for the
engine `EngineConfig.integrity`, whose default is `INTEGRITY_DEFAULT`):
- `load` (`check_weights`): the non-expert weights it reads, each against its sibling group;
- the engine (`expert_checks`): every expert that enters a slot is checked on its first read (`ExpertChecks.check`:
  one max |w| per float tensor of the slot, against its tensor's reference; later reads of the same expert are a
  table look-up). The reference is computed once per expert source: from every expert where the tier holds them
  all in RAM (host, throttled, cuda: the whole model checked at load, as `verify` does), else from a sample of
  `SAMPLE` experts read at start (disk);
- `quantize`, `import-gguf` (`verify.check_written`): the folder they wrote, before it is published.

A max |w| is read from the weights' bit patterns (IEEE magnitudes order as integers once the sign is set aside: two
integer max reductions in NumPy, one thread, no temporary, NaN and inf above every finite bound), so a load thread's
check does not spread over the decoding thread's intra-op pool.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from expertcache.telemetry.errors import InputError

INTEGRITY = ("on", "off")
INTEGRITY_DEFAULT = "on"  # the one default of `--integrity` (quantize, import-gguf) and `--engine.integrity`
OUTLIER_RATIO = 1000.0  # a tensor's max |w| above this many times its siblings' lower quartile is an outlier
SAMPLE = 16  # experts read at an engine's start (per format) for the reference where the tier does not hold them all

_INT = {2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32), 8: (torch.int64, np.uint64)}


def check_integrity(value, flag: str = "--integrity") -> bool:
    """`value` checked (on | off); True when the checks run."""
    if value not in INTEGRITY:
        raise InputError(f"{flag} {value!r}; expected on or off")
    return value == "on"


def magnitudes(x: torch.Tensor) -> np.ndarray:
    """`[rows]` float64: each row's largest |w| of a `[rows, n]` float tensor (rows may be strided, each contiguous);
    NaN where a row holds a NaN, inf where it holds an inf."""
    if x.device.type != "cpu":  # slots on a GPU: a reduction there, one copy of `rows` values back
        lo, hi = torch.aminmax(x, dim=1)
        return torch.maximum(-lo, hi).double().cpu().numpy()
    size = x.element_size()
    if size not in _INT:  # (a one-byte float: no integer trick)
        lo, hi = torch.aminmax(x.float(), dim=1)
        return torch.maximum(-lo, hi).double().numpy()
    sint, utype = _INT[size]
    i = x.view(sint).numpy()  # [rows, n] the bit patterns, signed: a positive weight's are >= 0
    u = i.view(utype)  # unsigned: a negative weight's are >= 2^(bits-1), its magnitude's bits above that
    half = 1 << (8 * size - 1)
    pos = i.max(axis=1).astype(np.int64)
    neg = u.max(axis=1).astype(np.uint64)
    mag = np.maximum(np.where(pos >= 0, pos, 0).astype(np.uint64),
                     np.where(neg >= half, neg - np.uint64(half), 0).astype(np.uint64))
    if x.dtype == torch.bfloat16:  # the top half of a float32
        return (mag.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return mag.astype(utype).view({2: np.float16, 4: np.float32, 8: np.float64}[size]).astype(np.float64)


def max_abs(t: torch.Tensor) -> float:
    """Largest |w| of a float tensor (NaN if it holds a NaN, inf if an inf); 0 for an empty one."""
    if not t.numel():
        return 0.0
    t = t.detach()
    return float(magnitudes(t.contiguous().view(1, -1))[0])


def reference(values) -> float | None:
    """A sibling group's reference magnitude: the lower quartile of its finite members (None: fewer than two)."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=np.float64)
    if len(v) < 2:
        return None
    return float(np.quantile(v, 0.25, method="lower"))


def outliers(groups: dict, ratio: float = OUTLIER_RATIO) -> list[dict]:
    """`groups`: {group: [(max |w|, where-dict)]} of sibling tensors. Each member above `ratio` times the group's
    lower quartile is returned, with its ratio. Groups of one, or whose lower quartile is 0, say nothing."""
    out = []
    for group, members in groups.items():
        ref = reference(m for m, _ in members)
        if ref is None or ref <= 0:
            continue
        for m, where in members:
            if m is not None and m > ratio * ref:
                out.append({**where, "max_abs": float(f"{m:.4g}"), "siblings_q25_max_abs": float(f"{ref:.4g}"),
                            "ratio": float(f"{m / ref:.3g}"), "group": group})
    return out


def _refuse(what: str, m: float, ref: float | None, off: str) -> None:
    if not np.isfinite(m):
        why = "holds NaN/inf"
    else:
        why = f"has max |w| {m:.4g}, {m / ref:.3g}x its siblings' {ref:.4g} (an exponent flip?)"
    raise InputError(f"damaged weights: {what} {why}; refused ({off} serves it anyway)")


def sibling_group(name: str) -> str:
    """A tensor's sibling group: its name with every layer or expert number as `#`."""
    import re

    return re.sub(r"\.\d+(?=\.|$)", ".#", name)


def check_weights(named, where: str, off: str = "--engine.integrity off") -> None:
    """`named`: `(name, max |w|)` of float tensors (the non-expert weights `load` read: `max_abs` of each, taken
    as it is read). The first non-finite one, or one that is a magnitude outlier among its sibling group, is
    refused naming it."""
    groups: dict[str, list] = {}
    for name, m in named:
        if not np.isfinite(m):
            _refuse(f"tensor {name} of {where}", m, None, off)
        groups.setdefault(sibling_group(name), []).append((m, {"tensor": name}))
    bad = outliers(groups)
    if bad:
        o = bad[0]
        _refuse(f"tensor {o['tensor']} of {where}", o["max_abs"], o["siblings_q25_max_abs"], off)


# what a user says to serve a plain model anyway: the engine, every expert resident, its checks off (the plain path
# has no engine options of its own)
PLAIN_OFF = "--engine.capacity 1.0 --engine.integrity off"


def check_model(model, where: str, off: str = PLAIN_OFF) -> None:
    """`check_weights` over a model already in memory (a plain `from_pretrained` model: eval, generate, serve
    with every expert loaded, #45): each float parameter's max |w| against its siblings, a fused `[E, ...]` experts
    tensor as E members (one per expert), so one flipped expert stands out among its layer's and the other
    layers'. One pass over the weights: a fraction of one forward's reads."""
    import torch

    named = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_meta or not p.is_floating_point():
                continue
            if p.ndim == 3 and ".experts." in f".{name}":  # fused experts: [E, out, in] (or [E, in, out])
                per = p.abs().amax(dim=(1, 2)).float()  # NaN propagates: a NaN expert reads as NaN
                named.extend((f"{name}.{e}", float(v)) for e, v in enumerate(per.tolist()))
            else:
                named.append((name, max_abs(p)))
    check_weights(named, where, off)


class ExpertChecks:
    """The engine's check of one expert source: a reference max |w| per float tensor (and format, for a
    mixed-precision source), and which experts passed (`checked[layer, expert]`), kept for the source's life."""

    OFF = "--engine.integrity off"

    def __init__(self, source):
        self.source, self.meta = source, source.meta
        m = self.meta
        # (format, tensor spec, the slot view's name) of every float tensor
        self.parts = [(k, t, t.name if k == 0 else f"@{k}:{t.name}")
                      for k, specs in enumerate([m.tensors, *m.alt_tensors]) for t in specs
                      if t.torch_dtype.is_floating_point]
        self.limit: dict[str, float] = {}  # view name -> the largest max |w| that passes (inf: finiteness only)
        self.ref: dict[str, float | None] = {}
        self.checked = np.zeros((m.num_layers, m.num_experts), dtype=bool)
        self.whole = False  # every expert checked against references from all of them

    def _format(self, layer: int, expert: int) -> int:
        fn = getattr(self.source, "format_index", None)
        return 0 if fn is None else int(fn(layer, expert))

    def _set_refs(self, mags: dict[str, list]) -> None:
        for _, _, name in self.parts:
            r = reference(mags.get(name, []))
            self.ref[name] = r
            self.limit[name] = OUTLIER_RATIO * r if r is not None and r > 0 else float("inf")

    def _what(self, layer: int, expert: int, tensor: str) -> str:
        where = getattr(self.source, "where", None)
        name = tensor.split(":")[-1]
        return f"{name} of {where(layer, expert)}" if where is not None else \
            f"MoE layer {layer} expert {expert} {name}"

    def _judge(self, layer: int, expert: int, name: str, m: float) -> None:
        if not m <= self.limit[name]:  # (NaN fails every comparison)
            _refuse(self._what(layer, expert, name), m, self.ref[name], self.OFF)

    def prepare(self, tier) -> None:
        """The references, once per source: from every expert where `tier` holds them all in RAM (each then
        checked: the whole model, as `verify` does), else from a sample read through `tier` (each checked too)."""
        if self.whole or (self.ref and not hasattr(tier, "layer_views")):
            return
        if hasattr(tier, "layer_views"):
            self._scan_all(tier)
        else:
            self._sample(tier)

    def _scan_all(self, tier) -> None:
        m = self.meta
        mags: dict[str, np.ndarray] = {name: np.full((m.num_layers, m.num_experts), np.nan) for _, _, name in
                                       self.parts}
        fmt = np.array([[self._format(i, e) for e in range(m.num_experts)] for i in range(m.num_layers)])
        for i in range(m.num_layers):
            views = tier.layer_views(i)
            for k, _, name in self.parts:
                mags[name][i] = magnitudes(views[name].flatten(1))  # [E]: every expert of the layer at once
        members = {name: mags[name][fmt == k] for k, _, name in self.parts}
        self._set_refs({name: list(v) for name, v in members.items()})
        for i in range(m.num_layers):
            for e in range(m.num_experts):
                for k, _, name in self.parts:
                    if fmt[i, e] == k:
                        self._judge(i, e, name, float(mags[name][i, e]))
        self.checked[:] = True
        self.whole = True

    def _sample(self, tier) -> None:
        from expertcache.runtime.storage.tiers import SlotPool

        m = self.meta
        order = np.random.default_rng(0).permutation(m.num_layers * m.num_experts)
        want = {k: SAMPLE for k, _, _ in self.parts}
        pool = SlotPool(m, 1)
        got: list[tuple[int, int, dict]] = []
        for j in order:
            if not any(want.values()):
                break
            i, e = divmod(int(j), m.num_experts)
            k = self._format(i, e)
            if not want.get(k):
                continue
            want[k] -= 1
            tier.read(i, e, pool, 0)
            got.append((i, e, self._slot_magnitudes(pool, 0)))
        self._set_refs({name: [g[name] for _, _, g in got if name in g] for _, _, name in self.parts})
        for i, e, g in got:
            for name, v in g.items():
                self._judge(i, e, name, v)
            self.checked[i, e] = True

    def _slot_magnitudes(self, pool, slot: int) -> dict[str, float]:
        k = 0 if pool.fmt is None else int(pool.fmt[slot])
        return {name: float(magnitudes(pool.views[name][slot].reshape(1, -1))[0])
                for fk, _, name in self.parts if fk == k}

    def check(self, layer: int, expert: int, pool, slot: int) -> None:
        """The expert just read into `pool`'s slot: each float tensor's max |w| against its reference (first read
        only). Raises `InputError` naming the layer, expert and tensor."""
        if self.checked[layer, expert]:
            return
        for name, v in self._slot_magnitudes(pool, slot).items():
            self._judge(layer, expert, name, v)
        self.checked[layer, expert] = True


_CHECKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def expert_checks(tier) -> ExpertChecks:
    """The checks of `tier`'s expert source (one per source, kept while it lives: engines re-made on the same
    source, as a benchmark's configurations are, check each expert once), prepared with `tier`."""
    src = tier.source
    c = _CHECKS.get(src)
    if c is None:
        c = _CHECKS[src] = ExpertChecks(src)
    c.prepare(tier)
    return c
