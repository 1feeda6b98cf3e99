"""Remote probe helper: the host's own GNU grep as the scan's prefilter (issue 55).

Stdlib only (Python 3.8+). The scan's prefilter (callsites.file_entry without parsing) reads each
source file for two facts: does it hold a needle (callsites._NEEDLES), and which `class <name>`
lines does it have (callsites._CLASS_RE). In Python that read was most of a cold scan (0.5.23's
4024 files: 0.9-1.8 s on an idle 2-CPU machine, 4.4-16 s on a lab host sharing it) where
`grep -rl` of the same needles takes 0.15 s. prefilter() gets the same two facts from one
`grep -r -o` over the tree and says None whenever it cannot vouch for them (no trusted GNU
grep, grep reported an error, the output is over MAX_OUTPUT_BYTES, it ran past DEADLINE_S):
the caller then reads the files in Python, as before. tests/unit/test_grepfilter.py checks the
two paths give the same cache entries on every release tree and on a hostile one.

The grep run: root's /usr/bin/grep or /bin/grep only (every component from / owned by root, not
a link, writable by nobody else: a probe may run as root, and the binary is then root's own),
argv as a list (no shell), LC_ALL=C (bytes, as Python's bytes patterns), `-r` (never follows a
link below the top), `-D skip` (never opens a FIFO or a device), `-a` (a file with NUL bytes is
still searched as text, as Python's substring test does), `-Z` (a file name ends at NUL, so a
name holding a newline parses), the test/tests/__pycache__ directories excluded as the walk
skips them. A file the walk found and grep printed nothing for holds neither a needle nor a
class line; the walk's own lstat gives each file's identity, taken before grep reads it (a file
changed in between is read again by the next scan, as its identity then differs).
"""

import os
import select
import signal
import stat
import subprocess
import time

GREPS = ("/usr/bin/grep", "/bin/grep")
MAX_OUTPUT_BYTES = 32 << 20  # 0.5.23's tree: 0.4 MiB
DEADLINE_S = 120.0
_ENV = {"LC_ALL": "C", "PATH": "/usr/bin:/bin"}


def system_grep():
    """The absolute path of root's GNU grep (GREPS, first found), or None: the file and every
    directory above it belong to uid 0, are not symlinks and are writable by nobody else, and
    `grep --version` names GNU grep."""
    for path in GREPS:
        ok, cur = True, ""
        for comp in [""] + path.split("/")[1:]:
            cur = cur + "/" + comp if comp else "/"
            cur = cur.replace("//", "/")
            try:
                st = os.lstat(cur)
            except OSError:
                ok = False
                break
            if stat.S_ISLNK(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
                ok = False
                break
        if not ok or not stat.S_ISREG(st.st_mode):
            continue
        out = _run([path, "--version"], 4096)
        if out is not None and out[1] == 0 and out[0].startswith(b"grep (GNU grep)"):
            return path
    return None


def _run(argv, limit):
    """(stdout bytes, exit status) of `argv` (no shell, env _ENV, stdin and stderr /dev/null), or
    None when it printed more than `limit` bytes or ran past DEADLINE_S (then it is killed)."""
    try:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             env=_ENV, start_new_session=True, close_fds=True)
    except OSError:
        return None
    chunks, size, end = [], 0, time.monotonic() + DEADLINE_S
    fd = p.stdout.fileno()
    try:
        while True:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            data = os.read(fd, 1 << 20)
            if not data:
                break
            size += len(data)
            if size > limit:
                return None
            chunks.append(data)
        return b"".join(chunks), p.wait()
    finally:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait()
        p.stdout.close()


def prefilter(grep, top, files, needles, skip_dirs, max_bytes):
    """{path: entry} for `files` ([(path, ...)] under directory `top`, as the walk found them):
    entry {"id": callsites.identity, "candidate": holds one of `needles` (bytes), "class_names"
    (non-candidates: callsites._CLASS_RE's names in order, each once)}, or None when grep cannot
    vouch for them all (see the module docstring). A file that is not a regular one or is over
    `max_bytes` is left out of the answer: the caller reads it (and reports why not)."""
    pattern = b"|".join(needles + (b"^[ \t]*class[ \t]+[A-Za-z0-9_]+",))
    argv = [grep, "-r", "-o", "-a", "-Z", "-E", "-D", "skip", "--include=*.py"]
    argv += ["--exclude-dir=" + d for d in sorted(skip_dirs)] + ["-e", pattern, "--", top]
    ran = _run(argv, MAX_OUTPUT_BYTES)
    if ran is None or ran[1] not in (0, 1):  # 2: an error (a file or directory it could not read)
        return None
    out, found, pos = ran[0], {}, 0
    while pos < len(out):
        nul = out.find(b"\0", pos)
        eol = out.find(b"\n", nul + 1)
        if nul < 0 or eol < 0:
            return None  # cut short: not grep's usual output
        found.setdefault(out[pos:nul], []).append(out[nul + 1:eol])
        pos = eol + 1
    entries = {}
    for path in (f[0] for f in files):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            continue
        matches = found.get(os.fsencode(path), [])
        entry = {"id": [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino],
                 "candidate": any(n in m for m in matches for n in needles)}
        if not entry["candidate"]:
            names = [m.split(None, 1)[1].decode("ascii") for m in matches]
            entry["class_names"] = sorted(set(names), key=names.index)
        entries[path] = entry
    return entries
