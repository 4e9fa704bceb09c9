"""What torch 2.4 lacks: a profiler of every thread (it records, and stops from, its own thread
only; pytorch/pytorch#143659), and a libuv TCPStore that serves on a socket of ours (from 2.8,
pytorch/pytorch#150215): rank 0's store is the classic one, on every version."""

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
    """Rank 0's store, on a socket listening where --master_addr says, not on every interface."""
    return dist.TCPStore(*sock.getsockname()[:2], is_master=True, use_libuv=False,
                         master_listen_fd=sock.detach(), wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=seconds))
