"""The LightningModule of a cache-aware run: the backbone's LM and distillation losses, the locality, margin and
domain losses on its routers, the served (rerouted) training forward and the auxiliary routers' cache loss."""

from __future__ import annotations

import time

import torch

from ..config import RecipeError
from ..lm_module import CausalLMModule
from .recipe import CacheAwareRecipe


class CacheAwareModule(CausalLMModule):
    def __init__(self, model, recipe: CacheAwareRecipe, val_domains: list[str], aux=None,
                 allowed: torch.Tensor | None = None, teacher=None, base_routers: dict | None = None):
        """`teacher`: a second model, the frozen base for distillation; or `base_routers` ({parameter name:
        tensor}, copies of the routers before training) when only the routers train: the base is then this model
        with those routers (`torch.func.functional_call`), never a second copy of it."""
        super().__init__(model, recipe.train, val_domains)
        self._teacher = [teacher] if teacher is not None else []  # a list: not a submodule, never saved
        self._base_routers = base_routers
        self.step_losses: list[float] = []  # each training step's total loss (what the optimizer minimised)
        self.step_seconds: list[float] = []  # each training step's wall time, batch start to optimizer step done
        self.step_read_bytes: list[int] = []  # streamed experts: bytes each training step read (`read_counter`)
        self.read_counter = None  # streamed experts: a callable giving the bytes read so far
        self._step_t0 = self._step_b0 = None
        self.save_frozen = True
        from expertcache.telemetry.adapters import adapter_for

        from ..locality import layer_weights

        self.recipe, self.aux, self.allowed = recipe, aux, allowed
        self.adapter = adapter_for(model)
        self.moe = self.adapter.moe_layers(model)
        self.layer_w = layer_weights(recipe.locality.layer_weights, len(self.moe))
        self._hidden: dict[int, torch.Tensor] = {}
        self._capture = False
        self.served = None
        sv = recipe.serving
        if sv.reroute or (recipe.locality.kind == "margin" and recipe.locality.weight):  # the replay is paid per step
            from expertcache.telemetry.cachesim import capacity_count

            from ..locality import ServedRouting

            c = capacity_count(sv.capacity, self.adapter.num_experts)
            if c < self.adapter.top_k:
                raise RecipeError(f"serving.capacity={sv.capacity} is {c} experts, fewer than top_k="
                                  f"{self.adapter.top_k}: the served replay needs a step's experts to fit")
            self.served = ServedRouting(self.moe, self.adapter, c, sv.tau, apply=sv.reroute)
        if aux is not None:
            for i, layer in enumerate(self.moe):
                layer.router.register_forward_hook(self._keep_input(i))
        if recipe.mode == "aux-only":
            for p in model.parameters():
                p.requires_grad_(False)
        elif recipe.quality.trainable != "all":
            keep = {id(p) for L in self.moe for p in L.router.parameters()}
            from ..lora import is_adapter_param

            keep |= {id(p) for n, p in model.named_parameters() if is_adapter_param(n)}  # quality.lora_rank
            if recipe.quality.trainable == "moe":
                keep |= {id(p) for L in self.moe for p in L.experts.parameters()}
            for p in model.parameters():
                p.requires_grad_(id(p) in keep)

    def optimizer_groups(self) -> list[dict]:
        from ..lm_module import param_groups

        groups = param_groups(self.model, self.spec.weight_decay, self.built_ndim("model"))
        if self.aux is not None:
            lr = self.recipe.routers.lr or self.spec.lr
            groups += [dict(g, lr=lr) for g in param_groups(self.aux, self.spec.weight_decay,
                                                            self.built_ndim("aux"))]
        return groups

    def _keep_input(self, i: int):
        def hook(module, args, output):
            if self._capture:
                self._hidden[i] = args[0].reshape(-1, args[0].shape[-1])  # [B*T, H] entering MoE layer i
        return hook

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]  # [B, T]
        b = ids.shape[0]
        loc, r = self.recipe.locality, self.recipe.routers
        self._capture = self.aux is not None
        if self.served is not None:
            self.served.active, self.served.batch = True, b
        try:
            if self.recipe.mode == "aux-only":
                with torch.no_grad():
                    out = self.model(input_ids=ids, output_router_logits=True, use_cache=False)
                total = torch.zeros((), device=ids.device)
            else:
                q = self.recipe.quality
                out = self.model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
                total, lm, bal = self.lm_losses(out)
                total = total + (q.lm_weight - 1.0) * lm
                self.log("train/loss", lm.detach(), prog_bar=True, sync_dist=self.trainer.world_size > 1)
                if bal is not None:
                    self.log("train/aux_loss", bal.detach())
                if q.distill:
                    kl = self.distill_loss(ids, out.logits)
                    total = total + q.distill * kl
                    self.log("train/distill", kl.detach(), prog_bar=True)
            if self.served is not None:
                self.log("train/rerouted", self.served.rerouted_fraction())
            if loc.weight:
                from ..locality import locality_loss, served_margin_loss

                if loc.kind == "margin":
                    lo = served_margin_loss(out.router_logits, [self.served.served[i] for i in range(len(self.moe))],
                                            loc.margin, self.layer_w)
                else:
                    lo = locality_loss(out.router_logits, b, loc.kind, self.layer_w, loc.temperature,
                                       self.adapter.top_k, loc.cache)
                ramp = min(1.0, (self.global_step + 1) / loc.warmup_steps) if loc.warmup_steps else 1.0
                total = total + ramp * loc.weight * lo
                self.log("train/locality", lo.detach(), prog_bar=True)
            if loc.domain_weight:
                from ..locality import domain_loss

                do = domain_loss(out.router_logits, b, batch["domain"], self.allowed)
                total = total + loc.domain_weight * do
                self.log("train/domain", do.detach())
            if self.aux is not None:
                with torch.no_grad():
                    native = [self.adapter.route(lg, self.adapter.router_bias(L.router))[0]
                              for lg, L in zip(out.router_logits, self.moe)]
                hidden = [self._hidden[i] for i in range(len(self.moe))]
                losses = self.aux.loss(hidden, native, [L.router for L in self.moe], b)
                w = 1.0 if self.recipe.mode == "aux-only" else r.weight
                for name, v in losses.items():
                    total = total + w * v
                    self.log(f"train/{name}", v.detach(), prog_bar=True)
        finally:
            self._capture = False
            self._hidden.clear()
            if self.served is not None:
                self.served.active = False
                self.served.clear()
        self.step_losses.append(float(total.detach()))
        return total


    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._step_t0 = time.perf_counter()
        self._step_b0 = self.read_counter() if self.read_counter is not None else None

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        """A step's wall time (and, streamed, its bytes read): validation and checkpoint writes fall outside it, so
        the figures are the training step's own, as a roofline compares them."""
        if self._step_t0 is None:
            return
        self.step_seconds.append(time.perf_counter() - self._step_t0)
        if self._step_b0 is not None:
            self.step_read_bytes.append(self.read_counter() - self._step_b0)
        self._step_t0 = None

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """With `save_frozen` off (streamed experts: the frozen weights are the base's, on disk already), a
        resumable checkpoint holds only the parameters that train; resuming then loads it non-strictly."""
        if not self.save_frozen:
            frozen = {f"model.{n}" for n, p in self.model.named_parameters() if not p.requires_grad}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in frozen}

    def on_fit_start(self) -> None:
        for t in self._teacher:
            t.to(self.device)
        if self._base_routers is not None:
            self._base_routers = {k: v.to(self.device) for k, v in self._base_routers.items()}

    def _base_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The frozen base's logits: the teacher model, or this model with the base's routers (its capture and
        served-routing hooks off: the base routes natively, as a separate copy would)."""
        if self._teacher:
            return self._teacher[0](input_ids=ids, use_cache=False).logits
        capture, self._capture = self._capture, False
        served = self.served.active if self.served is not None else None
        if self.served is not None:
            self.served.active = False
        # Inside FSDP's forward (use_orig_params) each parameter is read from a plain tensor view set on its module,
        # which shadows the registered parameter that functional_call swaps: swapped there instead (else the base
        # would be the model itself, and the distillation loss 0 with no gradient)
        from ..lora import adapters_off

        views, swap = {}, {}
        try:
            for name, t in self._base_routers.items():
                owner, _, attr = name.rpartition(".")
                module = self.model.get_submodule(owner)
                if attr in module.__dict__:
                    views[module, attr] = module.__dict__[attr]
                    module.__dict__[attr] = t
                else:
                    swap[name] = t
            with adapters_off(self.model):  # the base's attention too: no adapters (quality.lora_rank)
                return torch.func.functional_call(self.model, swap, (), {"input_ids": ids, "use_cache": False}).logits
        finally:
            for (module, attr), v in views.items():
                module.__dict__[attr] = v
            self._capture = capture
            if self.served is not None:
                self.served.active = served

    def distill_loss(self, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """KL(base || model) of the next-token distributions, summed over the vocabulary, mean over tokens."""
        with torch.no_grad():
            ref = self._base_logits(ids).float().log_softmax(-1)
        own = logits.float().log_softmax(-1)
        return torch.nn.functional.kl_div(own.flatten(0, 1), ref.flatten(0, 1), log_target=True,
                                          reduction="batchmean")
