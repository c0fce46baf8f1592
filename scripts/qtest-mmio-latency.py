#!/usr/bin/env python3
"""Time trapped BAR0 reads of a umdev GPU through QEMU's vfio-user client, driven by qtest.

    scripts/qtest-mmio-latency.py UMDEV no|wm N ROUNDS

Starts `UMDEV run gpu` (with `--write-multiple` for `wm`), then QEMU (`scripts/qemu.sh
qemu`, firmware from `scripts/qemu.sh firmware`) with `-accel qtest` and the device at
00:04.0; programs BAR0 at 0xe0000000 through 0xcf8/0xcfc, then times ROUNDS rounds of N
`readl` of its ID register and prints µs per read for each round. Every read is one qtest
command (a line on a pipe) and one synchronous REGION_READ through QEMU's vfio-user proxy;
the qtest overhead is the same with and without `wm`, so run both interleaved and compare
(protocol-docs/qemu.md). No guest CPU is involved: qtest issues the accesses from QEMU's
main loop.
"""
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def qemu_sh(what):
    out = subprocess.run([os.path.join(HERE, "qemu.sh"), what], check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return out.split()


def main():
    if len(sys.argv) != 5 or sys.argv[2] not in ("no", "wm"):
        raise SystemExit(__doc__)
    umdev, wm = sys.argv[1], sys.argv[2] == "wm"
    n, rounds = int(sys.argv[3]), int(sys.argv[4])
    qemu = os.environ.get("QEMU") or qemu_sh("qemu")[0]
    firmware = qemu_sh("firmware")
    sock = "/tmp/umdev-qtest-mmio-%d.sock" % os.getpid()
    srv = subprocess.Popen(
        [umdev, "run", "gpu", "--socket", sock] + (["--write-multiple"] if wm else []),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, RUST_LOG="warn"))
    try:
        for _ in range(100):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        dev = '{"driver":"vfio-user-pci","socket":{"type":"unix","path":"%s"},"addr":"0x4"}' % sock
        q = subprocess.Popen(
            [qemu, "-machine", "q35", "-accel", "qtest", "-qtest", "stdio", "-display", "none",
             "-nodefaults"] + firmware +
            ["-object", "memory-backend-memfd,id=mem,size=256M,share=on",
             "-machine", "memory-backend=mem", "-device", dev],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, bufsize=1)

        def cmd(c):
            q.stdin.write(c + "\n")
            q.stdin.flush()
            while True:
                line = q.stdout.readline()
                if not line:
                    raise SystemExit("qemu exited")
                if line.startswith(("OK", "FAIL", "ERR")):
                    return line.strip()

        cfg = 0x80000000 | (4 << 11)
        cmd("outl 0xcf8 0x%x" % (cfg | 0x10))
        cmd("outl 0xcfc 0xe0000000")
        cmd("outl 0xcf8 0x%x" % (cfg | 0x04))
        cmd("outw 0xcfc 0x6")
        ident = cmd("readl 0xe0000000")
        if not ident.startswith("OK"):
            raise SystemExit("BAR0 read failed: " + ident)
        per = []
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(n):
                cmd("readl 0xe0000000")
            per.append((time.perf_counter() - t) / n * 1e6)
        print(" ".join("%.2f" % x for x in per))
        q.terminate()
        q.wait()
    finally:
        srv.terminate()
        srv.wait()


if __name__ == "__main__":
    main()
