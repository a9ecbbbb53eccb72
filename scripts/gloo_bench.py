# The Gloo baseline of the collective benchmarks (scripts/bench-compare.sh, bench-channels.sh),
# kept with the project (a copy of ../shared/anchors/gloo_bench.py). Set up once, where you
# compare: python3 -m venv ~/.venvs/torch && ~/.venvs/torch/bin/pip install torch numpy;
# run: ~/.venvs/torch/bin/python scripts/gloo_bench.py 2
# Anchor: torch.distributed (gloo) collective bandwidth between local processes.
# Prints nccl-tests style rows: op size_bytes time_ms algbw_GBps busbw_GBps
import os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp

def run(rank, world, sizes, iters, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for nbytes in sizes:
        n = nbytes // 4
        x = torch.ones(n)
        for op in ("allreduce", "allgather", "reducescatter"):
            try:
                def once():
                    if op == "allreduce": dist.all_reduce(x)
                    elif op == "allgather":
                        out = torch.empty(n * world); dist.all_gather_into_tensor(out, x)
                    else:
                        out = torch.empty(n // world); dist.reduce_scatter_tensor(out, x)
                once(); dist.barrier()
                t = time.perf_counter()
                for _ in range(iters): once()
                dist.barrier()
                dt = (time.perf_counter() - t) / iters
                # nccl-tests convention: size is the full buffer (allgather: output)
                size = nbytes * world if op == "allgather" else nbytes
                factor = 2 * (world - 1) / world if op == "allreduce" else (world - 1) / world
                algbw = size / dt / 1e9
                if rank == 0: print(f"{op} {size} {dt*1e3:.2f} {algbw:.3f} {algbw*factor:.3f}", flush=True)
            except Exception as e:
                if rank == 0: print(f"{op} {nbytes} unsupported: {str(e).splitlines()[0][:80]}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    sizes = [1 << 20, 16 << 20, 64 << 20]
    mp.spawn(run, args=(world, sizes, 5, 29500 + world), nprocs=world)
