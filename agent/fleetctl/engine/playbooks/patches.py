"""`apply --export-patch DIR`: a check pass's plans written as patch files, for image builds.

Image-based fleets bake a change into the image instead of changing hosts. From the check pass
(nothing is changed), every install's planned edits become a unified diff with `a/sglang/...` /
`b/sglang/...` headers relative to the install's `location`, so `patch -p1 -d LOCATION` applies it
to any install kind (wheel, editable, checkout). One file per distinct (SGLang version,
pre-image set): `<playbook>-sglang-<version>.patch` when the pre-images are the release's own,
else `<playbook>-sglang-<version>-<hash8>.patch` (hash8: of the pre-image set).

Before a file is written it is checked: `patch --dry-run -p1`, then `patch -p1`, on a pristine
copy of the files, and every patched file must hash to the post-image fleetctl planned. The
pristine copy comes from the release wheel (`--pristine-dir DIR` of wheels, else the wheel cache,
`pip download` when absent; its sha256 goes in the patch's header); an install whose pre-images
differ from the wheel (a checkout with local commits, say) is checked against the pre-images
fleetctl read on the host instead, and the header says so.

What the hosts reported is confined before it names anything here (security review N2): each
file (hostpaths.package_file), the SGLang version (hostpaths.release: it names the patch and
the wheel) and the install id (hostpaths.printable: it goes into the header `patch` reads); a
host that gives another is refused by name and nothing is written. The pristine copy is made
of fresh files in a new temporary directory, and a patch file replaces whatever is at its name
in DIR (a link there is removed, never followed).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import FleetctlError
from ...hostpaths import Refused, package_file, printable, release
from ..context import HostResult
from ...wheels import ensure_wheel

PATCH_TIMEOUT_S = 60


class ExportError(FleetctlError):
    """A patch could not be written or does not apply to what it was checked against."""


@dataclass
class PatchGroup:
    """Edits shared by installs of one SGLang version with the same pre-images: files
    [{rel, pre_sha256, post_sha256, pre_text, post_text, diff}] by rel; who: ["host (install)"]."""

    version: str | None
    files: list[dict]
    who: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        """hash8 of the pre-image set."""
        blob = "\n".join(f"{f['rel']} {f['pre_sha256']}" for f in self.files)
        return hashlib.sha256(blob.encode()).hexdigest()[:8]


def exportable(install: str, rels: list[str], version: str | None) -> None:
    """Check what an install's plan puts into an export: its id (hostpaths.printable: it goes into
    the patch's header), its files (hostpaths.package_file) and its SGLang version (None:
    unknown; else hostpaths.release: it names the patch and the wheel). Raises hostpaths.Refused."""
    printable(install, "an install id")
    for rel in rels:
        package_file(rel)
    if version is not None:
        release(version)


def groups(results: list[HostResult]) -> list[PatchGroup]:
    """The distinct (version, pre-image set) of the changing installs in check results (data
    "plans", "install_sglang" and "texts", as check_job gives them with export on), first-seen order.
    Raises ExportError "host NAME: refused ..." when a host's file, version or install id is not
    one fleetctl uses (see the module docstring)."""
    out: dict[tuple, PatchGroup] = {}
    for r in results:
        d = r.data or {}
        for plan in d.get("plans", []):
            if not plan["files"]:
                continue
            version = (d.get("install_sglang", {}).get(plan["install"]) or {}).get("version")
            try:
                exportable(plan["install"], [f["rel"] for f in plan["files"]], version)
            except Refused as e:
                raise ExportError(f"host {r.host}: {e}") from None
            files = sorted(({"rel": f["rel"], "pre_sha256": f["pre_sha256"], "post_sha256": f["post_sha256"],
                             "diff": f["diff"], **d["texts"][f["path"]]} for f in plan["files"]),
                           key=lambda f: f["rel"])
            key = (version, tuple((f["rel"], f["pre_sha256"]) for f in files))
            out.setdefault(key, PatchGroup(version, files)).who.append(f"{r.host} ({plan['install']})")
    return list(out.values())


def _wheel(version: str | None, pristine_dir: Path | None) -> Path | None:
    """The release wheel of `version`: from `pristine_dir`, else the wheel cache (downloaded when
    absent); None when there is no version or it cannot be had."""
    if version is None:
        return None
    if pristine_dir is not None:
        return next(iter(sorted(pristine_dir.glob(f"sglang-{version}-*.whl"))), None)
    try:
        return ensure_wheel(version)
    except FleetctlError:
        return None


def _pristine(wheel: Path | None, rels: list[str]) -> dict[str, bytes] | None:
    """{rel: bytes} of `rels` in the wheel, or None when there is no wheel or it lacks one."""
    if wheel is None:
        return None
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        if not all(rel in names for rel in rels):
            return None
        return {rel: z.read(rel) for rel in rels}


def check_patch(text: str, pre: dict[str, bytes], post_sha256: dict[str, str]) -> None:
    """Apply `text` with `patch -p1` to a temporary copy holding `pre` ({rel: bytes}; each rel a
    file of an install, hostpaths.package_file, made as a fresh file in a new directory): a dry
    run first, then for real; the copy must then hold no file but those of `pre`, and each must
    hash to `post_sha256[rel]`. Raises ExportError with patch's own output or naming the file,
    hostpaths.Refused for a rel outside the install (nothing is written for it)."""
    for rel in pre:
        package_file(rel)
    with tempfile.TemporaryDirectory(prefix="fleetctl-patch-") as tmp:
        for rel, data in pre.items():
            p = Path(tmp, rel)
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except OSError as e:
                raise ExportError(f"{rel}: cannot be made in the pristine copy: {e.strerror}") from None
            with open(fd, "wb") as f:
                f.write(data)
        for extra in (["--dry-run"], []):
            r = subprocess.run(["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", *extra, "-d", tmp],
                               input=text.encode(), capture_output=True, timeout=PATCH_TIMEOUT_S)
            if r.returncode != 0:
                raise ExportError(f"patch {' '.join(extra)} -p1 failed: {(r.stdout + r.stderr).decode(errors='replace')}")
        made = _made(tmp)
        for what, names in (("makes", made - set(pre)), ("removes", set(pre) - made)):
            if names:
                raise ExportError(f"the patch {what} {', '.join(sorted(names))}, which fleetctl did not plan")
        for rel, want in post_sha256.items():
            got = hashlib.sha256(Path(tmp, rel).read_bytes()).hexdigest()
            if got != want:
                raise ExportError(f"{rel}: patched bytes hash to {got[:12]}, apply writes {want[:12]}")


def _made(root: str) -> set[str]:
    """Every entry under `root` that is not a directory, as a POSIX path relative to it (a link
    to a directory included: os.walk lists it with the directories and never enters it)."""
    out = set()
    for d, dirs, files in os.walk(root):
        links = [n for n in dirs if os.path.islink(os.path.join(d, n))]
        out |= {Path(d, n).relative_to(root).as_posix() for n in files + links}
    return out


def write_patches(results: list[HostResult], playbook: str, out_dir: Path,
                  pristine_dir: Path | None = None) -> list[Path]:
    """Write one checked patch per distinct (version, pre-image set) into `out_dir` (created),
    each a file made new there (whatever was at its name, a link included, is removed first).
    Returns the paths written. Raises ExportError when a host's file, version or install id is
    refused (groups: nothing is written at all) or a patch does not apply to what it is checked
    against (nothing is written for it)."""
    found = groups(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for g in found:
        rels = [f["rel"] for f in g.files]
        wheel = _wheel(g.version, pristine_dir)
        pristine = _pristine(wheel, rels)
        read = {f["rel"]: f["pre_text"].encode("utf-8") for f in g.files}
        same = pristine is not None and all(hashlib.sha256(pristine[r]).hexdigest() == f["pre_sha256"]
                                            for r, f in zip(rels, g.files))
        body = "".join(f["diff"] for f in g.files)
        if same:
            sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
            against = f"checked against: {wheel.name} sha256 {sha} (patch --dry-run -p1 on a pristine copy)"
        else:
            why = "no release wheel" if pristine is None else "they differ from the release wheel"
            against = f"checked against: the pre-images fleetctl read on the host ({why})"
        pre_list = ", ".join(f"{f['rel']} {f['pre_sha256'][:12]}" for f in g.files)
        header = (f"fleetctl {playbook} for SGLang {g.version or 'unknown version'}\n{against}\n"
                  f"pre-images: {g.key} ({pre_list})\n"
                  f"planned on: {', '.join(g.who)}\n"
                  f"apply with: patch -p1 -d LOCATION < this file   (LOCATION: the directory holding sglang/)\n\n")
        check_patch(header + body, pristine if same else read, {f["rel"]: f["post_sha256"] for f in g.files})
        name = f"{playbook}-sglang-{g.version or 'unknown'}" + ("" if same else f"-{g.key}") + ".patch"
        path = out_dir / name
        _write_new(path, header + body)
        written.append(path)
    return written


def _write_new(path: Path, text: str) -> None:
    """`text` (UTF-8) as a file made new at `path`: what is there is removed first (a link is
    unlinked, never followed), and the file is created O_EXCL|O_NOFOLLOW (mode 0666 less the
    umask). Raises ExportError naming the path."""
    try:
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        raise ExportError(f"cannot write {path}: {e.strerror}") from None
    with open(fd, "w", encoding="utf-8") as f:
        f.write(text)
