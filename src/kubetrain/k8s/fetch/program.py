"""The program that runs in a pod to read a run directory off the claim: `python -c PROGRAM MODE ROOT [SPEC]`.

It needs nothing but the Python standard library, so it works with any image that has `python` (ours has 3.11),
whichever kubetrain version the image holds; and it only reads, so the claim can be mounted read-only.

  list ROOT        one JSON object on stdout: {"files": [[rel, bytes, mtime_ns], ...], "pointers": {rel: text}}
                   (every file under ROOT but in-progress ones: `*.tmp*` names, `checkpoints/.upload/`;
                   `pointers` holds the text of each checkpoints/latest and checkpoints/best)
  tar ROOT SPEC    an uncompressed tar stream on stdout of the files SPEC names (base64 of zlib of a JSON list
                   of relative paths), in that order; last, a member NOTES with the files that were gone or
                   changed size while they were read (a live run prunes and appends): {"gone": [...],
                   "changed": [...]}. A changed file is padded or cut to the size it had when its header went out.
Exit code 3 with one line on stderr: no run directory at ROOT.
"""

from __future__ import annotations

import base64
import json
import zlib

NOTES = ".kubetrain-fetch-notes.json"

PROGRAM = r'''
import base64, io, json, os, re, sys, tarfile, zlib
mode, root = sys.argv[1], sys.argv[2]
skip = re.compile(r"\.tmp\d*$|^\.upload$")
if not os.path.isdir(root):
    parent = os.path.dirname(root.rstrip("/"))
    runs = sorted(d for d in (os.listdir(parent) if os.path.isdir(parent) else [])
                  if os.path.isfile(os.path.join(parent, d, "meta.json")))
    sys.stderr.write("no run directory at %s (run directories there: %s)\n" % (root, ", ".join(runs) or "none"))
    sys.exit(3)
if mode == "list":
    files, pointers = [], {}
    for here, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not skip.search(d))
        rel_dir = os.path.relpath(here, root)
        for name in sorted(n for n in names if not skip.search(n)):
            rel = name if rel_dir == "." else rel_dir + "/" + name
            try:
                st = os.stat(os.path.join(here, name))
                if name in ("latest", "best") and os.path.basename(here) == "checkpoints":
                    with open(os.path.join(here, name)) as f:
                        pointers[rel] = f.read().strip()
            except OSError:
                continue
            files.append([rel, st.st_size, st.st_mtime_ns])
    json.dump({"files": files, "pointers": pointers}, sys.stdout)
    sys.exit(0)

class Exact(io.RawIOBase):
    """A file read as exactly `size` bytes (zeros past an early end), noting whether it changed."""
    def __init__(self, f, size):
        self.f, self.left, self.changed = f, size, False
    def readable(self):
        return True
    def readinto(self, buf):
        n = min(len(buf), self.left)
        got = self.f.readinto(memoryview(buf)[:n]) if n else 0
        if got < n:
            self.changed = True
            buf[got:n] = bytes(n - got)
        self.left -= n
        return n

wanted = json.loads(zlib.decompress(base64.b64decode(sys.argv[3])))
notes = {"gone": [], "changed": []}
out = tarfile.open(fileobj=sys.stdout.buffer, mode="w|", format=tarfile.PAX_FORMAT)
for rel in wanted:
    try:
        f = open(os.path.join(root, rel), "rb")
    except OSError:
        notes["gone"].append(rel)
        continue
    with f:
        st = os.fstat(f.fileno())
        info = tarfile.TarInfo(rel)
        info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), 0o644
        body = Exact(f, st.st_size)
        out.addfile(info, io.BufferedReader(body, 1 << 20))
        if body.changed or os.fstat(f.fileno()).st_size != st.st_size:
            notes["changed"].append(rel)
data = json.dumps(notes).encode()
info = tarfile.TarInfo(sys.argv[4])
info.size = len(data)
out.addfile(info, io.BytesIO(data))
out.close()
sys.stdout.buffer.flush()
'''


def list_args(root: str) -> list[str]:
    return ["list", root]


def tar_args(root: str, rels: list[str]) -> list[str]:
    spec = base64.b64encode(zlib.compress(json.dumps(rels).encode(), 9)).decode()
    return ["tar", root, spec, NOTES]


def command(python: str, args: list[str]) -> list[str]:
    """The argv that runs the program with `python` (the pod's `python`, or this interpreter)."""
    return [python, "-c", PROGRAM, *args]
