"""Ports for the runs that bench's scripts start at once (bench.py, faults.py, versions.py)."""

import random
import socket
import threading
from pathlib import Path


def _first_ephemeral_port():
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


# Below the kernel's ephemeral range: no connection or listener that asks for any port (a
# rank's own, in another run) takes one between a run being given it and its rank 0 listening
# on it, which would end that run with "Address already in use".
_FIRST = _first_ephemeral_port()
_PORTS = range(max(1024, _FIRST - 12000), _FIRST)
_DEFAULT_PORTS = range(29500, 29510)  # torch's and the examples' defaults, which a run may take
_given = set()
_lock = threading.Lock()
_shuffled = random.Random()


def free_port():
    """A port that nothing on this machine uses now, and that no other run of this process was
    given."""
    with _lock:
        for port in _shuffled.sample(_PORTS, len(_PORTS)):
            if port in _given or port in _DEFAULT_PORTS:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _given.add(port)
            return port
    raise RuntimeError(f"no free port in {_PORTS}")
