#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, fleetctl maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: inspect
short_description: What SGLang installs, servers and KV pool allocator call sites a host has
description:
  - Runs fleetctl's facts probe on the host, the same code as C(fleetctl inspect --json).
  - Finds the SGLang servers and every install (a tree where some interpreter's C(import sglang) resolves),
    asks each install of its own interpreter (re-running this module's own payload under that interpreter),
    and scans each install for allocator call sites and need_sort origins.
  - Returns the same per-host JSON as C(fleetctl inspect --json), as the result and as the fact C(fleetctl).
version_added: "0.1.0"
author:
  - fleetctl maintainers (@fleetctl)
options:
  python:
    description:
      - The inventory's interpreter, asked as C(fleetctl inspect) asks the inventory's C(ansible_python_interpreter)
        or C(fleetctl_python) (the collection's action plugins pass that); servers' own, python3 on PATH and
        common venv locations are always asked as well.
      - Default is the interpreter Ansible runs this module with (C(ansible_python_interpreter), or the one
        Ansible discovered).
    type: str
  scan:
    description: Scan each install for allocator call sites and need_sort origins.
    type: bool
    default: true
  with_sources:
    description: Return the text of every file holding a need_sort origin (what planning reads).
    type: bool
    default: false
attributes:
  check_mode:
    support: full
    description: Reads only.
  diff_mode:
    support: none
    description: Reads only.
notes:
  - A host with an install whose scan failed (its package directory not found) fails, and keeps its facts.
"""

EXAMPLES = r"""
- name: Gather SGLang facts
  fleetctl.sglang.inspect:
  register: sglang

- name: Show the primary install's need_sort origins
  ansible.builtin.debug:
    var: ansible_facts.fleetctl.need_sort_origins
"""

RETURN = r"""
facts:
  description: The host's facts (hostname, python, sglang, torch, gpus, servers, interpreter_discovery).
  returned: always
  type: dict
installs:
  description: Every SGLang install, each with its call sites, need_sort origins and scan.
  returned: always
  type: list
  elements: dict
allocator_call_sites:
  description: The primary install's allocator call sites.
  returned: always
  type: list
  elements: dict
need_sort_origins:
  description: The primary install's need_sort origins.
  returned: always
  type: list
  elements: dict
scan:
  description: The primary install's scan (files, stats, parse_errors, elapsed_s, error).
  returned: always
  type: dict
"""

import json
import sys

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.fleetctl.sglang.plugins.module_utils import probe_bundle, runas
from ansible_collections.fleetctl.sglang.plugins.module_utils.facts import host as facts


def own_payload(params):
    """This module's probes as a fleetctl probe bundle (the JSON text the facts probe re-runs
    under an install's interpreter): the facts probe's module_utils, which Ansible packed into
    this module's payload because facts imports them (`from . import x`), in load order
    (probe_bundle.document)."""
    return json.dumps(probe_bundle.document("facts.host", params))


def main():
    module = AnsibleModule(
        argument_spec=dict(python=dict(type="str"), scan=dict(type="bool", default=True),
                           with_sources=dict(type="bool", default=False)),
        supports_check_mode=True,
    )
    # the interpreter this module runs under is ansible_python_interpreter: the inventory's, to the facts probe
    params = {"python": module.params["python"] or sys.executable, "scan": module.params["scan"],
              "with_sources": module.params["with_sources"]}
    # facts.ask re-runs the probe bundle it was loaded from (runas.rerun, as an unprivileged uid):
    # here, this module's own payload
    runas.FLEETCTL_BUNDLE = own_payload(params)
    runas.FLEETCTL_WRAPPER = probe_bundle.WRAPPER
    res = facts.main(params)
    errors = ["%s: %s" % (i["id"], i["scan"]["error"]) for i in res["installs"] if (i.get("scan") or {}).get("error")]
    if errors:
        module.fail_json(msg="; ".join(errors), ansible_facts={"fleetctl": res}, **res)
    module.exit_json(changed=False, ansible_facts={"fleetctl": res}, **res)


if __name__ == "__main__":
    main()
