"""The program that runs in a pod to read a run directory off the claim: `python -c PROGRAM MODE ROOT [...]`.

It needs nothing but the Python standard library, so it works with any image that has `python` (ours has 3.11),
whichever kubetrain version the image holds; and it only reads, so the claim can be mounted read-only.

  list ROOT        one JSON object on stdout: {"files": [[rel, bytes, mtime_ns], ...], "pointers": {rel: text}}
                   (every file under ROOT but in-progress ones: `*.tmp*` names, `checkpoints/.upload/`,
                   `checkpoints/.restore/`;
                   `pointers` holds the text of each checkpoints/latest and checkpoints/best)
  tar ROOT SPEC    an uncompressed tar stream on stdout of the files SPEC names (base64 of zlib of a JSON list
                   of relative paths), in that order; last, a member NOTES with the files that were gone or
                   changed size while they were read (a live run prunes and appends): {"gone": [...],
                   "changed": [...]}. A changed file is padded or cut to the size it had when its header went out.
  mlflow-list ROOT BASE DB
                   the MLflow SQLite store DB (opened read-only): {"db": [bytes, mtime_ns, wal bytes, wal mtime_ns]
                   or null when there is none, "base": BASE resolved, "runs": [[experiment_id, run_id, artifact_uri,
                   artifact folder relative to BASE or null], ...], "files": [[rel to BASE, bytes, mtime_ns], ...],
                   "error": why the store could not be read}. The runs are ROOT's and its phases': the MLflow sink
                   tags each with kubetrain_run_key, a digest of its resolved run directory.
  mlflow-tar ROOT BASE DB SPEC NOTES
                   like tar, of files relative to BASE; with "db" in SPEC ({"db": bool, "files": [...]}) first a
                   member `mlflow.db`: a copy through SQLite's backup API (consistent while a job writes the store),
                   checked with PRAGMA integrity_check; a store that cannot be copied is NOTES' "error".
Exit code 3 with one line on stderr: no run directory at ROOT.
"""

from __future__ import annotations

import base64
import json
import zlib

NOTES = ".kubetrain-fetch-notes.json"
STORE_MEMBER = "mlflow.db"

