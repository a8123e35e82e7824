"""The LightningModule that trains a HF causal MoE LM: LM loss + the model's own load-balancing loss."""

from __future__ import annotations

import math

import lightning as L
import torch

from .specs import BALANCE_LOSSES, TrainSpec  # noqa: F401 - re-exported


def lr_lambda(spec: TrainSpec):
    def f(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / max(1, spec.warmup_steps)
        progress = min(1.0, (step - spec.warmup_steps) / max(1, spec.max_steps - spec.warmup_steps))
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def per_layer_balance_loss(router_logits, top_k: int) -> torch.Tensor:
    """Switch load-balancing loss computed in each MoE layer and averaged: E * sum_i f_i * P_i per layer, with
    f_i the fraction of tokens that select expert i (sum_i f_i = k) and P_i its mean router probability; k at
    perfect balance, the same scale as transformers' loss (which pools every layer's experts into one count)."""
    losses = []
    for logits in router_logits:  # [tokens, E] per layer
        probs = logits.float().softmax(dim=-1)
        e = probs.shape[-1]
        sel = torch.nn.functional.one_hot(probs.topk(top_k, dim=-1).indices, e).sum(1).float()  # [tokens, E]
        losses.append(e * (sel.mean(0) * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def param_groups(model: torch.nn.Module, weight_decay: float, ndim: dict[str, int] | None = None):
    """AdamW groups: weight decay on matrices, none on norms, biases and embeddings. `ndim`: each parameter's
    dimensions by name as the model was built (FSDP hands the optimizer flat 1-D shards, which would all read
    as norms and biases: no decay at all)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        nd = ndim.get(name, p.ndim) if ndim else p.ndim
        (no_decay if nd < 2 or "embed" in name or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class CausalLMModule(L.LightningModule):
    """Wraps a HF `*ForCausalLM`; validation reports token perplexity per domain (one dataloader per domain)."""

    def __init__(self, model: torch.nn.Module, spec: TrainSpec, val_domains: list[str]):
        super().__init__()
        self.model, self.spec, self.val_domains = model, spec, list(val_domains)
        self._nll: dict[str, list[float]] = {}

    def lm_forward(self, input_ids: torch.Tensor):
        """(total loss, LM loss, balance loss or None) of one forward; see `lm_losses`."""
        out = self.model(input_ids=input_ids, labels=input_ids, output_router_logits=True, use_cache=False)
        return self.lm_losses(out)

    def lm_losses(self, out):
        """(total, LM, balance or None) from a forward's output; the balance term weighted by the model's
        `router_aux_loss_coef`, computed as `spec.balance` says."""
        cfg = self.model.config
        aux = getattr(out, "aux_loss", None)
        lm = out.loss - cfg.router_aux_loss_coef * aux if aux is not None else out.loss
        if self.spec.balance == "per_layer":
            aux = per_layer_balance_loss(out.router_logits, cfg.num_experts_per_tok)
        total = lm + cfg.router_aux_loss_coef * aux if aux is not None else lm
        return total, lm, aux

    def training_step(self, batch, batch_idx):
        loss, lm, aux = self.lm_forward(batch["input_ids"])
        self.log("train/loss", lm.detach(), prog_bar=True, sync_dist=self.trainer.world_size > 1)  # global mean
        if aux is not None:
            self.log("train/aux_loss", aux.detach())
        return loss

    def on_validation_epoch_start(self) -> None:
        self._nll = {d: [0.0, 0] for d in self.val_domains}

    def validation_step(self, batch, batch_idx, dataloader_idx: int = 0):
        ids = batch["input_ids"]  # [B, T]
        out = self.model(input_ids=ids, labels=ids, use_cache=False)
        n = ids[:, 1:].numel()
        acc = self._nll[self.val_domains[dataloader_idx]]
        acc[0] += float(out.loss) * n
        acc[1] += n

    def on_validation_epoch_end(self) -> None:
        tot_nll = sum(v[0] for v in self._nll.values())
        tot_n = sum(v[1] for v in self._nll.values())
        for d, (nll, n) in self._nll.items():
            if n:
                self.log(f"val/ppl_{d}", math.exp(nll / n), add_dataloader_idx=False)
        if tot_n:
            self.log("val/loss", tot_nll / tot_n, add_dataloader_idx=False, prog_bar=True)
            self.log("val/ppl", math.exp(tot_nll / tot_n), add_dataloader_idx=False)

    def setup(self, stage: str) -> None:
        # before the strategy wraps the module (FSDP flattens every parameter): the shapes the optimizer groups by
        self._ndim = {n: p.ndim for n, p in self.named_parameters()}

    def built_ndim(self, child: str) -> dict[str, int]:
        """Dimensions of `child`'s parameters by name as built (`param_groups`'s `ndim`)."""
        return {n.removeprefix(child + "."): d for n, d in getattr(self, "_ndim", {}).items()
                if n.startswith(child + ".")}

    def optimizer_groups(self) -> list[dict]:
        """AdamW parameter groups; a subclass with auxiliary heads adds its own (they may have their own lr)."""
        return param_groups(self.model, self.spec.weight_decay, self.built_ndim("model"))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        from .distributed import is_fsdp

        if gradient_clip_val and is_fsdp(self.trainer):  # the norm of the whole gradient, over every rank's shard
            self.trainer.model.clip_grad_norm_(gradient_clip_val)
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        opt_ = torch.optim.AdamW(self.optimizer_groups(), lr=self.spec.lr, betas=(0.9, self.spec.beta2))
        sched = torch.optim.lr_scheduler.LambdaLR(opt_, lr_lambda(self.spec))
        return {"optimizer": opt_, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
