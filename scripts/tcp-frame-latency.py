#!/usr/bin/env python3
"""Plain TCP's one-way latency for a frame on loopback, the floor under rdmasink/rdmasrc over tcp.

Sends FRAMES frames of BYTES bytes (default 100 of 921600, one 640x480 RGB frame) at FPS
(default 25) over one loopback TCP connection, each stamped with the monotonic clock in its first
8 bytes, and prints the p50 and p99 from the sender's `sendall` to the receiver's last byte:
    scripts/tcp-frame-latency.py [FRAMES] [BYTES] [FPS]
Compare with `gst-bench --transport tcp --in-place --only rdma`'s 25 fps row (docs/benchmarks.md,
"The floor under a frame over tcp")."""
import os
import socket
import struct
import sys
import time

try:
    frames = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 921600
    fps = float(sys.argv[3]) if len(sys.argv) > 3 else 25.0
except ValueError as e:
    sys.exit("usage: tcp-frame-latency.py [FRAMES] [BYTES] [FPS]: %s" % e)
if frames < 1 or size < 8 or not 0 < fps <= 10000:
    # Each frame carries its 8-byte send time.
    sys.exit("tcp-frame-latency.py: FRAMES >= 1, BYTES >= 8 and FPS in (0, 10000], got %s %s %s"
             % (frames, size, fps))

listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(1)
port = listener.getsockname()[1]

if os.fork() == 0:
    conn, _ = listener.accept()
    buf = bytearray(size)
    view = memoryview(buf)
    lat = []
    while True:
        got = 0
        while got < size:
            n = conn.recv_into(view[got:], size - got)
            if n == 0:
                break
            got += n
        if got < size:
            break
        lat.append(time.monotonic() - struct.unpack("d", buf[:8])[0])
    lat.sort()
    if not lat:
        sys.exit("tcp-frame-latency: no frame arrived")
    print(
        "plain TCP, %d frames of %d bytes at %g fps: p50 %.3f ms, p99 %.3f ms"
        % (len(lat), size, fps, lat[len(lat) // 2] * 1e3, lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3),
        # os._exit skips Python's exit, which would flush a piped stdout.
        flush=True,
    )
    os._exit(0)

listener.close()
sock = socket.create_connection(("127.0.0.1", port))
frame = bytearray(os.urandom(size))
due = time.monotonic()
for _ in range(frames):
    due += 1.0 / fps
    time.sleep(max(0.0, due - time.monotonic()))
    frame[:8] = struct.pack("d", time.monotonic())
    sock.sendall(frame)
sock.close()
_, status = os.wait()
sys.exit(os.waitstatus_to_exitcode(status))
