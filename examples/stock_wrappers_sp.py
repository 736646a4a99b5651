"""Sequence parallelism under the stock data-parallel wrappers, in a plain PyTorch loop.

    torchrun --nproc-per-node 2 examples/stock_wrappers_sp.py                 # CPU (gloo): sp=2, fully_shard
    torchrun --nproc-per-node 4 examples/stock_wrappers_sp.py --sp 2 --wrap ddp   # dp=2 x sp=2, stock DDP

seqpar's loss scales each rank's share of the gradient for the average that DistributedDataParallel
and FSDP2 take over their ranks, so the model is wrapped exactly as without seqpar -- here
torchtitan's way: ``fully_shard`` every decoder layer, then the root, on a 1-D mesh over all ranks.
The only rule: the wrapper must span every dp x sp rank (one over the dp ranks alone is refused).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from tiny_data import PadCollator, load_rows
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import seqpar
from seqpar.integrations.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp", type=int, default=2, help="ranks per sequence (dp = processes / sp)")
    parser.add_argument("--wrap", choices=["fully_shard", "ddp"], default="fully_shard")
    parser.add_argument("--steps", type=int, default=20)
    opts = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = seqpar.init_mesh(sp=opts.sp)                     # dp x sp over every process
    torch.manual_seed(0)
    model, _ = build_model("tiny-llama")
    model.to(device)
    seqpar.parallelize(model, mesh)
    if opts.wrap == "ddp":
        runner = torch.nn.parallel.DistributedDataParallel(model)   # stock: averages over the world
    else:
        flat = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp_sp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=flat)                            # stock: averages over `flat`
        runner = fully_shard(model, mesh=flat)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    rows, collate = load_rows(), PadCollator()
    dp, dp_rank = mesh["dp"].size(), mesh.get_local_rank("dp")
    for step in range(opts.steps):
        # the dp ranks read different rows; the sp ranks of one dp rank the same ones
        start = (step * dp + dp_rank) * 2 % (len(rows) - 1)
        batch = collate(rows[start:start + 2])
        n = seqpar.count_target_tokens(batch, mesh)           # the step's targets over every dp rank
        loss = runner(**seqpar.shard_batch(batch, mesh, num_items_in_batch=n, device=device)).loss
        loss.backward()                                       # the wrapper averages: exact gradients
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.get_group("dp"))    # each dp rank's value is its share
        if dist.get_rank() == 0 and step % 5 == 0:
            print(f"step {step}: loss {float(total):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
