"""The CPU expert kernels (`runtime/csrc/experts_cpu.cpp`): one or a few tokens through k experts' SwiGLU MLPs in
bf16, int8 or int4, reading each weight once, with AVX-512 BF16 / VNNI.

The extension is compiled on first use with `torch.utils.cpp_extension` (a C++ compiler and ninja are needed; `make
install` builds it once) into a cache folder keyed by the source's hash and torch's version. Where it cannot be built
or loaded (no compiler, a CPU without AVX-512 BF16 and VNNI, a failed build), `available()` is False, one warning line
says why, and every caller keeps the torch path: nothing here ever raises on import.

Threads: the kernels split their work over torch's intra-op threads (`torch.set_num_threads`; `--threads` in the
benchmarks). Set `EXPERTCACHE_NO_EXT=1` to skip the extension.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
import warnings
from pathlib import Path

import torch

_SRC = Path(__file__).parent / "csrc" / "experts_cpu.cpp"
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mfma",
          "-mf16c", "-std=c++17", "-fopenmp"]  # at::parallel_for is OpenMP in torch's CPU wheels
_NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni")
_lock = threading.Lock()
_state: dict = {}


def cache_dir() -> Path:
    base = os.environ.get("EXPERTCACHE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "expertcache")
    # keyed by the source, the flags and the torch it builds against (its headers' path is in ninja's build file:
    # two environments sharing one folder, a clean clone's `make test` venv beside the working tree's, rebuilt
    # each other's extension on every switch)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    digest = hashlib.sha256(_SRC.read_bytes() + " ".join(_FLAGS).encode() + torch_dir.encode()).hexdigest()[:16]
    return Path(base) / "ext" / f"torch{torch.__version__.replace('+', '_')}-{digest}"


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _why_not() -> str | None:
    if os.environ.get("EXPERTCACHE_NO_EXT"):
        return "EXPERTCACHE_NO_EXT is set"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are written for x86-64 with AVX-512, not {platform.machine()}"
    missing = [f for f in _NEEDS if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


@contextlib.contextmanager
def _build_lock(d: Path):
    """One build at a time in `d`, under a lock the kernel drops when its holder dies (`flock`). torch's own lock
    is a file that a build killed midway (Ctrl-C, an out-of-memory kill) leaves behind, and every later process
    then waited on it forever, silently; holding ours, any such file is stale, and it goes."""
    import fcntl
    import sys

    fd = os.open(d / ".build.flock", os.O_RDWR | os.O_CREAT, 0o644)  # a lock, never written
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        stale = d / "lock"
        if stale.exists():
            print(f"expertcache: removing {stale}, left by a build of the CPU kernels that was killed",
                  file=sys.stderr, flush=True)
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # the flock goes with it


def load(verbose: bool = False) -> bool:
    """Build (once, cached) and load the extension; True when its ops are usable. Never raises."""
    if "ok" in _state:  # decided: no lock on the per-call path (`quant.swiglu` asks on every layer)
        return _state["ok"]
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        why = _why_not()
        if why is None:
            try:
                from torch.utils import cpp_extension

                d = cache_dir()
                d.mkdir(parents=True, exist_ok=True)
                if not (d / "expertcache_cpu.so").is_file():  # the first use on this machine: say why it waits
                    import sys

                    print(f"expertcache: building the CPU expert kernels once (about 10 s; cached in {d})",
                          file=sys.stderr, flush=True)
                with _build_lock(d):
                    # built from a copy inside the (content-keyed) folder: ninja's build file names its source by
                    # path, so two checkouts of the same code (a clean clone's `make test` beside the working tree)
                    # rebuilt each other's extension, minutes each time, and inside `bench big`'s memory cgroup
                    src = d / _SRC.name  # the folder is keyed by the source's bytes: a copy there is this one
                    if not src.is_file():
                        from expertcache.telemetry.atomic import write_bytes

                        write_bytes(src, _SRC.read_bytes())
                    cpp_extension.load(name="expertcache_cpu", sources=[str(src)], extra_cflags=_FLAGS,
                                       extra_ldflags=["-fopenmp"],
                                       build_directory=str(d), is_python_module=False, verbose=verbose)
                torch.ops.expertcache_cpu.read_bytes  # noqa: B018 - registered?
            except Exception as e:  # noqa: BLE001 - any failure falls back; the line says what it was
                msg = str(e).strip().splitlines()
                why = f"the build failed ({type(e).__name__}: {msg[-1] if msg else ''})"
        _state["ok"] = why is None
        _state["why"] = why
        if why is not None:
            warnings.warn(f"expertcache: CPU expert kernels unavailable ({why}); experts compute with torch",
                          RuntimeWarning, stacklevel=2)
        return _state["ok"]


def available() -> bool:
    return load()


def why_unavailable() -> str | None:
    load()
    return _state.get("why")


def swiglu_bf16(x, gate_up, down, slots, weights) -> torch.Tensor:
    """x [T, H], gate_up [S, 2I, H] bf16, down [S, H, I] bf16, slots [T, k], weights [T, k] -> y [T, H] in x's
    dtype (fp32 accumulation)."""
    return torch.ops.expertcache_cpu.swiglu_bf16(x, gate_up, down, slots, weights).to(x.dtype)


def linear_bf16(x, weight, bias=None) -> torch.Tensor:
    """`F.linear` for a few rows of bf16 weights: x [..., in] -> [..., out] in x's dtype (fp32 accumulation)."""
    lead = x.shape[:-1]
    y = torch.ops.expertcache_cpu.linear_bf16(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.to(x.dtype).reshape(*lead, weight.shape[0])


MAX_ROWS = 8  # decode-sized calls take the kernels; a prefill's GEMM stays with torch (oneDNN)


def decode_input(x) -> bool:
    """Whether `x` is an input the decode kernels take: on the CPU, at most `MAX_ROWS` rows, no grad (training
    keeps torch's autograd path; a prefill's GEMM stays with torch)."""
    return (isinstance(x, torch.Tensor) and not x.is_cuda and x.dim() >= 1
            and x.numel() // max(x.shape[-1], 1) <= MAX_ROWS and not torch.is_grad_enabled())


def decode_sized(x, w) -> bool:
    """Whether `F.linear(x, w)` is one `linear_bf16` takes: a `decode_input` in bf16 and a 2-D bf16 weight with
    contiguous rows on the CPU."""
    return (decode_input(x) and x.dtype == torch.bfloat16 and isinstance(w, torch.Tensor)
            and w.dtype == torch.bfloat16 and w.dim() == 2 and not w.is_cuda and w.stride(-1) == 1)


def _fast_linear(self, x):
    if decode_sized(x, self.weight):
        return linear_bf16(x, self.weight, self.bias)
    return torch.nn.functional.linear(x, self.weight, self.bias)


def patch_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every bf16 `nn.Linear` of `model` computes decode-sized inputs (at most `MAX_ROWS` rows, no grad) with
    `linear_bf16`; larger inputs, other dtypes and training keep `F.linear`. Returns the patched modules for
    `unpatch_linears`."""
    import types

    done = []
    for mod in model.modules():
        if type(mod) is torch.nn.Linear and mod.weight.dtype == torch.bfloat16 and "forward" not in mod.__dict__:
            mod.forward = types.MethodType(_fast_linear, mod)
            done.append(mod)
    return done


def unpatch_linears(mods) -> None:
    for mod in mods:
        mod.__dict__.pop("forward", None)
        mod.__dict__.pop("_ec_qkv", None)  # (the projections keep their views of the fused rows)


class _Linears(torch.overrides.TorchFunctionMode):
    """Inside: `F.linear` of decode-sized bf16 inputs runs `linear_bf16` (for modules that call `F.linear` on their
    own weight, as the families' routers do)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, w = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
            if decode_sized(x, w):
                return linear_bf16(x, w, args[2] if len(args) > 2 else kwargs.get("bias"))
        return func(*args, **kwargs)


def patch_calls(mods) -> list[torch.nn.Module]:
    """Each module's forward runs inside `_Linears` (its few torch calls pay the mode's dispatch; the routers')."""
    import types

    done = []
    for mod in mods:
        if "forward" in mod.__dict__:
            continue
        orig = type(mod).forward

        def fwd(self, *a, _orig=orig, **kw):
            with _Linears():
                return _orig(self, *a, **kw)

        mod.forward = types.MethodType(fwd, mod)
        done.append(mod)
    return done


def rms_norm(x, weight, eps: float) -> torch.Tensor:
    """transformers' RMSNorm in one call: `weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`, fp32 inside; x and
    weight both bf16 or both fp32."""
    return torch.ops.expertcache_cpu.rms_norm(x, weight, eps)


def route_topk(x, weight, k: int, norm: bool):
    """A top-k router in one call: (logits [T, E] bf16, weights [T, k] bf16, experts [T, k] int64) for bf16 x [T, H]
    and weight [E, H]: the logits as `linear_bf16` computes them, then softmax in fp32, `torch.topk`, renormalized
    to sum 1 when `norm`, as transformers' top-k routers do."""
    return torch.ops.expertcache_cpu.route_topk(x, weight, k, norm)


def qk_norm_rope(q, k, wq, wk, eps_q: float, eps_k: float, cos, sin):
    """The decode step's query and key heads through their RMSNorms and the rotary embedding: q [B, 1, Hq, D] and
    k [B, 1, Hk, D] bf16 (the projections viewed per head), norm weights [D], cos / sin [B, 1, D] -> (q, k)
    [B, H, 1, D], bit for bit what `q_norm`, `k_norm`, the transpose and `apply_rotary_pos_emb` give."""
    return torch.ops.expertcache_cpu.qk_norm_rope(q, k, wq, wk, eps_q, eps_k, cos, sin)


def _fast_norm(self, x):
    if decode_input(x) and x.dtype == self.weight.dtype:
        return rms_norm(x, self.weight, self.variance_epsilon)
    return type(self).forward(self, x)


def _fast_router(self, hidden_states):
    x = hidden_states.reshape(-1, self.hidden_dim)
    if decode_input(x) and x.dtype == torch.bfloat16:
        return route_topk(x, self.weight, self.top_k, bool(self.norm_topk_prob))
    return type(self).forward(self, hidden_states)


def _own_router(mod, x):
    with _Linears():  # the router as the engine ran it before: its F.linear through linear_bf16
        return type(mod).forward(mod, x)


def _same_as_own(mod, fast, x, own=None) -> bool:
    """Whether `fast(mod, x)` computes exactly what the module's own forward (`own(mod, x)`, default its class's)
    does on `x` (outputs of the same structure, dtype and shape, equal bit for bit): the check that a family's norm
    or router is the formula the kernel implements, roundings included, before it takes over."""
    own = own or type(mod).forward
    with torch.no_grad():
        try:
            a, b = own(mod, x), fast(mod, x)
        except Exception:  # noqa: BLE001 - a module the kernel cannot take keeps its own forward
            return False
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    if len(a) != len(b):
        return False
    return all(isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and u.shape == v.shape
               and u.dtype == v.dtype and torch.equal(u, v) for u, v in zip(a, b))


def patch_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's RMSNorm modules (a 1-D `weight` and `variance_epsilon`, checked against their own forward on a
    random input first) compute decode-sized inputs with `rms_norm`. Returns them for `unpatch_linears`."""
    import types

    done = []
    gen = torch.Generator().manual_seed(0)
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if ("forward" in mod.__dict__ or not type(mod).__name__.endswith("RMSNorm") or not isinstance(w, torch.Tensor)
                or w.dim() != 1 or w.is_cuda or w.dtype not in (torch.bfloat16, torch.float32)
                or not isinstance(getattr(mod, "variance_epsilon", None), float)):
            continue
        x = torch.randn(2, w.shape[0], generator=gen).to(w.dtype)
        if _same_as_own(mod, _fast_norm, x):
            mod.forward = types.MethodType(_fast_norm, mod)
            done.append(mod)
    return done


def patch_routers(routers) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """Top-k routers (bf16 `weight [E, H]`, `top_k`, `norm_topk_prob`, `hidden_dim`; no bias) whose own forward
    returns what `route_topk` does (checked on a random input) compute decode-sized inputs with it. Returns (patched,
    the others)."""
    import types

    done, rest = [], []
    gen = torch.Generator().manual_seed(0)
    for mod in routers:
        w = getattr(mod, "weight", None)
        ok = ("forward" not in mod.__dict__ and isinstance(w, torch.Tensor) and w.dim() == 2 and not w.is_cuda
              and w.dtype == torch.bfloat16 and w.stride(-1) == 1 and w.is_contiguous()
              and getattr(mod, "bias", None) is None and isinstance(getattr(mod, "top_k", None), int)
              and getattr(mod, "hidden_dim", None) == w.shape[1] and hasattr(mod, "norm_topk_prob"))
        if ok:
            x = torch.randn(3, w.shape[1], generator=gen).bfloat16()
            ok = _same_as_own(mod, _fast_router, x, _own_router)
        if ok:
            mod.forward = types.MethodType(_fast_router, mod)
            done.append(mod)
        else:
            rest.append(mod)
    return done, rest


def swiglu_q(x, gu: dict, dn: dict, bits: int, group: int, slots, weights) -> torch.Tensor:
    """The integer path: `gu`/`dn` hold `q`, `scales` (and `mins` for int4) as written by `runtime.quant`."""
    return torch.ops.expertcache_cpu.swiglu_q(x, gu["q"], gu["scales"], gu.get("mins"), dn["q"], dn["scales"],
                                              dn.get("mins"), bits, group, slots, weights).to(x.dtype)


def linear_q(x, q, scales, mins, bits: int, group: int, bias=None) -> torch.Tensor:
    """A packed linear layer: x [..., in] -> [..., out] in x's dtype; q/scales/mins as `runtime.quant.quantize`
    writes them for a 2-D weight (int8 activations per 32 inputs, fp32 accumulation)."""
    lead = x.shape[:-1]
    y = torch.ops.expertcache_cpu.linear_q(x.reshape(-1, x.shape[-1]), q, scales, mins, bits, group, bias)
    return y.to(x.dtype).reshape(*lead, q.shape[0])


ATTENTION = "expertcache_cpu"


def attend_one(q, k, v, mask=None, scale: float | None = None) -> torch.Tensor:
    """One query per (row, head) against a KV cache: q [B, Hq, D], k and v [B, Hkv, L, D] (rows contiguous; Hq a
    multiple of Hkv: grouped-query attention), mask an additive [B, L] (0 or -inf) or None -> [B, Hq, D] in q's
    dtype (bf16 or fp32; fp32 scores and sums)."""
    return torch.ops.expertcache_cpu.attend_one(q, k, v, mask, scale if scale is not None else q.shape[-1] ** -0.5)


def _one_token_mask(mask, B: int, L: int):
    """The attention interface's mask as `attend_one` takes it ([B, L] additive), None for no mask, or False where it
    has another shape (per head, per query) and the caller falls back."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[0] != B or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[3] != L:
        return False
    m = mask[:, 0, 0, :]
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=torch.float32).masked_fill_(~m, float("-inf"))
    return m.float()


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The transformers attention interface's function for decode: one query token per row on the CPU, no grad, a
    bf16 or fp32 cache, no dropout, softcap or position bias, goes through `attend_one`; everything else (the
    prefill, training, other devices) through transformers' own `sdpa` function, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, Hq, T, D = query.shape
    Hk, L = key.shape[1], key.shape[2]
    window = kwargs.get("sliding_window")
    fits = (T == 1 and query.device.type == key.device.type == value.device.type == "cpu"
            and key.shape[0] == B and key.shape[3] == D and not torch.is_grad_enabled() and dropout == 0.0
            and query.dtype in (torch.bfloat16, torch.float32) and key.dtype == query.dtype == value.dtype
            and value.shape == key.shape
            and key.stride(-1) == 1 and value.stride(-1) == 1 and 0 < D <= 256
            and Hk > 0 and Hq % Hk == 0 and Hq // Hk <= 16 and kwargs.get("softcap") is None
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions", False)
            and (window is None or attention_mask is not None or L <= window) and available())
    if fits:
        mask = _one_token_mask(attention_mask, B, L)
        if mask is not False:
            out = attend_one(query[:, :, 0], key, value, mask, scaling)
            return out.unsqueeze(1), None  # [B, 1, Hq, D], as sdpa's function returns it
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _fast_qwen3_attention(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    """Qwen3-MoE's attention for a decode step (one token per row, bf16, on the CPU, no grad, our attention
    function configured): the query and key norms and the rotary embedding in one `qk_norm_rope` call, with the
    module's own projections, KV cache and `attention`; anything else goes to the module's own forward."""
    cos, sin = position_embeddings
    old_name = kwargs.pop("past_key_values", None)  # the name the module's decorator maps to `cache`
    cache = cache if cache is not None else old_name
    B, T, _ = hidden_states.shape if hidden_states.dim() == 3 else (0, 0, 0)
    D = self.head_dim
    if not (T == 1 and decode_input(hidden_states) and hidden_states.dtype == torch.bfloat16 and cache is not None
            and not self.training and self.config._attn_implementation == ATTENTION
            and cos.dtype == torch.bfloat16 and sin.dtype == torch.bfloat16
            and cos.shape == (B, 1, D) and sin.shape == (B, 1, D) and not kwargs.get("output_attentions", False)):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    qkv = self.__dict__.get("_ec_qkv")
    if qkv is not None and qkv.current((self.q_proj, self.k_proj, self.v_proj)):  # one matrix: one kernel call
        q, k, v = qkv(hidden_states).split(qkv.sizes, -1)
    else:
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
    q, k, v = q.view(B, 1, -1, D), k.view(B, 1, -1, D), v.view(B, 1, -1, D).transpose(1, 2)
    q, k = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon,
                        self.k_norm.variance_epsilon, cos, sin)
    k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    out, weights = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                             sliding_window=self.sliding_window, **kwargs)
    return self.o_proj(out.reshape(B, 1, -1).contiguous()), weights


