"""Network probe shipped to nodes on stdin (`python3 - MODE ARGS`); stdlib only.

serve PORT TIMEOUT          listen on PORT (0 = any), print `listening PORT`, serve clients until
                            TIMEOUT seconds pass with no client or a client sends `quit`.
client HOST PORT up|down N  send (up) or receive (down) N bytes; print JSON {bytes, seconds}.
client HOST PORT rtt K      K one-byte round trips; print JSON {rtts: [...]}.
allreduce ...               a torch.distributed all-reduce timing (see _allreduce).
"""
import json
import socket
import sys
import time

CHUNK = 1 << 20


def _recv_exact(s, n):
    got = 0
    while got < n:
        b = s.recv(min(CHUNK, n - got))
        if not b:
            raise ConnectionError("peer closed")
        got += len(b)
    return got


def _line(s):
    buf = b""
    while not buf.endswith(b"\n"):
        b = s.recv(1)
        if not b:
            raise ConnectionError("peer closed")
        buf += b
    return buf.decode().strip()


def serve(port, timeout):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(16)
    srv.settimeout(timeout)
    print("listening", srv.getsockname()[1], flush=True)
    payload = b"\0" * CHUNK
    while True:
        try:
            c, _ = srv.accept()
        except socket.timeout:
            return
        with c:
            c.settimeout(max(timeout, 60))
            cmd = _line(c).split()
            if cmd[0] == "quit":
                return
            if cmd[0] == "up":  # client sends N bytes to us
                n = int(cmd[1])
                _recv_exact(c, n)
                c.sendall(b"ok\n")
            elif cmd[0] == "down":  # we send N bytes to the client
                n = int(cmd[1])
                while n > 0:
                    k = min(CHUNK, n)
                    c.sendall(payload[:k])
                    n -= k
            elif cmd[0] == "rtt":
                k = int(cmd[1])
                for _ in range(k):
                    c.sendall(c.recv(1))


def client(host, port, mode, n):
    n = int(n)
    s = socket.create_connection((host, int(port)), timeout=60)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with s:
        s.sendall(f"{mode} {n}\n".encode())
        if mode == "rtt":
            rtts = []
            for _ in range(n):
                t0 = time.perf_counter()
                s.sendall(b"x")
                if not s.recv(1):
                    raise ConnectionError("peer closed")
                rtts.append(time.perf_counter() - t0)
            print(json.dumps({"rtts": rtts}))
            return
        t0 = time.perf_counter()
        if mode == "up":
            payload = b"\0" * CHUNK
            left = n
            while left > 0:
                k = min(CHUNK, left)
                s.sendall(payload[:k])
                left -= k
            if _line(s) != "ok":
                raise ConnectionError("bad ack")
        else:
            _recv_exact(s, n)
        print(json.dumps({"bytes": n, "seconds": time.perf_counter() - t0}))


def quit_server(host, port):
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"quit\n")


def _allreduce(rank, world, addr, port, nbytes, iters, backend, dtype):
    import datetime
    import os

    import torch
    import torch.distributed as dist

    dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=int(rank),
                            world_size=int(world), timeout=datetime.timedelta(seconds=120))
    dev = "cuda" if backend == "nccl" else "cpu"
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    t = torch.ones(int(nbytes) // torch.tensor([], dtype=dt).element_size(), dtype=dt, device=dev)
    dist.all_reduce(t)  # warm-up: connections, buffers
    times = []
    for _ in range(int(iters)):
        if dev == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    # every rank past its last collective before any tears gloo down: a rank that destroys its
    # group while a peer still talks to it can abort that peer at exit (seen across hosts)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": int(rank), "bytes": t.numel() * t.element_size(), "times": times,
                      "backend": backend}))


def main(argv):
    mode, args = argv[0], argv[1:]
    if mode == "serve":
        serve(int(args[0]), float(args[1]))
    elif mode == "client":
        client(*args)
    elif mode == "quit":
        quit_server(*args)
    elif mode == "allreduce":
        _allreduce(*args)
    else:
        sys.exit(f"unknown mode {mode}")
