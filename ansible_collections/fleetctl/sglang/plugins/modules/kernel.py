#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, fleetctl maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: kernel
short_description: Build, test and activate a fleetctl kernel package on a host, as C(fleetctl deploy kernel) does
description:
  - On the controller (action plugin) it loads the kernel package (C(kernels/NAME/kernel.yaml)), asks the host for its
    build facts (GPU arch, nvcc, torch, with the interpreter that serves SGLang, found by M(fleetctl.sglang.inspect)),
    and computes the build key. A build of the key that passed its reference test before (privately) or was
    published is reused; otherwise the package is transferred (each file's sha256 checked on the host), built
    privately into O(state_dir)/kernels/NAME/KEY/build and tested against the package's reference in a fresh process,
    then marked PASSED.
  - The passed build is published, as C(fleetctl deploy kernel) publishes it, to C(/var/lib/fleetctl-kernels/NAME/KEY)
    (a copy owned by root that every user may read, so an unprivileged SGLang server can load it; a copy published
    before is checked and kept).
  - The activation is the same ledger change as C(fleetctl deploy kernel)'s, written by M(fleetctl.sglang.patch)'s
    host side - the C(/var/lib/fleetctl-kernels/NAME/current) link swapped atomically and the dispatch table
    C(/var/lib/fleetctl-kernels/NAME/dispatch.json) beside it written, rolled back together - and stays C(pending)
    until M(fleetctl.sglang.smoke) gates and commits it, or O(commit) commits it at once. The table routes the shapes
    O(route) names, else nothing (this module measures no speedup; a measured table comes from
    C(fleetctl deploy kernel) on a GPU host). The same build with a table that routes the same is nothing to do; the
    same build with another O(route) writes only the table. C(fleetctl status) shows the active build and what its
    table routes; C(fleetctl rollback) and O(state=rolled_back) put link and table back.
  - This module's own arguments O(step), O(python) and O(params) are the action plugin's; a task names the package.
version_added: "0.1.0"
author:
  - fleetctl maintainers (@fleetctl)
options:
  name:
    description: The kernel package (a directory of O(kernels_dir) holding C(kernel.yaml)).
    type: str
  kernels_dir:
    description: Where kernel packages are found on the controller (default fleetctl's own C(kernels/)).
    type: path
  state:
    description: V(activated) builds if needed and activates; V(rolled_back) switches back the change O(change_id).
    type: str
    choices: [activated, rolled_back]
    default: activated
  change_id:
    description: The activation to roll back (the RV(change_id) an earlier run returned).
    type: str
  commit:
    description: Commit the activation at once (no smoke gate).
    type: bool
    default: false
  force:
    description: Roll back even when the link changed since the activation.
    type: bool
    default: false
  route:
    description:
      - What the build's dispatch table routes to it, recorded as the operator's (source C(operator)), as
        C(fleetctl deploy kernel --route) takes it - V(all), or shapes C(HEAD_DIM:GROUP:DRAFT_TOKENS:DTYPE[:MAX_BATCH])
        (DTYPE float16, bfloat16 or float32; no MAX_BATCH - any batch), a list or one comma-separated string.
      - Without it the table routes nothing (source C(none)).
    type: raw
  max_jobs:
    description: Cap on parallel compile jobs on the host.
    type: int
    default: 4
  build_timeout:
    description: Seconds the build may take (waiting for another build of the same key included).
    type: float
    default: 1800
  state_dir:
    description: fleetctl's state directory on the host (ledger, kernel builds, lock).
    type: path
    default: /var/lib/fleetctl
  step:
    description: One host step, run by the action plugin. Not for direct use.
    type: str
    choices: [preflight, state, upload, build, test, mark, publish]
  python:
    description: The interpreter that serves SGLang (it has torch), for the action plugin's steps. Not for direct use.
    type: str
  params:
    description: The step's parameters, made by the action plugin. Not for direct use.
    type: dict
  timeout:
    description: Seconds the step may take on the host before it is killed, set by the action plugin. Not for direct use.
    type: float
    default: 120
attributes:
  check_mode:
    support: full
    description: Says whether it would build, publish and activate, and the table it would write (RV(table));
      uploads, builds, publishes and changes nothing.
  diff_mode:
    support: none
    description: An activation swaps a link and writes a table; the result names the build before (RV(previous)) and
      after (RV(build_key)), and the table (RV(table)).
  action:
    support: full
    description: The action plugin loads the package and computes the build key on the controller.
"""

EXAMPLES = r"""
- name: Deploy the verify_attention kernel
  fleetctl.sglang.kernel:
    name: verify_attention
    max_jobs: 8
  register: kernel
  notify: restart sglang

- name: Route every shape the build serves to it
  fleetctl.sglang.kernel:
    name: verify_attention
    route: all

- name: Route two shapes (the second at any batch size)
  fleetctl.sglang.kernel:
    name: verify_attention
    route: ["64:2:4:float32:8", "128:4:4:bfloat16"]

- name: Switch back
  fleetctl.sglang.kernel:
    state: rolled_back
    change_id: "{{ kernel.change_id }}"
"""

RETURN = r"""
change_id:
  description: The activation's ledger id.
  returned: when the active build or its dispatch table changed, or with O(state=rolled_back)
  type: str
build_key:
  description: The build key (package, backend, torch, CUDA, nvcc, arch hashed).
  returned: with O(state=activated)
  type: str
backend:
  description: The backend built (cpu or cuda).
  returned: with O(state=activated)
  type: str
previous:
  description: The build active before (null - none).
  returned: with O(state=activated)
  type: str
reused:
  description: Whether a build that passed its reference test before, or was published, was reused.
  returned: with O(state=activated)
  type: bool
published:
  description: The published build's directory (/var/lib/fleetctl-kernels/NAME/KEY).
  returned: with O(state=activated), not in check mode
  type: str
table:
  description:
    - The dispatch table in force after the run (check mode - the one it would write), as the file holds it (schema,
      kernel, build, backend, source V(operator) or V(none), route, all, entries, measured, why, made).
  returned: with O(state=activated), unless it failed
  type: dict
build:
  description: The build (ok, seconds, log_path, timed_out, removed_stale_lock).
  returned: when it built
  type: dict
test:
  description: The reference test's result (ok, cases, failures, seed).
  returned: when it built
  type: dict
"""

import base64
import hashlib
import json
import os
import subprocess

from ansible.module_utils.basic import AnsibleModule
# kbuild is imported so that Ansible's module bundler packs it, and the probes it imports, into
# this module's payload: under() sends their sources (probe_bundle.document)
from ansible_collections.fleetctl.sglang.plugins.module_utils import probe_bundle, safefs
from ansible_collections.fleetctl.sglang.plugins.module_utils.kernel import kbuild  # noqa: F401


def under(python, action, params, timeout):
    """Run kbuild's `action` with `params` as a probe bundle under `python` (the interpreter that
    serves SGLang: builds and tests use its torch), killed after `timeout` seconds (builds and
    tests enforce their own deadline_s inside it). Raises probe_bundle.ProbeError (no result, or
    the deadline passed)."""
    doc = probe_bundle.document("kernel.kbuild", dict(params, action=action))
    try:
        r = subprocess.run([python, "-c", probe_bundle.WRAPPER], input=json.dumps(doc).encode(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/", timeout=timeout)
    except subprocess.TimeoutExpired:
        raise probe_bundle.ProbeError("%s did not answer within %g s" % (action, timeout))
    return probe_bundle.parse_output(r.stdout, r.stderr, r.returncode)


def upload(src_dir, files):
    """Write each {relpath: {"b64", "sha256"}} under src_dir (created 0700, no link followed on the
    way: safefs.open_dir), each through a private temp file renamed into place once its sha256 is
    the controller's. Raises ValueError (a bad path or a damaged transfer), safefs.UnsafePath."""
    for rel, f in sorted(files.items()):
        parts = rel.split("/")
        if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError("%r: not a relative path inside the package" % rel)
        data = base64.b64decode(f["b64"])
        if hashlib.sha256(data).hexdigest() != f["sha256"]:
            raise ValueError("%s: the transfer was damaged (sha256 differs)" % rel)
        dfd = safefs.open_dir(os.path.join(src_dir, *parts[:-1]), 0o700)
        tmp = ".%s.%d.tmp" % (parts[-1], os.getpid())
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
        finally:
            os.close(dfd)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            name=dict(type="str"), kernels_dir=dict(type="path"),
            state=dict(type="str", default="activated", choices=["activated", "rolled_back"]),
            change_id=dict(type="str"), commit=dict(type="bool", default=False), force=dict(type="bool", default=False),
            route=dict(type="raw"), max_jobs=dict(type="int", default=4), build_timeout=dict(type="float", default=1800),
            state_dir=dict(type="path", default="/var/lib/fleetctl"),
            step=dict(type="str", choices=["preflight", "state", "upload", "build", "test", "mark", "publish"]),
            python=dict(type="str"), params=dict(type="dict"), timeout=dict(type="float", default=120),
        ),
        required_together=[("step", "python", "params")],
        supports_check_mode=True,
    )
    p = module.params
    if not p["step"]:
        module.fail_json(msg="fleetctl.sglang.kernel runs through its action plugin, which loads the package")
    changing = p["step"] in ("upload", "build", "mark", "publish")
    if module.check_mode and changing:
        module.fail_json(msg="check mode: the %s step changes the host" % p["step"])
    try:
        if p["step"] == "upload":
            upload(p["params"]["src_dir"], p["params"]["files"])
            module.exit_json(changed=True, answer={"files": sorted(p["params"]["files"])})
        answer = under(p["python"], p["step"], p["params"], p["timeout"])
    except (ValueError, OSError, safefs.UnsafePath, probe_bundle.ProbeError) as e:
        module.fail_json(msg="%s: %s" % (p["step"], e))
    module.exit_json(changed=changing, answer=answer)


if __name__ == "__main__":
    main()
