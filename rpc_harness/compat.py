"""What torch 2.4 lacks: a profiler of every thread (pytorch/pytorch#143659: it records, and stops
from, its own only), a libuv TCPStore on a socket of ours (2.8, #150215): the classic store here."""

import datetime

import torch
import torch.distributed as dist


def profiler_options():
    """torch.profiler.profile's arguments, and whether it records every thread."""
    kinds = torch.profiler.ProfilerActivity
    activities = [kinds.CPU, kinds.CUDA] if torch.cuda.is_available() else [kinds.CPU]
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
