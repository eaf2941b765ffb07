"""FSDP on CPU processes, for the engine tests only.

torch's FSDP2 (`fully_shard`) runs on CPU with gloo, but Accelerate 1.15 never selects it there: with `use_cpu=True`
`PartialState` picks `DistributedType.MULTI_CPU`, and `AcceleratorState` turns a GPU distributed type into `FSDP`
only (`accelerate/state.py`, the `MULTI_GPU, ...` branch). The FSDP plugin built from `ACCELERATE_USE_FSDP` is then
ignored: the model is wrapped in DDP. trinity_trl's trainers refuse such a run (`training/engines.py`), so a user on
a CPU never trains with DDP believing it is FSDP.

`enable_fsdp_on_cpu()` makes Accelerate do what it does on GPUs: when an FSDP plugin is given and the processes are
CPU processes, the distributed type becomes `FSDP`. Everything after that (wrapping with `fully_shard`, sharded
state dicts, `unwrap_model_for_generation`) is Accelerate's, TRL's and transformers' own code, unchanged.
"""

from __future__ import annotations


def enable_fsdp_on_cpu() -> None:
    from accelerate.state import AcceleratorState, DistributedType, PartialState

    original = AcceleratorState.__init__
    if getattr(original, "_fsdp_on_cpu", False):
        return

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            # every later AcceleratorState() re-reads PartialState's shared state
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    init._fsdp_on_cpu = True
    AcceleratorState.__init__ = init