PROGRAM = r'''
import base64, hashlib, io, json, os, re, sqlite3, sys, tarfile, tempfile, urllib.parse, urllib.request, zlib
mode, root = sys.argv[1], sys.argv[2]
skip = re.compile(r"\.tmp\d*$|^\.upload$|^run\.lock$|^\.restore$")  # in progress; the pod's run lock; a restore's claim
if not os.path.isdir(root):
    parent = os.path.dirname(root.rstrip("/"))
    runs = sorted(d for d in (os.listdir(parent) if os.path.isdir(parent) else [])
                  if os.path.isfile(os.path.join(parent, d, "meta.json")))
    sys.stderr.write("no run directory at %s (run directories there: %s)\n" % (root, ", ".join(runs) or "none"))
    sys.exit(3)

def walk(top, prefix, files):
    for here, dirs, names in os.walk(top):
        dirs[:] = sorted(d for d in dirs if not skip.search(d))
        rel_dir = os.path.relpath(here, top)
        for name in sorted(n for n in names if not skip.search(n)):
            rel = prefix + (name if rel_dir == "." else rel_dir + "/" + name)
            try:
                st = os.stat(os.path.join(here, name))
            except OSError:
                continue
            files.append([rel, st.st_size, st.st_mtime_ns])

if mode == "list":
    files, pointers = [], {}
    walk(root, "", files)
    for rel, _, _ in files:
        parts = rel.split("/")
        if parts[-1] in ("latest", "best") and len(parts) > 1 and parts[-2] == "checkpoints":
            try:
                with open(os.path.join(root, rel)) as f:
                    pointers[rel] = f.read().strip()
            except OSError:
                pass
    json.dump({"files": files, "pointers": pointers}, sys.stdout)
    sys.exit(0)

def read_only(db):
    return sqlite3.connect("file:%s?mode=ro" % urllib.parse.quote(os.path.abspath(db)), uri=True, timeout=30)

def under(base, uri):
    """The folder of a file: URI or path relative to base, or None where it is elsewhere."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme not in ("", "file"):
        return None
    path = os.path.realpath(urllib.request.url2pathname(parsed.path))
    return os.path.relpath(path, base) if path.startswith(base + "/") else None

if mode == "mlflow-list":
    base, db = os.path.realpath(sys.argv[3]), sys.argv[4]
    if not os.path.isfile(db):
        json.dump({"db": None}, sys.stdout)
        sys.exit(0)
    stamp = []
    for path in (db, db + "-wal"):
        st = os.stat(path) if os.path.exists(path) else None
        stamp += [st.st_size, st.st_mtime_ns] if st else [0, 0]
    phases = os.path.join(root, "phases")
    dirs = [root] + [os.path.join(phases, d) for d in sorted(os.listdir(phases) if os.path.isdir(phases) else [])]
    keys = [hashlib.sha256(os.path.realpath(d).encode()).hexdigest()[:16] for d in dirs]
    answer = {"db": stamp, "base": base, "runs": [], "files": []}
    try:
        con = read_only(db)
        rows = con.execute("SELECT r.experiment_id, r.run_uuid, r.artifact_uri FROM runs r JOIN tags t ON "
                           "t.run_uuid = r.run_uuid WHERE t.key = 'kubetrain_run_key' AND t.value IN (%s) "
                           "ORDER BY r.start_time" % ",".join("?" * len(keys)), keys).fetchall()
        con.close()
    except sqlite3.Error as e:
        answer["error"] = "%s: %s" % (db, e)
        rows = []
    for experiment, run, uri in rows:
        rel = under(base, uri or "")
        answer["runs"].append([str(experiment), run, uri, rel])
        if rel is not None:
            walk(os.path.join(base, rel), rel + "/", answer["files"])
    json.dump(answer, sys.stdout)
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

def send(path, name):
    try:
        f = open(path, "rb")
    except OSError:
        notes["gone"].append(name)
        return
    with f:
        st = os.fstat(f.fileno())
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), 0o644
        body = Exact(f, st.st_size)
        out.addfile(info, io.BufferedReader(body, 1 << 20))
        if body.changed or os.fstat(f.fileno()).st_size != st.st_size:
            notes["changed"].append(name)

def send_store(db, name):
    """A consistent copy of a store another process may be writing: SQLite's backup API (it retries while a
    writer holds the lock), into /tmp (the claim may be read-only), checked before it goes out."""
    fd, copy = tempfile.mkstemp(suffix=".db")
    os.close(fd)
    try:
        source, target = read_only(db), sqlite3.connect(copy)
        with target:
            source.backup(target)
        check = target.execute("PRAGMA integrity_check").fetchone()[0]
        source.close()
        target.close()
        if check != "ok":
            notes["error"] = "%s: the copy fails PRAGMA integrity_check: %s" % (db, check)
        else:
            send(copy, name)
    except sqlite3.Error as e:
        notes["error"] = "%s: %s" % (db, e)
    finally:
        os.unlink(copy)

notes = {"gone": [], "changed": []}
out = tarfile.open(fileobj=sys.stdout.buffer, mode="w|", format=tarfile.PAX_FORMAT)
if mode == "tar":
    for rel in json.loads(zlib.decompress(base64.b64decode(sys.argv[3]))):
        send(os.path.join(root, rel), rel)
else:
    base, db = sys.argv[3], sys.argv[4]
    spec = json.loads(zlib.decompress(base64.b64decode(sys.argv[5])))
    if spec["db"]:
        send_store(db, "mlflow.db")
    for rel in spec["files"]:
        send(os.path.join(base, rel), rel)
data = json.dumps(notes).encode()
info = tarfile.TarInfo(sys.argv[-1])
info.size = len(data)
out.addfile(info, io.BytesIO(data))
out.close()
sys.stdout.buffer.flush()
'''


def _spec(value: object) -> str:
    return base64.b64encode(zlib.compress(json.dumps(value).encode(), 9)).decode()


def list_args(root: str) -> list[str]:
    return ["list", root]


def tar_args(root: str, rels: list[str]) -> list[str]:
    return ["tar", root, _spec(rels), NOTES]


def store_list_args(root: str, base: str, db: str) -> list[str]:
    return ["mlflow-list", root, base, db]


def store_tar_args(root: str, base: str, db: str, copy_db: bool, rels: list[str]) -> list[str]:
    return ["mlflow-tar", root, base, db, _spec({"db": copy_db, "files": rels}), NOTES]


def command(python: str, args: list[str]) -> list[str]:
    """The argv that runs the program with `python` (the pod's `python`, or this interpreter)."""
    return [python, "-c", PROGRAM, *args]
