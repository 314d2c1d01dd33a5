"""Under ``accelerate launch`` (2 CPU processes): ``make_guard`` given the model from before
``accelerator.prepare`` (which wrapped it in DDP) is refused; the one prepare returned is taken.
Each process prints ``rank N: refused: <message>`` and ``rank N: taken``."""

import torch
from accelerate import Accelerator

from ampguard import distributed
from ampguard.integrations.accelerate import make_guard

accelerator = Accelerator(mixed_precision="no", cpu=True)
model = torch.nn.Linear(4, 1)
prepared, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
rank = accelerator.process_index
try:
    make_guard(accelerator, model, optimizer, precision="fp32")
except ValueError as err:
    print(f"rank {rank}: refused: {err}", flush=True)
make_guard(accelerator, prepared, optimizer, precision="fp32")
print(f"rank {rank}: taken ({type(prepared).__name__})", flush=True)
accelerator.wait_for_everyone()
distributed.shutdown()
