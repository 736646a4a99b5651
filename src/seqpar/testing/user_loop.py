"""A user's own training loop on seqpar's public API, with a fault injected on one rank (the suite's
third integration, beside ``seqpar train`` and the Trainer)::

    model = build_model(...); seqpar.parallelize(model, mesh)
    for step:
        local = seqpar.shard_batch(batch, mesh)         # batch numbers agree, no cross-batch pairing
        model(**local).loss.backward()                  # forward / attention / loss / backward
        seqpar.sync_gradients(model, mesh)              # sync
        optimizer.step()                                # optimizer (the user's code)
        dcp.save(model.state_dict(), ...)               # save (the user's code, torch's collectives)

The places in the user's own code (the optimizer step, the save) are not seqpar's: only the
program's last resort (``sys.excepthook``, here :func:`~seqpar.testing.fault_inject.run_case`)
publishes their exception, and the failing process exiting frees a peer blocked in torch's own
collectives (the gloo policy of :mod:`seqpar.comm.faults`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from .fault_inject import Case, Injector, Outcome, run_case

USER_PLACES = ("forward", "attention", "loss", "backward", "sync", "optimizer", "save")


def user_loop(rank: int, world: int, case: Case, save_dir: str, *, steps: int = 3, seq: int = 48) -> Outcome:
    """Job entry (every rank): the loop above with ``case`` injected; what this rank raised."""
    import torch.distributed.checkpoint as dcp

    import seqpar
    from seqpar.integrations.models import build_model

    def body(inj: Injector) -> Any:
        torch.manual_seed(0)
        model, _ = build_model("tiny-llama", dtype=torch.float32)
        mesh = seqpar.init_mesh(sp=world, device_type="cpu")
        seqpar.parallelize(model, mesh)
        inj.install(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        for step in range(steps):
            inj.step = step
            ids = torch.randint(0, 128, (1, seq), generator=g)
            local = seqpar.shard_batch({"input_ids": ids, "labels": ids}, mesh)
            model(**local).loss.backward()
            seqpar.sync_gradients(model, mesh)
            inj.boom("optimizer")
            opt.step()
            opt.zero_grad()
            inj.boom("save")
            dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(save_dir, f"step{step}"))
        return dist.get_rank()

    return run_case(case, body)