class _FusedProjections:
    """Linear layers that read the same input, as one: their weights concatenated by output row (each module's
    weight then a view of its rows, so nothing is held twice), one kernel call for a decode step instead of one per
    module; each output row is computed exactly as the module's own call computes it. Packed (`QuantLinear`, one
    format) or bf16 `nn.Linear`, none with a bias; `None` from `make` where the modules are not all alike."""

    def __init__(self, parts: dict, packed: tuple | None, sizes: list[int], mods):
        self.parts, self.packed, self.sizes = parts, packed, sizes
        self._ptrs = self._weights(mods)

    def _weights(self, mods) -> list[int]:
        return [getattr(m, "weight_q" if self.packed else "weight").data_ptr() for m in mods]

    def current(self, mods) -> bool:
        """Whether the modules still hold their views of the fused rows (a weight replaced since, e.g. by
        `load_state_dict(assign=True)`, sends the step back to the modules' own calls)."""
        return self._weights(mods) == self._ptrs

    @staticmethod
    def make(mods):
        from .quant import QuantLinear

        sizes = [m.out_features for m in mods]
        if all(type(m) is QuantLinear for m in mods):
            fmt = {(m.bits, m.group, m.in_features, m.symmetric) for m in mods}
            if len(fmt) != 1 or any(m.bias is not None for m in mods) or mods[0].in_features % 64:
                return None  # (the kernel takes inputs in 64s: QuantLinear dequantizes the others)
            bits, group, _, symmetric = fmt.pop()
            names = ["weight_q", "weight_scales"] + ([] if symmetric else ["weight_mins"])
            parts = {n: torch.cat([getattr(m, n) for m in mods]) for n in names}
            for n, t in parts.items():
                for m, piece in zip(mods, t.split(sizes)):
                    setattr(m, n, piece)  # the module's buffer: a view of the fused rows
            return _FusedProjections(parts, (bits, group), sizes, mods)
        if all(type(m) is torch.nn.Linear for m in mods):
            ws = [m.weight for m in mods]
            if any(m.bias is not None for m in mods) or {w.dtype for w in ws} != {torch.bfloat16} or \
                    len({w.shape[1] for w in ws}) != 1 or any(w.requires_grad for w in ws):
                return None
            w = torch.cat([m.weight.detach() for m in mods])
            for m, piece in zip(mods, w.split(sizes)):
                m.weight = torch.nn.Parameter(piece, requires_grad=False)
            return _FusedProjections({"weight": w}, None, sizes, mods)
        return None

    def __call__(self, x):
        if self.packed is None:
            return linear_bf16(x, self.parts["weight"])
        bits, group = self.packed
        return linear_q(x, self.parts["weight_q"], self.parts["weight_scales"], self.parts.get("weight_mins"), bits,
                        group)


