"""Under ``accelerate launch`` (2 CPU processes): ``make_guard`` given a model from before
``accelerator.prepare`` (which wrapped it in DDP), or the module inside what it returned, is
refused, alone or among a GAN's models (a dict, an ``nn.ModuleList``); the models prepare
returned are taken. Each process prints ``rank N: CASE refused: <message>`` or ``rank N: CASE
taken``."""

import torch
from accelerate import Accelerator

from ampguard import distributed
from ampguard.integrations.accelerate import make_guard

accelerator = Accelerator(mixed_precision="no", cpu=True)
rank = accelerator.process_index
d, g = torch.nn.Linear(4, 1), torch.nn.Linear(4, 4)
od, og = torch.optim.SGD(d.parameters(), lr=0.1), torch.optim.SGD(g.parameters(), lr=0.1)
prepared_d, prepared_g, od, og = accelerator.prepare(d, g, od, og)
cases = {
    "before": (d, od),
    "inside": (accelerator.unwrap_model(prepared_d), od),
    "gan_dict_before": ({"d": prepared_d, "g": g}, {"d": od, "g": og}),
    "gan_modulelist_before": (torch.nn.ModuleList([d, g]), [od, og]),
    "gan_moduledict_before": (torch.nn.ModuleDict({"d": prepared_d, "g": g}), {"d": od, "g": og}),
    "prepared": (prepared_d, od),
    "gan_dict_prepared": ({"d": prepared_d, "g": prepared_g}, {"d": od, "g": og}),
}
for case, (models, optimizers) in cases.items():
    try:
        make_guard(accelerator, models, optimizers, precision="fp32", register_state=False)
    except ValueError as err:
        print(f"rank {rank}: {case} refused: {err}", flush=True)
    else:
        print(f"rank {rank}: {case} taken", flush=True)
accelerator.wait_for_everyone()
distributed.shutdown()
