#!/usr/bin/env python3
"""A dynamic inventory script (Ansible's script inventory: JSON on --list, {} on --host)."""
import json
import sys

INVENTORY = {
    "_meta": {"hostvars": {
        "gpu-01.example.invalid": {"ansible_host": "10.213.250.31"},
        "gpu-02.example.invalid": {"ansible_host": "10.213.250.32", "ansible_port": 2222},
    }},
    "gpu": {"hosts": ["gpu-01.example.invalid", "gpu-02.example.invalid"],
            "vars": {"ansible_user": "{{ 'svc' ~ '-gpu' }}", "fleetctl_sglang_port": 30000}},
    "canary": {"hosts": ["gpu-02.example.invalid"]},
    "fleet": {"children": ["gpu"], "vars": {"ansible_python_interpreter": "/usr/bin/python3"}},
}

if sys.argv[1:] == ["--list"]:
    print(json.dumps(INVENTORY))
else:
    print("{}")