def patch_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Qwen3-MoE attention modules whose query / key norms are bf16 RMSNorms over the head (`q_norm.weight [D]`)
    take `_fast_qwen3_attention` for decode steps, their query, key and value projections fused where they are
    alike (`_FusedProjections`). Returns them for `unpatch_linears`."""
    import types

    done = []
    for mod in model.modules():
        if type(mod).__name__ != "Qwen3MoeAttention" or "forward" in mod.__dict__:
            continue
        D = getattr(mod, "head_dim", None)
        norms = [getattr(mod, n, None) for n in ("q_norm", "k_norm")]
        if all(type(n).__name__ == "Qwen3MoeRMSNorm" and n.weight.dtype == torch.bfloat16 and n.weight.shape == (D,)
               and isinstance(n.variance_epsilon, float) for n in norms):
            mod.forward = types.MethodType(_fast_qwen3_attention, mod)
            fused = _FusedProjections.make([mod.q_proj, mod.k_proj, mod.v_proj])
            if fused is not None:
                mod.__dict__["_ec_qkv"] = fused
            done.append(mod)
    if any("_ec_qkv" in mod.__dict__ for mod in done):
        release_freed()  # the projections' own weights, now copied into the fused rows
    return done


def release_freed() -> None:
    """Hands memory the process has freed back to the system (glibc's `malloc_trim`; a no-op elsewhere). The
    replaced weights of fused projections are freed from the heap, where glibc keeps them: on the 27-layer
    Qwen3-30B-A3B shape they stayed resident (0.41 GiB more RSS), and `bench big`'s engine, sized to its memory
    cgroup, was killed for it."""
    import ctypes

    try:  # the process's own symbols (no `ldconfig` run to find libc): glibc's malloc_trim where there is one
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        trim = None
    if trim is not None:
        trim(0)


def patch_attention(model: torch.nn.Module) -> list:
    """The model's configs that use transformers' `sdpa` attention switch to `attention` (registered as
    `ATTENTION`, with sdpa's masks): its decode steps read the KV cache once per key/value head in fp32 instead of
    torch's flash kernel, which tiles for many queries (2.7 ms per layer for one bf16 query against 512 keys here,
    against about 0.12 ms). Returns what `unpatch_attention` restores."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    seen, done = set(), []
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "_attn_implementation_internal"):
            continue
        seen.add(id(cfg))
        if cfg._attn_implementation_internal == "sdpa":
            cfg._attn_implementation_internal = ATTENTION
            done.append(cfg)
    return done


def unpatch_attention(configs) -> None:
    for cfg in configs:
        if cfg._attn_implementation_internal == ATTENTION:
            cfg._attn_implementation_internal = "sdpa"


def read_bandwidth(nbytes: int = 1 << 30, rounds: int = 5) -> float:
    """This machine's memory read bandwidth in bytes/s at torch's current thread count: the median of `rounds`
    passes over a buffer far larger than the caches (the extension's streaming read)."""
    import statistics
    import time

    buf = torch.ones(nbytes, dtype=torch.uint8)
    torch.ops.expertcache_cpu.read_bytes(buf)  # first touch
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        torch.ops.expertcache_cpu.read_bytes(buf)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)
