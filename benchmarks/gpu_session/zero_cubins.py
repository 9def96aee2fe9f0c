"""Zero the payloads of the fatbin entries a sm_90 GPU never loads (cubins for sm_60/70/80/89), keeping
every header, the sm_90 cubin and the compute_90 PTX; the file keeps its size and layout.

Usage: python zero_cubins.py LIB.so [...]     (in place)
       python zero_cubins.py --list LIB.so [...]   (sizes per architecture)

The carried TensorFlow wheel is 573 MB; its libraries hold cubins for five architectures. The
zeroed payloads compress to nothing, which brought the carried site-packages to 235 MB of xz
(4 calls of 56 MiB). The CUDA driver reads only the entry it selects (sm_90 on an H100).
"""
import collections
import mmap
import struct
import subprocess
import sys


def sections(path):
    """(file offset, size) of the ``.nv_fatbin`` section of an ELF shared library."""
    out = subprocess.run(["readelf", "-SW", path], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if ".nv_fatbin" in line:
            fields = line.split("]")[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    raise SystemExit(f"{path}: no .nv_fatbin section")


def entries(buf, off, end):
    """The fatbin entries between `off` and `end`: kind (1 PTX, 2 cubin), arch, payload offset and size."""
    while off < end:
        magic, _version, header_size, size = struct.unpack_from("<IHHQ", buf, off)
        if magic != 0xBA55ED50:      # alignment padding between two fatbins
            off += 8
            continue
        p, stop = off + header_size, off + header_size + size
        while p < stop:
            kind, _unknown, entry_header, payload = struct.unpack_from("<HHIQ", buf, p)
            arch, = struct.unpack_from("<I", buf, p + 28)
            yield dict(kind=kind, arch=arch, payload=p + entry_header, size=payload)
            p += entry_header + payload
        off = stop


def zero(paths):
    for path in paths:
        off, size = sections(path)
        with open(path, "r+b") as f:
            buf = mmap.mmap(f.fileno(), 0)
            todo = [e for e in entries(buf, off, off + size) if e["kind"] == 2 and e["arch"] != 90]
            zeroed = 0
            for e in todo:
                buf[e["payload"]:e["payload"] + e["size"]] = b"\0" * e["size"]
                zeroed += e["size"]
            buf.flush()
            print(path, len(todo), "entries", zeroed / 1e6, "MB zeroed")


if __name__ == "__main__":
    if sys.argv[1] == "--list":
        for path in sys.argv[2:]:
            off, size = sections(path)
            buf = open(path, "rb").read()
            sizes = collections.Counter()
            for e in entries(buf, off, off + size):
                sizes[(e["kind"], e["arch"])] += e["size"]
            print(path, {f"{'ptx' if k == 1 else 'sm'}_{a}": f"{v / 1e6:.1f} MB" for (k, a), v in sorted(sizes.items())})
    else:
        zero(sys.argv[1:])
