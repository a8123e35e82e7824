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


def apply_policy(model, model_dir, policy: ServePolicy, store_dir="runs/stores"):
    """Attach the offload engine the policy describes (None for the plain model)."""
    if not policy.offloaded:
        return None
    from expertcache.runtime.bench import store_for
    from expertcache.runtime.engine import EngineConfig, OffloadEngine
    from expertcache.runtime.predictors import make_predictor
    from expertcache.telemetry.adapters import adapter_for

    a = adapter_for(model)
    store = store_for(model, store_dir)
    from expertcache.runtime.predictors import TemporalKeep

    aux = keep = None
    if policy.predictor == "spatio" or policy.policy == "scored":  # the routers saved beside the checkpoint
        from expertcache.trainer.aux_routers import load_aux_routers

        aux = load_aux_routers(model_dir, model)
        keep = TemporalKeep(model, aux) if policy.policy == "scored" else None
    pred = make_predictor(policy.predictor, model, aux, a.num_experts, a.hidden_size)
    cfg = EngineConfig(capacity=policy.capacity, tier=policy.tier, policy=policy.policy, miss=policy.miss,
                       tau=policy.tau, budget=policy.budget)
    return OffloadEngine(model, store, cfg, predictor=pred, keep_scores=keep)
