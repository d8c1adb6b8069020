"""What the DeepSpeed workers need to run accelerate's DeepSpeed path on CPU (test-only; GPUs need none of it).

On a machine without an accelerator, accelerate 1.15 sets up a distributed CPU run only with `cpu=True`, and
`cpu=True` drops a DeepSpeed plugin (the run then trains without DeepSpeed). Without it, under torchrun,
`Accelerator(deepspeed_plugin=...)` runs DeepSpeed but leaves `PartialState` with one process of index 0 on every rank
(measured: `torch.distributed.get_rank()` is 1 on the second rank, `accelerator.process_index` 0, `num_processes` 1;
a plain `Accelerator()` is `DistributedType.NO` there): every rank takes itself for the main process, reads every
batch and writes the same files at once. (Trainer's arguments set DeepSpeed's process group up first and are not
affected.) `fix_process_index` corrects the state to the process group's ranks once it is set up.
"""

from __future__ import annotations

import torch.distributed as dist
from accelerate.state import PartialState


def fix_process_index() -> None:
    original = PartialState.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if dist.is_initialized() and self.num_processes != dist.get_world_size():
            PartialState._shared_state["num_processes"] = dist.get_world_size()
            PartialState._shared_state["process_index"] = dist.get_rank()
            PartialState._shared_state["local_process_index"] = dist.get_rank()  # one node

    PartialState.__init__ = init
