"""A runtime policy (what the model is served with): parsed from `key=value,...` and applied to a loaded model.

Keys: capacity (fraction of E or count; default: none, every expert in memory), tier (host), predictor (none,
probe:1, spatio, ...), miss (blocking | reroute | speculative | host), tau (0.1), policy (lru | lfu | scored: the checkpoint's
Temporal router decides what stays), budget (layer | global). An empty policy is the plain model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from expertcache.telemetry.errors import InputError


@dataclass
class ServePolicy:
    capacity: float | None = None
    tier: str = "host"
    predictor: str = "none"
    miss: str = "blocking"
    tau: float = 0.1
    policy: str = "lru"
    budget: str = "layer"

    @property
    def lossy(self) -> bool:
        """Outputs depend on the cache state (evaluated one token at a time). `host` only reorders a sum."""
        return self.capacity is not None and self.miss in ("reroute", "speculative")

    @property
    def offloaded(self) -> bool:
        return self.capacity is not None

    def label(self) -> str:
        if not self.offloaded:
            return "plain"
        s = f"C={self.capacity:g},{self.miss}"
        return s + (f",tau={self.tau:g}" if self.miss == "reroute" else "")

    def to_dict(self) -> dict:
        return asdict(self)


def parse_policy(s: str | None) -> ServePolicy:
    p = ServePolicy()
    if not s:
        return p
    for item in s.split(","):
        if "=" not in item:
            raise InputError(f"policy item {item!r} is not key=value (e.g. capacity=0.25,miss=reroute,tau=0.1)")
        k, v = item.split("=", 1)
        if k not in ServePolicy.__dataclass_fields__:
            raise InputError(f"unknown policy key {k!r}; keys: {', '.join(ServePolicy.__dataclass_fields__)}")
        try:
            setattr(p, k, float(v) if k in ("capacity", "tau") else v)
        except ValueError:
            raise InputError(f"policy {k}={v!r}: expected a number") from None
    return p


def open_model(model_dir, policy: ServePolicy, dtype="fp32", device="cpu"):
    """`(model, engine)`: the checkpoint (a local directory or a cached hub id) as the policy serves it.
    Offloaded, it goes through the runtime's loader (experts stay in the checkpoint's files, read by byte range);
    plain, through `from_pretrained` (engine None). fp32 by default: the figures the gates compare were measured
    in fp32 (`auto`: the checkpoint's own dtype)."""
    from expertcache.runtime.loader import load, parse_device, parse_dtype, resolve

    path = resolve(model_dir)
    device = parse_device(device)
    if not policy.offloaded:
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=parse_dtype(dtype) or "auto")
        return m.eval().to(device), None

    def aux(model):  # the routers saved beside the checkpoint (spatio predictor, scored policy)
        from expertcache.trainer.aux_routers import load_aux_routers

        return load_aux_routers(model_dir, model)

    model = load(path, capacity=policy.capacity, tier=policy.tier, dtype=dtype, device=device,
                 predictor=policy.predictor,
                 aux=aux, policy=policy.policy, miss=policy.miss, tau=policy.tau, budget=policy.budget)
    return model, model.expertcache
