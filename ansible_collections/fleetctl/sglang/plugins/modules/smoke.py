#!/usr/bin/python
# -*- coding: utf-8 -*-
# Copyright: (c) 2026, fleetctl maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: smoke
short_description: Smoke decode on a host's SGLang servers, gated against a baseline registered earlier
description:
  - Runs fleetctl's smoke probe on the host (16 greedy tokens from each server, plus an offline command), the same
    code as C(fleetctl validate).
  - With O(baseline) (the RV(smoke) of an earlier run, registered before the change) the action plugin gates the
    result as C(fleetctl apply) does (decode, tokens, latency); a failed gate fails the task.
  - With O(change_id) too, a passing gate commits that pending change in the ledger.
  - With O(change_id), the play's lease on fleetctl's host lock (the fact C(fleetctl_lease) of M(fleetctl.sglang.lock)
    or M(fleetctl.sglang.patch)) is renewed before the decode, to cover it (each server's health wait and requests,
    the offline command), and again before the commit; with no lease held one is taken, and a task that cannot have
    one fails naming the run that holds the lock. A lease M(fleetctl.sglang.patch) took itself ends once the commit
    leaves nothing pending, or when the gate fails.
version_added: "0.1.0"
author:
  - fleetctl maintainers (@fleetctl)
options:
  baseline:
    description: The RV(smoke) result registered before the change; omitted, this run is a baseline.
    type: dict
  change_id:
    description: A pending change (the C(change_id) M(fleetctl.sglang.patch) returned) to commit when the gate passes.
    type: str
  offline_cmd:
    description: An offline smoke command (default the host's C(fleetctl_smoke_cmd)).
    type: str
  health_timeout:
    description: Seconds to wait for each server's health endpoint.
    type: float
    default: 600
  latency_tolerance:
    description: Allowed after/baseline latency ratio.
    type: float
    default: 1.25
  allow_token_drift:
    description: Let greedy tokens differ after the change.
    type: bool
    default: false
  state_dir:
    description: fleetctl's state directory on the host.
    type: path
    default: /var/lib/fleetctl
  servers:
    description: The servers to decode on (host, port), chosen by the action plugin. Not for direct use.
    type: list
    elements: dict
  repeat:
    description: Decodes per server.
    type: int
    default: 3
  request_timeout:
    description: Seconds per HTTP request.
    type: float
    default: 60
  api_key:
    description: The servers' API key (default the host's C(fleetctl_sglang_api_key)).
    type: str
  server_user:
    description:
      - The account the servers run as (default the host's C(fleetctl_server_user)); a server whose
        effective uid is not root's, this one's, its interpreter environment owner's, or a system
        service's gets no request and no API key.
    type: str
attributes:
  check_mode:
    support: full
    description: A decode changes nothing; in check mode nothing is committed.
  diff_mode:
    support: none
    description: Nothing to diff.
  action:
    support: full
    description: The action plugin picks the servers and gates on the controller.
"""

EXAMPLES = r"""
- name: Baseline
  fleetctl.sglang.smoke:
  register: baseline

- name: Gate the change against the baseline and commit it
  fleetctl.sglang.smoke:
    baseline: "{{ baseline.smoke }}"
    change_id: "{{ patch.change_id }}"
"""

RETURN = r"""
smoke:
  description: The smoke decode (servers, offline), what O(baseline) takes.
  returned: always
  type: dict
validation:
  description: The gate (status, checks, message) when O(baseline) was given.
  returned: with O(baseline)
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.fleetctl.sglang.plugins.module_utils.traffic import smoke


def main():
    module = AnsibleModule(
        argument_spec=dict(
            baseline=dict(type="dict"), change_id=dict(type="str"), offline_cmd=dict(type="str"),
            health_timeout=dict(type="float", default=600), latency_tolerance=dict(type="float", default=1.25),
            allow_token_drift=dict(type="bool", default=False), state_dir=dict(type="path", default="/var/lib/fleetctl"),
            servers=dict(type="list", elements="dict"), repeat=dict(type="int", default=3),
            request_timeout=dict(type="float", default=60), api_key=dict(type="str", no_log=True),
            server_user=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    res = smoke.main({"servers": p["servers"] or [], "health_timeout": p["health_timeout"], "repeat": p["repeat"],
                      "request_timeout": p["request_timeout"], "offline_cmd": p["offline_cmd"], "api_key": p["api_key"],
                      "server_user": p["server_user"]})
    module.exit_json(changed=False, smoke=res)


if __name__ == "__main__":
    main()
