"""Ansible's own view of an inventory source, for tests/machine/test_inventory_ansible.py (run by the
venv's python that has ansible-core): every host's groups and its connection vars, each templated
by Ansible's Templar with hostvars in context, as a play would see them.

Usage: python ansible_view.py SOURCE REGEX  -> JSON {"groups": {group: [hosts]}, "hosts": {host: {var: value}}}
for the vars whose names fullmatch REGEX.
"""
import json
import re
import sys

from ansible.inventory.manager import InventoryManager
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar
from ansible.vars.hostvars import HostVars
from ansible.vars.manager import VariableManager

source, names = sys.argv[1], re.compile(sys.argv[2])
loader = DataLoader()
inventory = InventoryManager(loader, sources=[source])
variables = VariableManager(loader=loader, inventory=inventory)
HostVars(inventory=inventory, variable_manager=variables, loader=loader)  # becomes `hostvars`, as in a play
view = {"groups": {g: [h.name for h in group.get_hosts()] for g, group in inventory.groups.items()}, "hosts": {}}
for host in inventory.get_hosts():
    hostvars = variables.get_vars(host=host, include_hostvars=True)
    templar = Templar(loader, variables=hostvars)
    view["hosts"][host.name] = {n: templar.template(hostvars[n]) for n in hostvars if names.fullmatch(n)}
print(json.dumps(view))
