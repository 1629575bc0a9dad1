"""A tiny data-parallel training run on CPU (gloo): every rank trains the
same linear model on its own shard of a synthetic dataset, DDP averages the
gradients, and rank 0 prints the loss. At the end each rank prints the sum
of a tensor all-reduced across ranks, so the output shows the ranks really
talked to each other.
"""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    for step in range(50):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(
        f"rank {rank} of {world} (node rank {os.environ.get('SWACTOR_NODE_RANK')}): "
        f"all_reduce sum {int(t.item())}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
