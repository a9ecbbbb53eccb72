"""Kernel TCP reference for the wiring lab (scripts/lab-tbf.sh, SUB=tcp): one connection
carrying N MiB each way at once, no encryption. Prints the per-direction rate.

    tcp-pump.py server|client ADDR N
"""
import socket
import sys
import threading
import time

mode, addr, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
buf = b"x" * (1 << 20)
if mode == "server":
    listener = socket.socket()
    listener.bind((addr, 5201))
    listener.listen(1)
    s, _ = listener.accept()
else:
    for _ in range(100):
        try:
            s = socket.create_connection((addr, 5201))
            break
        except OSError:
            time.sleep(0.05)
    else:
        sys.exit(f"tcp-pump: no server at {addr}:5201")
s.sendall(b"g")
assert s.recv(1) == b"g"
t0 = time.perf_counter()
done = []


def drain():
    got = 0
    while got < n << 20:
        d = s.recv(1 << 20)
        if not d:
            break
        got += len(d)
    done.append(time.perf_counter())


t = threading.Thread(target=drain)
t.start()
for _ in range(n):
    s.sendall(buf)
t.join()
dt = done[0] - t0
print(f"{mode}: {n} MiB each way at once in {dt:.3f} s: {(n << 20) / dt / 1e9:.4f} GB/s per direction")
