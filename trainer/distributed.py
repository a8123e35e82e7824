"""Training across processes and machines with Lightning: the strategy a recipe's `train` section asks for, FSDP on
CPU processes (gloo) as well as on GPUs, the world-size checks, and the full weights rank 0 saves after a sharded
fit. docs/post-training.md ("Across processes and machines") says how to launch it.
"""

from __future__ import annotations

import os

from lightning.pytorch.strategies import FSDPStrategy

from .config import RecipeError

# Lightning strategies that start one process per device and node: on one process they only add a process group
DATA_PARALLEL = ("ddp", "fsdp")


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDP strategy on CPU processes (gloo). Lightning refuses `strategy="fsdp"` without a GPU, and
    torch's FSDP wants a non-CPU device unless it is handed `device_id=cpu`; the sharding, the gathered full
    checkpoints and the gradient reduction are FSDP's own."""

    def _setup_model(self, model):
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.root_device.type == "cpu":  # wrapped here with the CPU device; Lightning then takes it as wrapped
            model = FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                             mixed_precision=self.mixed_precision_config,
                                             sharding_strategy=self.sharding_strategy,
                                             device_id=torch.device("cpu"), **self.kwargs)
        return super()._setup_model(model)

    def _gathered_whole(self):
        """The context in which rank 0 gathers whole weights and optimizer state for a checkpoint, without
        Lightning's offload_to_cpu: on CPU there is nothing to offload, and torch's offload of a tensor already on
        the CPU moves nothing, which breaks both gathers (see the two methods below)."""
        from torch.distributed.fsdp import (FullOptimStateDictConfig, FullStateDictConfig, FullyShardedDataParallel,
                                            StateDictType)

        return FullyShardedDataParallel.state_dict_type(self.model, StateDictType.FULL_STATE_DICT,
                                                        FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
                                                        FullOptimStateDictConfig(offload_to_cpu=False,
                                                                                 rank0_only=True))

    def lightning_module_state_dict(self):
        if self.root_device.type != "cpu" or self._state_dict_type != "full":
            return super().lightning_module_state_dict()
        # torch's offload (flat_param.to_cpu) frees the gathered storage it has just "moved" when it was on the CPU
        # already: a use after free (segfault) in state_dict()
        with self._gathered_whole():
            return self.model.state_dict()

    def optimizer_state(self, optimizer):
        if self.root_device.type != "cpu" or self._state_dict_type != "full":
            return super().optimizer_state(optimizer)
        from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

        # torch gathers each state of a flat parameter (AdamW's exp_avg, then exp_avg_sq) into one reused buffer;
        # with offload_to_cpu it keeps each by `.cpu()`, which on the CPU is the buffer itself: every state saved
        # was the last one gathered (exp_avg saved as exp_avg_sq), and a resume went on from a wrong momentum.
        # Without the offload torch clones each state out of the buffer.
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's wrapper, or the optimizer
        with self._gathered_whole():
            state = FullyShardedDataParallel.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:  # keyed by parameter index, as Lightning saves it (its loading expects it)
                state = FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID,
                                                                         self.model)
        return state

    def _determine_device_ids(self):
        # a gloo barrier takes no device ids (Lightning's GPU path passes [cuda index])
        return None if self.root_device.type == "cpu" else super()._determine_device_ids()


def on_cpu(accelerator: str) -> bool:
    """The processes train on CPU: asked for, or `auto` on a machine without a CUDA GPU."""
    if accelerator == "cpu":
        return True
    import torch

    return accelerator == "auto" and not torch.cuda.is_available()


def check_processes(train, world: int, cpu: bool) -> None:
    """A data-parallel strategy on one process, or FSDP on CPU in another precision than float32: refused, naming
    what to set. `TrainSpec` calls it with the devices it states; `check_world` once Lightning resolved `auto`."""
    if train.strategy.startswith(DATA_PARALLEL) and world == 1:
        raise RecipeError(f"train.strategy={train.strategy} runs one process per device and node, but "
                          f"train.devices={train.devices} and train.num_nodes={train.num_nodes} make one process: "
                          f"set train.devices=2 or more (processes on this machine) or train.num_nodes=2 or more, "
                          f"or train.strategy=auto")
    if train.strategy == "fsdp" and cpu and train.precision != "32-true":
        raise RecipeError(f"train.strategy=fsdp on CPU trains in float32; train.precision={train.precision!r} is "
                          f"for GPUs: set train.precision=32-true")


def strategy_for(train):
    """What `L.Trainer(strategy=...)` gets for a `TrainSpec`: its name, except FSDP on CPU (`CPUFSDPStrategy`)."""
    if train.strategy == "fsdp" and on_cpu(train.accelerator):
        return CPUFSDPStrategy()
    return train.strategy


def check_world(trainer, train, batch_size: int) -> None:
    """After Lightning resolved the devices (`auto` included), before any step: `check_processes` on the world
    it made, and a global batch that does not split evenly across its processes is refused."""
    from lightning.pytorch.accelerators import CPUAccelerator

    check_processes(train, trainer.world_size, isinstance(trainer.accelerator, CPUAccelerator))
    if batch_size % trainer.world_size:
        raise RecipeError(f"data.batch_size={batch_size} (the global batch) does not split evenly across "
                          f"{trainer.world_size} processes (train.devices x train.num_nodes)")


def is_fsdp(trainer) -> bool:
    return isinstance(trainer.strategy, FSDPStrategy)


def unshard(trainer, module) -> None:
    """Every process calls it after `fit`; afterwards rank 0's `module` holds the whole trained weights as plain
    parameters, for the saving and evaluation that follow on rank 0 alone. FSDP leaves each rank a shard: they are
    gathered here (a collective: no rank may skip it); ties between parameters stay tied. A no-op for every other
    strategy, whose modules hold the whole weights already."""
    if not is_fsdp(trainer):
        return
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    slots, full = [], {}
    with FullyShardedDataParallel.summon_full_params(trainer.model, writeback=False, rank0_only=True):
        if trainer.global_rank == 0:
            for m in module.modules():
                for name, p in m._parameters.items():
                    if p is not None:
                        slots.append((m, name, id(p)))
                        if id(p) not in full:
                            full[id(p)] = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
    # leaving the context put the shards' views back into the modules: the gathered copies replace them
    for m, name, key in slots:
        m._parameters[name] = full[key]


def is_worker() -> bool:
    """This process is not the global rank 0, as its launcher says before Lightning starts: Lightning's own launch
    (LOCAL_RANK, NODE_RANK), torchrun (RANK, GROUP_RANK) or SLURM's srun (SLURM_PROCID)."""
    return any(os.environ.get(v, "0") != "0" for v in ("LOCAL_RANK", "NODE_RANK", "RANK", "GROUP_RANK",
                                                          "SLURM_PROCID"))
