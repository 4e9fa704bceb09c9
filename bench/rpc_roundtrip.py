"""RPC round trip against a plain TCP ping-pong of the same bytes, between the same two processes.

Rank 0 sends a tensor to rank 1 with rpc_sync and gets it back; then, over an ordinary TCP
connection between the same two processes, it sends the tensor's bytes and reads them back (the
floor: what moving those bytes twice costs without RPC). Prints one JSON object:
{size: {"rpc": [seconds per round trip, one per repetition], "tcp": [...]}}.
"""

import argparse
import json
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

SIZES = {"tiny": 8, "100 KB": 100 * 1024, "5 MB": 5 * 1024 * 1024}


def echo(tensor):
    return tensor


def _recv_exactly(sock, size):
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        got += sock.recv_into(view[got:])
    return buffer


def _tcp_echo_server(listener):
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while header := _recv_exactly(conn, 8):
            size = int.from_bytes(header, "little")
            if size == 0:
                return
            conn.sendall(_recv_exactly(conn, size))


def calls_for(size):
    """Round trips a measurement makes: about the same bytes in all, 3 to 500 calls."""
    return max(3, min(500, (20 * 1024 * 1024) // size))


def time_per_call(call, calls):
    call()  # warm up
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls


def worker(rank, args, port, tcp_port, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TP_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    if rank == 1:
        listener = socket.create_server(("127.0.0.1", tcp_port))
        threading.Thread(target=_tcp_echo_server, args=(listener,), daemon=True).start()
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    if rank == 0:
        tcp = socket.create_connection(("127.0.0.1", tcp_port))
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        results = {}
        for label, size in SIZES.items():
            tensor = torch.randint(0, 255, (size,), dtype=torch.uint8)
            payload = size.to_bytes(8, "little") + tensor.numpy().tobytes()
            calls = calls_for(size)

            def over_rpc(tensor=tensor):
                rpc.rpc_sync("w1", echo, args=(tensor,))

            def over_tcp(payload=payload, size=size):
                tcp.sendall(payload)
                _recv_exactly(tcp, size)

            results[label] = {"rpc": [], "tcp": []}
            for _ in range(args.repeats):  # alternate, so that noise hits both alike
                results[label]["rpc"].append(time_per_call(over_rpc, calls))
                results[label]["tcp"].append(time_per_call(over_tcp, calls))
        tcp.sendall((0).to_bytes(8, "little"))
        with open(result_path, "w") as out:
            json.dump(results, out)
    rpc.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tcp_port", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mp.spawn(worker, args=(args, args.port, args.tcp_port, args.out), nprocs=2)


if __name__ == "__main__":
    sys.exit(main())
