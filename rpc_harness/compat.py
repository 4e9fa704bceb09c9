"""What the oldest torch that requirements.txt allows (2.4) lacks, in one place.

- The profiler records every thread of a process only from torch 2.6 on (profile_all_threads,
  pytorch/pytorch#143659). Before, it records the thread that started it, so a rank's trace
  misses the calls it serves on RPC's threads; and only that thread can stop it, so a rank that
  stops early from another thread loses its trace (profiling.py says so and goes on).
- The libuv TCPStore server, torch's default since 2.4, takes a listening socket only from torch
  2.8 (pytorch/pytorch#150215); the classic server takes one on every version, so rank 0's
  store is the classic server everywhere.
"""

import datetime

import torch
import torch.distributed as dist


def profiler_options():
    """torch.profiler.profile's arguments, and whether it records every thread of the process."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # before torch 2.6: the argument is unknown
        return {"activities": activities}, False
    return {"activities": activities, "experimental_config": config}, True


def host_store(sock, seconds):
    """Rank 0's TCPStore, serving on `sock`, a socket listening where --master_addr says (given
    only a port, TCPStore listens on every interface)."""
    host, port = sock.getsockname()[:2]
    return dist.TCPStore(host, port, is_master=True, master_listen_fd=sock.detach(),
                         wait_for_workers=False, use_libuv=False,
                         timeout=datetime.timedelta(seconds=seconds))
