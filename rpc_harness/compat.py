"""What torch 2.4, the oldest that requirements.txt allows, lacks, in one place.

- Its profiler records only the thread that started it (profile_all_threads came later,
  pytorch/pytorch#143659), so a trace misses the calls a rank serves on RPC's threads; and only
  that thread can stop it, so a rank stopped early, from another thread, loses its trace.
- Its libuv TCPStore server, the default, cannot serve on a socket of ours (from torch 2.8,
  pytorch/pytorch#150215); the classic server can, on every version: rank 0's store is that."""

import datetime

import torch
import torch.distributed as dist


def profiler_options():
    """torch.profiler.profile's arguments, and whether it records every thread."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # an argument this torch does not know
        return {"activities": activities}, False
    return {"activities": activities, "experimental_config": config}, True


def host_store(sock, seconds):
    """Rank 0's store, on a socket that listens where --master_addr says: given only a port,
    TCPStore would listen on every interface."""
    return dist.TCPStore(*sock.getsockname()[:2], is_master=True, use_libuv=False,
                         master_listen_fd=sock.detach(), wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=seconds))
