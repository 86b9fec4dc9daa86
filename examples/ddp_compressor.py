"""A data-parallel training step through ``Compressor`` on THD packs, checked against one
process running the same global batch.

    torchrun --nproc-per-node 2 examples/ddp_compressor.py              # GPUs (NCCL)
    torchrun --nproc-per-node 2 examples/ddp_compressor.py --device cpu  # CPUs (gloo)

Each rank packs its share of the global batch's sequences (ragged, one empty) into one THD
pack and runs forward + backward under DistributedDataParallel; DDP averages the gradients.
Rank 0 then replays every shard in one process from the same initial weights and checks
that the mean loss and every parameter gradient agree within fp32 reduction tolerance.
Exit status 0 on agreement.
"""

import argparse
import datetime
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from csa_compressor import Compressor

HIDDEN, HEAD_DIM = 64, 32


class Model(nn.Module):
    def __init__(self, ratio, dtype, device):
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN, dtype=dtype, device=device)
        # On GPUs the fused kernels are demanded, not merely allowed: a silent fallback to
        # the reference pooling would make the check vacuous for the kernels.
        pooling = "fused" if torch.device(device).type == "cuda" else "reference"
        self.comp = Compressor(HIDDEN, HEAD_DIM, ratio, rope_dim=16, dtype=dtype, device=device,
                               pooling=pooling)

    def forward(self, x, cu, max_seqlen):
        y, _ = self.comp(torch.tanh(self.inp(x)), cu, max_seqlen=max_seqlen)
        return y.float().square().mean()


def shard(global_lens, rank, world, seed, device, dtype):
    """This rank's sequences of the global batch, packed: (x, cu_seqlens, max_seqlen)."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, HIDDEN, generator=gen) for n in global_lens]  # same on every rank
    mine = list(range(rank, len(global_lens), world))
    lens = [global_lens[i] for i in mine]
    x = torch.cat([xs[i] for i in mine]).to(device=device, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return x, cu, max(lens)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cuda", "cpu"], help="default: cuda where a GPU is visible, else cpu")
    ap.add_argument("--ratio", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--init-method", default="env://",
                    help="torch.distributed init method; env:// is what torchrun sets up, "
                         "file:///path lets a launcher start the ranks itself")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    backend = "nccl" if args.device == "cuda" else "gloo"
    # A bounded timeout: a lost peer fails the run instead of hanging it.
    if args.init_method == "env://":
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    else:
        dist.init_process_group(backend, init_method=args.init_method,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    r = args.ratio
    global_lens = [9 * r + 3, 0, 5 * r, 2 * r + 1, r - 1, 7 * r, 3 * r + 2, 4 * r][: 4 * world]

    torch.manual_seed(0)
    model = Model(r, dtype, device)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    x, cu, max_len = shard(global_lens, rank, world, seed=1, device=device, dtype=dtype)
    loss = ddp(x, cu, max_len)
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world

    ok = True
    if rank == 0:
        ref = Model(r, dtype, device)
        ref.load_state_dict(init)
        ref_loss = 0.0
        for k in range(world):  # the same global batch, shard by shard, in one process
            xk, cuk, mk = shard(global_lens, k, world, seed=1, device=device, dtype=dtype)
            lk = ref(xk, cuk, mk) / world
            lk.backward()
            ref_loss = ref_loss + lk.detach()
        tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-4)
        try:
            torch.testing.assert_close(mean_loss, ref_loss, **tol)
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m, n=name: f"{n}: {m}")
        except AssertionError as exc:
            ok = False
            print(f"FAIL: {exc}", flush=True)
        pooling = model.comp.pooling
        print(f"{'PASS' if ok else 'FAIL'}: world {world}, {backend}, {args.dtype}, ratio {r}, "
              f"pooling {pooling}: loss {mean_loss.item():.6f} vs one process {ref_loss.item():.6f}; "
              f"{sum(1 for _ in model.parameters())} parameter gradients compared", flush=True)
    # Every rank learns the verdict, and none leaves while another still has a message in
    # flight (a broadcast alone let rank 0 exit before rank 1 had received, hanging it).
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    dist.barrier()
    code = 0 if flag.item() else 1
    sys.stdout.flush()
    sys.stderr.flush()
    if backend == "gloo":
        # Every collective has completed at the barrier and the verdict is agreed. gloo's
        # teardown can then block for good in destroy_process_group while holding the GIL
        # (pytorch/pytorch#75097; seen here on one rank after the other had exited, so
        # not even a watchdog thread can run): end the process without it.
        os._exit(code)
    dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main()
