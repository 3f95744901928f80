"""Temporary rendezvous-port listener for preflight's port_reachable; stdlib only.

    python - PORT SECONDS EXPECTED [TOKEN]

Prints `listening PID` (or `busy ERRNO message`) then one `peer ADDR` line per connection;
exits after EXPECTED connections, after SECONDS, when its SSH channel is closed (a heartbeat
line every 0.1 s fails with EPIPE then), or when preflight kills it by that PID. TOKEN is unused
here: it sits on the command line so preflight can check the PID is still this listener before
killing it. An alarm is the last resort."""
import os
import signal
import socket
import sys
import time


def listen(port, seconds, expected):
    signal.alarm(max(1, int(seconds) + 1))
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("0.0.0.0", port))
        s.listen(256)
    except OSError as e:
        print("busy", e.errno, e.strerror, flush=True)
        return 0
    print("listening", os.getpid(), flush=True)
    s.settimeout(0.1)
    n = 0
    deadline = time.monotonic() + seconds
    while n < expected and time.monotonic() < deadline:
        try:
            c, addr = s.accept()
        except socket.timeout:
            try:
                print("", flush=True)  # the channel is gone: EPIPE/SIGPIPE ends us
            except OSError:
                return 0
            continue
        except OSError:
            break
        c.close()
        n += 1
        print("peer", addr[0], flush=True)
    return 0


def main(argv):
    """PORT SECONDS EXPECTED [TOKEN]: the token only marks the process (`ps` shows it)."""
    return listen(int(argv[0]), float(argv[1]), int(argv[2]))
