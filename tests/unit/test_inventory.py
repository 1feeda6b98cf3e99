"""Inventory: Ansible YAML format, vars precedence, host ranges, host patterns, errors with file:line."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from fleetctl import inventory
from fleetctl.inventory import sources
from fleetctl.inventory.templates import Unsafe, Vaulted
from fleetctl.errors import InventoryError, PatternError

ROOT = Path(__file__).resolve().parents[2]

FLEET = """\
all:
  vars:
    ansible_user: ops
    fleetctl_sglang_port: 30000
    tier: all
  hosts:
    loose-1:
  children:
    inference:
      vars:
        tier: inference
        fleetctl_python: /opt/venv/bin/python
      children:
        h100:
          vars:
            tier: h100
          hosts:
            gpu-[01:03]:
            gpu-04:2202:
              ansible_host: gpu-04.mgmt.example.invalid
        rtx:
          hosts:
            rtx-a:
              ansible_host: rtx-a.mgmt.example.invalid
              ansible_python_interpreter: /usr/bin/python3.12
              tier: host
    canary:
      vars:
        tier: canary
      hosts:
        gpu-02:
          fleetctl_restart_cmd: systemctl restart sglang-canary
prod:
  children:
    h100:
  hosts:
    rtx-a:
      ansible_ssh_private_key_file: ~/.ssh/fleet
"""

H100 = ["gpu-01", "gpu-02", "gpu-03", "gpu-04"]


def write(tmp_path: Path, text: str, name: str = "hosts.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def fleet(tmp_path):
    return inventory.load(write(tmp_path, FLEET))


def names(hosts):
    return [h.name for h in hosts]


def test_hosts_groups_and_ranges(fleet):
    assert list(fleet.hosts) == ["loose-1", *H100, "rtx-a"]
    assert fleet.groups["all"] == ("loose-1", *H100, "rtx-a")
    assert fleet.groups["ungrouped"] == ("loose-1",)
    assert fleet.groups["inference"] == (*H100, "rtx-a")
    assert fleet.groups["prod"] == (*H100, "rtx-a")
    assert fleet.groups["canary"] == ("gpu-02",)
    assert fleet.hosts["gpu-02"].groups == ("all", "inference", "h100", "canary", "prod")
    assert fleet.hosts["loose-1"].groups == ("all", "ungrouped")


def test_vars_precedence(fleet):
    # all < inference (depth 1) < h100 (depth 2); canary (depth 1) sorts under h100
    assert fleet.hosts["loose-1"].vars["tier"] == "all"
    assert fleet.hosts["gpu-01"].vars["tier"] == "h100"
    assert fleet.hosts["gpu-02"].vars["tier"] == "h100"
    assert fleet.hosts["rtx-a"].vars["tier"] == "host"
    assert fleet.hosts["gpu-02"].vars["fleetctl_restart_cmd"] == "systemctl restart sglang-canary"
    assert "fleetctl_restart_cmd" not in fleet.hosts["gpu-01"].vars
    assert fleet.hosts["gpu-03"].vars["fleetctl_sglang_port"] == 30000


def test_same_depth_groups_merge_by_name_and_priority(tmp_path):
    text = """\
    alpha:
      vars: {v: alpha}
      hosts: {h1: , h2: }
    beta:
      vars: {v: beta}
      hosts: {h1: , h2: }
    gamma:
      vars: {v: gamma, ansible_group_priority: 0}
      hosts: {h2: }
    """
    inv = inventory.load(write(tmp_path, text))
    assert inv.hosts["h1"].vars["v"] == "beta"        # same depth and priority: by name
    assert inv.hosts["h2"].vars["v"] == "beta"        # gamma's lower priority loses
    assert "ansible_group_priority" not in inv.hosts["h2"].vars


def test_connection_properties(fleet):
    gpu4, rtx, loose = fleet.hosts["gpu-04"], fleet.hosts["rtx-a"], fleet.hosts["loose-1"]
    assert (gpu4.address, gpu4.port, gpu4.user) == ("gpu-04.mgmt.example.invalid", 2202, "ops")
    assert (loose.address, loose.port, loose.key_file, loose.python) == ("loose-1", None, None, None)
    assert rtx.key_file == str(Path.home() / ".ssh/fleet")
    assert rtx.python == "/usr/bin/python3.12"
    assert gpu4.python == "/opt/venv/bin/python"


def test_ansible_aliases_and_auto_interpreter(tmp_path):
    text = """\
    all:
      hosts:
        old:
          ansible_ssh_host: old.mgmt.example.invalid
          ansible_ssh_port: "2022"
          ansible_ssh_user: legacy
          ansible_python_interpreter: auto_silent
          fleetctl_python: /srv/venv/bin/python
    """
    host = inventory.load(write(tmp_path, text)).hosts["old"]
    assert (host.address, host.port, host.user) == ("old.mgmt.example.invalid", 2022, "legacy")
    assert host.python == "/srv/venv/bin/python"


def test_ranges(tmp_path):
    text = """\
    all:
      hosts:
        node-[1:3]:
        db-[a:c]:
        w[01:10:4]-[x:y].lab:
        "r[8:10]:2200":
    """
    inv = inventory.load(write(tmp_path, text))
    assert list(inv.hosts) == ["node-1", "node-2", "node-3", "db-a", "db-b", "db-c",
                               "w01-x.lab", "w01-y.lab", "w05-x.lab", "w05-y.lab", "w09-x.lab", "w09-y.lab",
                               "r8", "r9", "r10"]
    assert {inv.hosts[f"r{i}"].port for i in (8, 9, 10)} == {2200}


def test_ansible_tolerated_forms(tmp_path):
    """Forms Ansible accepts: top-level groups, a string for hosts/children, null groups, anchors
    and merge keys, !unsafe and !vault values."""
    text = """\
    base: &base
      vars: {role: base}
    web:
      <<: *base
      hosts: web1
    empty:
    edge:
      children: web
      vars:
        token: !unsafe "{{ not templated }}"
        secret: !vault |
          $ANSIBLE_VAULT;1.1;AES256
          6162
    """
    inv = inventory.load(write(tmp_path, text))
    assert inv.hosts["web1"].vars["role"] == "base"
    assert inv.groups["edge"] == ("web1",) and inv.groups["empty"] == ()
    assert inv.hosts["web1"].vars["token"] == "{{ not templated }}"
    assert isinstance(inv.hosts["web1"].vars["secret"], Vaulted)


@pytest.mark.parametrize("pattern, expected", [
    ("all", ["loose-1", *H100, "rtx-a"]),
    ("*", ["loose-1", *H100, "rtx-a"]),
    ("gpu-03", ["gpu-03"]),
    ("h100", H100),
    ("gpu-0*", H100),
    ("gpu-0[!24]", ["gpu-01", "gpu-03"]),
    ("~(rtx|loose)-", ["loose-1", "rtx-a"]),
    ("rtx:canary", ["gpu-02", "rtx-a"]),
    ("rtx,canary", ["gpu-02", "rtx-a"]),
    ("rtx, canary", ["gpu-02", "rtx-a"]),
    ("inference:&prod:!canary", ["gpu-01", "gpu-03", "gpu-04", "rtx-a"]),
    ("!h100:rtx", ["rtx-a"]),                         # exclusions apply last
    ("&prod:canary:loose-1", ["gpu-02"]),           # intersections apply after unions
    ("!inference", ["loose-1"]),                      # only exclusions: start from all
    ("ungrouped", ["loose-1"]),
    ("h100[0]", ["gpu-01"]),
    ("h100[-1]", ["gpu-04"]),
    ("h100[1:2]", ["gpu-02", "gpu-03"]),
    ("h100[2:]", ["gpu-03", "gpu-04"]),
    ("rtx-a:gpu-01", ["gpu-01", "rtx-a"]),          # inventory order, not pattern order
])
def test_patterns(fleet, pattern, expected):
    assert names(fleet.select(pattern)) == expected


def test_names_with_colon_and_group_over_glob(tmp_path):
    text = """\
    "db:primary":
      hosts:
        "pg:main":
        pg2:
    gpu:
      hosts: {gpu-1: }
    """
    inv = inventory.load(write(tmp_path, text))
    assert names(inv.select("db:primary")) == ["pg:main", "pg2"]
    assert names(inv.select("pg:main")) == ["pg:main"]
    assert names(inv.select("db:primary,gpu")) == ["pg:main", "pg2", "gpu-1"]


@pytest.mark.parametrize("pattern, message", [
    ("nosuch", "host pattern 'nosuch' matches no host"),
    ("h100:&rtx", "matches no host"),
    ("all:!all", "matches no host"),
    ("gpu-9*", "matches no host"),
    ("h100[7]", "subscripted pattern 'h100[7]'"),
    ("gpu-0[13]", "subscripted pattern"),             # as in Ansible: a subscript, not a glob
    ("~gpu-(", "invalid host pattern '~gpu-('"),
    ("", "empty host pattern"),
])
def test_pattern_errors(fleet, pattern, message):
    with pytest.raises(PatternError) as err:
        fleet.select(pattern)
    assert message in str(err.value)
    assert err.value.exit_code == 5


ANCHORED = """\
all:
  hosts:
    gpu-01:
    gpu-02:
    lab-gpu-01:
prod-gpu:
  hosts:
    big-box:
"""


@pytest.mark.parametrize("pattern, expected", [
    ("~gpu", ["gpu-01", "gpu-02"]),          # re.match: not lab-gpu-01
    ("prod-gpu", ["big-box"]),
    ("*gpu*", ["gpu-01", "gpu-02", "lab-gpu-01", "big-box"]),
    ("~.*gpu", ["gpu-01", "gpu-02", "lab-gpu-01", "big-box"]),
])
def test_patterns_are_anchored_at_the_start(tmp_path, pattern, expected):
    """H1: a regex matches from the name's start and a glob matches the whole name, as in Ansible."""
    assert names(inventory.load(write(tmp_path, ANCHORED)).select(pattern)) == expected


@pytest.mark.parametrize("pattern", ["gpu", "pu-0*", "~pu", "~-gpu", "~ab-gpu"])
def test_unanchored_matches_are_refused(tmp_path, pattern):
    """H1: `gpu` must not select group prod-gpu's host, nor `pu-0*`/`~pu` any name containing them."""
    with pytest.raises(PatternError, match="matches no host"):
        inventory.load(write(tmp_path, ANCHORED)).select(pattern)


def test_names_starting_with_any_character(tmp_path):
    """Only a leading '&' or '!' makes a part an intersection or exclusion; 'X', '~' or a digit do not."""
    inv = inventory.load(write(tmp_path, "all:\n  hosts:\n    X1:\n    X2:\n    9b:\n    y:\n"))
    assert names(inv.select("X1")) == ["X1"]
    assert names(inv.select("X*")) == ["X1", "X2"]
    assert names(inv.select("9b:y")) == ["9b", "y"]
    assert names(inv.select("X*:!X2")) == ["X1"]


@pytest.mark.parametrize("pattern, expected", [
    ("~(rtx|loose)", ["loose-1", "rtx-a"]),          # a regex matching a group still matches hosts
    ("~gpu-0[12]", ["gpu-01", "gpu-02"]),            # a regex's [..] is a character class, not a subscript
    ("gpu-01[0]", ["gpu-01"]),                       # a subscripted host name matches hosts
    ("gpu-01:gpu-02,rtx*", ["gpu-01", "gpu-02", "rtx-a"]),  # parts of every comma chunk count
])
def test_regex_subscript_and_comma_chunks(fleet, pattern, expected):
    assert names(fleet.select(pattern)) == expected


def test_group_wins_over_a_host_of_the_same_name_unless_globbed(tmp_path):
    """As Ansible: a plain pattern naming a group takes the group's hosts, not a same-named host."""
    inv = inventory.load(write(tmp_path, "all:\n  hosts:\n    Xw:\n    \"web,1\":\nXw:\n  hosts:\n    w1:\n    w2:\n"))
    assert names(inv.select("Xw[0:]")) == ["w1", "w2"]
    assert names(inv.select("Xw*")) == ["Xw", "w1", "w2"]
    assert names(inv.select("Xw")) == ["Xw"]  # exactly a host name: that host
    assert names(inv.select("web,1")) == ["web,1"]  # a whole name is never split on ','


@pytest.mark.parametrize("pattern, message", [
    ("lab-01]", "invalid host pattern 'lab-01]': unbalanced brackets"),
    ("gpu-01:&", "empty host pattern after '&'"),
    ("~", "empty regular expression in host pattern '~'"),
])
def test_malformed_pattern_messages(fleet, pattern, message):
    with pytest.raises(PatternError) as err:
        fleet.select(pattern)
    assert str(err.value) == message


def test_pattern_error_lists_groups(fleet):
    with pytest.raises(PatternError) as err:
        fleet.select("nosuch")
    assert "groups: all, ungrouped, inference, h100, rtx, canary, prod" in str(err.value)
    with pytest.raises(PatternError) as err:  # every part matches, the whole selects nothing
        fleet.select("h100:&rtx")
    assert str(err.value) == (f"host pattern 'h100:&rtx' matches no host in {fleet.path}; "
                              "groups: all, ungrouped, inference, h100, rtx, canary, prod")


@pytest.mark.parametrize("text, where, what", [
    ("all:\n  hosts:\n    - gpu1\n", 3, "'hosts' of group 'all' must be a mapping of names, not a list"),
    ("all:\n  children:\n    gpu: just-a-string\n", 3, "group 'gpu' must be a mapping of hosts, children and vars"),
    ("gpu:\n  hosts: {a: }\n  host_vars: {}\n", 3, "unknown key 'host_vars' in group 'gpu'"),
    ("all:\n  hosts:\n    a:\n      ansible_port: twenty-two\n", 4, "ansible_port must be a port number"),
    ("all:\n  vars:\n    ansible_port: 70000\n", 3, "ansible_port must be a port number"),
    ("all:\n  vars:\n    fleetctl_sglang_port: true\n", 3, "fleetctl_sglang_port must be a port number"),
    ("all:\n  hosts:\n    a:\n      ansible_host: [1, 2]\n", 4, "ansible_host must be a plain string"),
    ("all:\n  hosts:\n    a: 5\n", 3, "vars of host 'a' must be a mapping"),
    ("all:\n  vars: [a]\n", 2, "vars of group 'all' must be a mapping"),
    ("all:\n  hosts:\n    a:\n    b:\n    a:\n", 5, "duplicate key 'a' (first at line 3)"),
    ("all:\n  hosts:\n    a:\n      x: 1\n      x: 2\n", 5, "duplicate key 'x' (first at line 4)"),
    ("all:\n  vars: {x: 1, x: 2}\n", 2, "duplicate key 'x' (first at line 2)"),
    ("a:\n  children:\n    b:\n      children:\n        a:\n", 5, "group 'a' is its own ancestor: a -> b -> a"),
    ("a:\n  children:\n    all:\n", 3, "group 'all' cannot be a child"),
    ("all:\n  hosts:\n    gpu-[03:1]:\n", 3, "bad host range in 'gpu-[03:1]'"),
    ("all:\n  hosts:\n    gpu-[1:x]:\n", 3, "is not a numeric or one-letter range"),
    ("- all\n", 1, "an inventory is a mapping of groups"),
    ("\n# nothing\n", 1, "empty inventory"),
])
def test_structure_errors(tmp_path, text, where, what):
    path = write(tmp_path, text)
    with pytest.raises(InventoryError) as err:
        inventory.load(path)
    assert str(err.value).startswith(f"{path}:{where}: ")
    assert what in str(err.value)
    assert err.value.exit_code == 4


@pytest.mark.parametrize("text, where", [
    ("all:\n  hosts:\n    a: {x: 1\n  vars: {}\n", "4:7"),           # unclosed flow mapping
    ("all:\n  hosts:\n   a:\n  b: 1\n  - c\n", "5:3"),                # block mapping then list item
    ("all:\n  vars:\n    x: \"unterminated\n", "4:1"),
    ("all:\n\tvars: {}\n", "2:1"),                                  # tab indentation
    ("all: *nosuch\n", "1:6"),
    ("all: {}\n---\nmore: {}\n", "2:1"),                             # two documents
])
def test_yaml_errors_give_line_and_column(tmp_path, text, where):
    path = write(tmp_path, text)
    with pytest.raises(InventoryError) as err:
        inventory.load(path)
    assert str(err.value).startswith(f"{path}:{where}: ")


def test_unreadable_files(tmp_path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"all:\n  hosts:\n    caf\xe9:\n")
    with pytest.raises(InventoryError, match=rf"^{re.escape(str(path))}:3: not UTF-8"):
        inventory.load(path)
    path.write_text("all:\n  hosts:\n    a\x00b:\n")
    with pytest.raises(InventoryError, match=rf"^{re.escape(str(path))}:3: character #x0000"):
        inventory.load(path)


def test_resolve_path_order(tmp_path, monkeypatch):
    cli, env, default = (write(tmp_path, "all: {hosts: {a: }}", name)
                         for name in ("cli.yaml", "env.yaml", "hosts.yaml"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLEETCTL_INVENTORY", str(env))
    assert inventory.resolve_path(str(cli)) == cli
    assert inventory.resolve_path(None) == env
    monkeypatch.delenv("FLEETCTL_INVENTORY")
    assert inventory.resolve_path(None) == Path("hosts.yaml")
    default.unlink()
    with pytest.raises(InventoryError, match=r"hosts.yaml \(from the default ./hosts.yaml.*no such file"):
        inventory.resolve_path(None)
    monkeypatch.setenv("FLEETCTL_INVENTORY", str(tmp_path / "gone.yaml"))
    with pytest.raises(InventoryError, match=r"gone.yaml \(from \$FLEETCTL_INVENTORY\): no such file"):
        inventory.resolve_path(None)
    assert inventory.resolve_path(str(tmp_path)) == tmp_path   # an inventory directory
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(InventoryError, match=r"from -i\): is not a file or directory"):
        inventory.resolve_path(str(tmp_path / "fifo"))


def test_example_inventory_loads():
    inv = inventory.load(ROOT / "hosts.yaml")
    assert len(inv.hosts) == 8
    assert all(h.endswith(".example.invalid") for h in inv.hosts)
    assert all(h.address.endswith(".example.invalid") for h in inv.hosts.values())
    rtx_b = inv.hosts["rtx-b.example.invalid"]
    assert rtx_b.vars["fleetctl_sglang_port"] == 30001 and rtx_b.python == "/usr/bin/python3.12"
    assert names(inv.select("h100:!canary"))[0] == "gpu-02.example.invalid"
    # README's real-fleet commands select `gpu` (issue 50): every GPU host, not the bastion
    assert sorted(names(inv.select("gpu"))) == sorted(h for h in inv.hosts if h != "jump.example.invalid")
    assert inv.hosts["gpu-01.example.invalid"].vars["ansible_user"] == "sglang"


def test_group_vars_and_host_vars_beside_the_inventory(tmp_path):
    path = write(tmp_path, FLEET)
    write(tmp_path, "ansible_user: from-group-vars-all\ntier: gv-all\n", "group_vars/all.yml")
    write(tmp_path, "tier: gv-h100-a\nlayer: a\n", "group_vars/h100/10-a.yaml")
    write(tmp_path, "tier: gv-h100-b\n", "group_vars/h100/20-b")
    write(tmp_path, "tier: ignored\n", "group_vars/h100/.hidden.yml")
    write(tmp_path, '{"ansible_port": 2299}', "host_vars/gpu-01.json")
    write(tmp_path, "", "host_vars/gpu-03.yml")
    inv = inventory.load(path)
    # group_vars/all beats every group's vars in the inventory file (Ansible's precedence)
    assert inv.hosts["rtx-a"].vars["ansible_user"] == "from-group-vars-all"
    assert inv.hosts["loose-1"].vars["tier"] == "gv-all"
    assert inv.hosts["gpu-02"].vars["tier"] == "gv-h100-b" and inv.hosts["gpu-02"].vars["layer"] == "a"
    assert inv.hosts["rtx-a"].vars["tier"] == "host"     # inventory host vars beat group_vars/
    assert inv.hosts["gpu-01"].port == 2299 and inv.hosts["gpu-04"].port == 2202
    bad = write(tmp_path, "fleetctl_python: /x\nansible_port: [22]\n", "host_vars/rtx-a.yml")
    with pytest.raises(InventoryError, match=rf"^{re.escape(str(bad))}:2: ansible_port must be a port number"):
        inventory.load(path)
    bad.write_text("x: [1\n")
    with pytest.raises(InventoryError, match=rf"^{re.escape(str(bad))}:2:1: "):
        inventory.load(path)


@pytest.mark.parametrize("pattern", ["~[", "~lab-0[", "lab-0*[", "lab-01:~[", "lab-01]", "lab-01 [x", "~",
                                     "lab-01:nosuch", "lab-0*:!nosuch", "all:&nosuch"])
def test_malformed_or_partly_unmatched_patterns_are_refused(tmp_path, pattern):
    """A typo must never widen (or silently narrow) the set of hosts a run touches."""
    inv = tmp_path / "hosts.yaml"
    inv.write_text("all:\n  hosts:\n    lab-01:\n    lab-02:\n")
    with pytest.raises(PatternError):
        inventory.load(inv).select(pattern)


# ---- templated vars (templates) ----------------------------------------------------------------

TEMPLATED = """\
all:
  vars:
    domain: mgmt.example.invalid
    base_port: "2200"
    become_flag: "yes"
    gateway: "{{ lookup('env', 'HOME') }}"
  children:
    gpu:
      hosts:
        gpu-[1:2]:
        gpu-3:
          ansible_host: !unsafe "{{ not.rendered }}"
      vars:
        ansible_host: "{{ inventory_hostname }}.{{ domain }}"
        ansible_port: "{{ base_port | int + 1 }}"
        ansible_user: "{{ missing_user | d('ops') }}"
        fleetctl_python: "{{ hostvars[groups['gpu'][0]]['ansible_host'] | regex_replace('[.].*$', '') }}"
        fleetctl_smoke_cmd: "echo {{ group_names | join(',') | quote }} {{ 'yes' | bool }}"
        fleetctl_restart_cmd: "{{ undefined_thing.attr | default('systemctl restart sglang') }}"
        unread: "{{ facts_only_ansible_has | ipaddr }}"
        ansible_become: "{{ become_flag | bool }}"
    canary:
      hosts:
        gpu-2:
"""


def test_templated_vars_fleetctl_reads(tmp_path):
    inv = inventory.load(write(tmp_path, TEMPLATED))
    one, two, three = (inv.hosts[f"gpu-{i}"] for i in (1, 2, 3))
    assert (one.address, one.port, one.user) == ("gpu-1.mgmt.example.invalid", 2201, "ops")
    assert two.address == "gpu-2.mgmt.example.invalid"
    assert one.python == two.python == "gpu-1"                 # hostvars + groups + regex_replace
    assert one.smoke_cmd == "echo gpu True"                    # group_names, quote, bool
    assert two.smoke_cmd == "echo canary,gpu True"             # sorted, without all/ungrouped
    assert one.restart_cmd == "systemctl restart sglang"       # default after a chained undefined
    assert one.vars["ansible_become"] is True                  # one {{ expr }} keeps its type
    # vars fleetctl never reads stay as written, lookups and unknown filters included
    assert one.vars["gateway"] == "{{ lookup('env', 'HOME') }}"
    assert one.vars["unread"] == "{{ facts_only_ansible_has | ipaddr }}"
    # !unsafe: never rendered, stays marked
    assert three.address == "{{ not.rendered }}"
    assert isinstance(three.vars["ansible_host"], Unsafe)


def test_lookup_in_group_vars_only_fails_where_fleetctl_reads_it(tmp_path):
    path = write(tmp_path, "gpu:\n  hosts:\n    gpu-1:\n")
    gv = write(tmp_path, "ntp: \"{{ lookup('file', '/etc/ntp') }}\"\nansible_user: ops\n", "group_vars/gpu.yml")
    assert inventory.load(path).hosts["gpu-1"].user == "ops"
    gv.write_text("ntp: x\nansible_host: \"{{ lookup('file', '/etc/hostip') }}\"\n")
    with pytest.raises(InventoryError) as err:
        inventory.load(path)
    assert str(err.value).startswith(f"{gv}:2: ansible_host: lookup('file', '/etc/hostip') is an Ansible lookup")
    assert "ansible-inventory" in str(err.value) and err.value.exit_code == 4


@pytest.mark.parametrize("value, what", [
    ("\"{{ x | ipaddr }}\"", "No filter named 'ipaddr'"),
    ("\"{% if x %}{{ x | to_nice_json }}{% endif %}\"", "No filter named 'to_nice_json'"),
    ("\"{{ nope }}\"", "'nope' is undefined"),
    ("\"{{ ''.__class__.__mro__ }}\"", "is unsafe"),                 # the sandbox holds
    ("\"{{ query('inventory_hostnames', 'all') }}\"", "is an Ansible lookup"),
    ("\"{{ y }}\"", "ansible_host refers to itself: ansible_host -> y -> ansible_host"),
])
def test_unrenderable_needed_var_is_exit_4_at_its_line(tmp_path, value, what):
    path = write(tmp_path, f"all:\n  vars:\n    x: 1\n    y: \"{{{{ ansible_host }}}}\"\n"
                           f"  hosts:\n    a:\n      ansible_host: {value}\n")
    with pytest.raises(InventoryError) as err:
        inventory.load(path)
    assert str(err.value).startswith(f"{path}:7: ansible_host")
    assert what in str(err.value)


@pytest.mark.parametrize("var, value, what", [
    ("ansible_port", "\"{{ 'twenty' }}\"", "ansible_port must be a port number (1-65535), not 'twenty'"),
    ("ansible_connection", "\"{{ 'docker' }}\"", "ansible_connection 'docker' is not one fleetctl can use"),
    ("ansible_port", "\"{{ 70000 }}\"", "ansible_port must be a port number (1-65535), not '70000'"),
    ("ansible_user", "\"{{ [inventory_hostname] }}\"", "ansible_user must be a plain string, not ['a']"),
])
def test_rendered_values_are_checked_at_the_template_line(tmp_path, var, value, what):
    path = write(tmp_path, f"all:\n  hosts:\n    a:\n      {var}: {value}\n")
    with pytest.raises(InventoryError) as err:
        inventory.load(path)
    assert str(err.value).startswith(f"{path}:4: {what}")


def test_vault_value_in_a_var_fleetctl_reads_needs_a_secret(tmp_path):
    text = ("all:\n  hosts:\n    a:\n      other: !vault |\n        $ANSIBLE_VAULT;1.1;AES256\n        6162\n"
            "      ansible_become_password: !vault |\n        $ANSIBLE_VAULT;1.1;AES256\n        6364\n")
    path = write(tmp_path, text)
    with pytest.raises(InventoryError, match=rf"^{re.escape(str(path))}:7: ansible_become_password is "
                                             r"vault-encrypted and no vault secret was given"):
        inventory.load(path)
    seen = []
    inv = inventory.load(path, decrypt=lambda value, name, where: seen.append((value, name, where)) or "pw")
    assert inv.hosts["a"].vars["ansible_become_password"] == "pw"
    assert seen == [("$ANSIBLE_VAULT;1.1;AES256\n6364\n", "ansible_become_password", f"{path}:7")]
    assert isinstance(inv.hosts["a"].vars["other"], Vaulted)   # never read: never decrypted


# ---- host names and addresses in Ansible's forms ---------------------------------------------

def test_host_names_and_addresses(tmp_path):
    text = """\
    all:
      hosts:
        fe80::1:
        "[2001:db8::5]:2222":
        "[2001:db8::[a:b]]:2223":
        10.213.250.7:2201:
        "10.213.250.[8:9]":
        10:
        "0042":
        "db:primary":
        gpu-1.example.invalid:2202:
    """
    inv = inventory.load(write(tmp_path, text))
    assert list(inv.hosts) == ["fe80::1", "2001:db8::5", "2001:db8::a", "2001:db8::b", "10.213.250.7",
                               "10.213.250.8", "10.213.250.9", "10", "0042", "db:primary", "gpu-1.example.invalid"]
    ports = {name: host.port for name, host in inv.hosts.items()}
    assert ports == {"fe80::1": None, "2001:db8::5": 2222, "2001:db8::a": 2223, "2001:db8::b": 2223,
                     "10.213.250.7": 2201, "10.213.250.8": None, "10.213.250.9": None, "10": None, "0042": None,
                     "db:primary": None, "gpu-1.example.invalid": 2202}
    assert inv.hosts["fe80::1"].address == "fe80::1"


def test_numbers_as_connection_strings(tmp_path):
    inv = inventory.load(write(tmp_path, "all:\n  hosts:\n    a:\n      ansible_host: 3232235777\n"
                                         "      ansible_user: 1000\n      ansible_port: '22'\n"))
    host = inv.hosts["a"]
    assert (host.address, host.user, host.port) == ("3232235777", "1000", 22)
    assert host.vars["ansible_user"] == "1000"


# ---- ansible_ssh_common_args / ansible_ssh_extra_args (case turn2/06) ------------------------

CASE_06 = """\
all:
  children:
    gpu:
      hosts:
        gpu-node-01: {ansible_host: 10.213.250.11}
        gpu-node-02: {ansible_host: 10.213.250.12}
      vars:
        ansible_user: ops
        ansible_ssh_common_args: '-o ProxyCommand="ssh -W %h:%p -q ops@bastion.example.invalid"'
    gpu_b:
      hosts:
        gpu-node-03:
          ansible_host: 10.213.250.13
          ansible_ssh_common_args: '-J ops@bastion.example.invalid:2222'
          ansible_ssh_extra_args: "-o ServerAliveInterval={{ 5 * 3 }} -F '/etc/ssh/fleet config'"
"""


def test_case_06_bastion_in_ssh_common_args(tmp_path):
    """Case turn2/06: the bastion named only in ansible_ssh_common_args reaches the Host, split
    as a shell would, so the connection can hand it to `ssh -G` and ssh."""
    inv = inventory.load(write(tmp_path, CASE_06))
    one, two, three = (inv.hosts[f"gpu-node-0{i}"] for i in (1, 2, 3))
    assert one.ssh_common_args == two.ssh_common_args == (
        "-o", "ProxyCommand=ssh -W %h:%p -q ops@bastion.example.invalid")
    assert one.ssh_extra_args == ()
    assert three.ssh_common_args == ("-J", "ops@bastion.example.invalid:2222")
    assert three.ssh_extra_args == ("-o", "ServerAliveInterval=15", "-F", "/etc/ssh/fleet config")
    assert (one.address, three.address, three.user) == ("10.213.250.11", "10.213.250.13", None)


@pytest.mark.parametrize("value", ["'-o ProxyCommand=\"ssh -W %h:%p'", "'-J {{ \"it''s\" }}'", "[-J, x]"])
def test_ssh_args_quoting_error_is_exit_4_at_its_line(tmp_path, value):
    path = write(tmp_path, f"all:\n  vars:\n    ansible_ssh_common_args: {value}\n  hosts:\n    a:\n")
    with pytest.raises(InventoryError) as err:
        inventory.load(path)
    assert str(err.value).startswith(f"{path}:3: ansible_ssh_common_args ")


# ---- other sources without the ansible extra ------------------------------------------------

INVENTORIES = ROOT / "tests" / "inventories"


@pytest.mark.parametrize("source, what", [
    ("ini/hosts.ini", "an inventory that is not Ansible's YAML format"),
    ("mixed", "an inventory directory"),
    ("script/inventory.py", "an executable inventory script"),
])
def test_other_sources_need_the_ansible_extra(monkeypatch, source, what):
    """Without ansible-core only the non-YAML sources are refused, saying what to install or how
    to convert (tests/machine/test_inventory_ansible.py reads them with it)."""
    monkeypatch.setattr(sources, "available", lambda: False)
    with pytest.raises(InventoryError) as err:
        inventory.load(INVENTORIES / source)
    assert str(err.value).startswith(f"{INVENTORIES / source}: {what}")
    assert "pip install 'fleetctl[ansible]'" in str(err.value) and "ansible-inventory -i" in str(err.value)
    assert err.value.exit_code == 4
    assert len(inventory.load(INVENTORIES / "yaml/hosts.yaml").hosts) == 5


def test_plugin_configuration_and_non_yaml_text_go_to_ansible(monkeypatch, tmp_path):
    monkeypatch.setattr(sources, "available", lambda: False)
    for name, text in [("aws_ec2.yml", "plugin: amazon.aws.aws_ec2\nregions: [us-east-1]\n"),
                       ("hosts", "[gpu]\ngpu-01 ansible_user=ops\n"), ("list", "gpu-01\ngpu-02\n")]:
        with pytest.raises(InventoryError, match="needs ansible-core"):
            inventory.load(write(tmp_path, text, name))
    assert list(inventory.load(write(tmp_path, "gpu:\n  hosts: {gpu-01: }\n", "hosts")).hosts) == ["gpu-01"]
    # a YAML error, in the words of the parser in use (libyaml's where PyYAML has it, as yamlfile.Loader)
    problem = "did not find expected node content" if yaml.__with_libyaml__ else "expected the node content"
    with pytest.raises(InventoryError, match=r"hosts.yml:3:1: " + problem):
        inventory.load(write(tmp_path, "all:\n  - [\n", "hosts.yml"))


def test_vault_options_need_a_secret_and_the_extra(monkeypatch):
    with pytest.raises(InventoryError, match="--vault-password-file FILE or --ask-vault-pass"):
        sources.Vault()
    monkeypatch.setattr(sources, "available", lambda: False)
    with pytest.raises(InventoryError, match=r"needs ansible-core: pip install 'fleetctl\[ansible\]'"):
        sources.Vault("/nonexistent/vault-pass")


def test_a_vault_encrypted_vars_file(tmp_path):
    """A group_vars file encrypted whole with ansible-vault needs the secret; with it, it is read
    as any vars file (the vault library itself is exercised in test_inventory_ansible.py)."""
    path = write(tmp_path, "gpu:\n  hosts:\n    gpu-1:\n")
    secret = write(tmp_path, "$ANSIBLE_VAULT;1.1;AES256\n6162\n", "group_vars/gpu.yml")
    with pytest.raises(InventoryError, match=rf"^{re.escape(str(secret))}:1: the file is vault-encrypted and "
                                             r"no vault secret was given: run with --vault-password-file"):
        inventory.load(path)
    plain = {"$ANSIBLE_VAULT;1.1;AES256\n6162\n": "ansible_user: ops\nansible_port: 2222\n"}
    inv = inventory.load(path, decrypt=lambda value, name, where: plain[value])
    assert (inv.hosts["gpu-1"].user, inv.hosts["gpu-1"].port) == ("ops", 2222)


@pytest.mark.parametrize("argv, message", [
    (["-i", str(INVENTORIES / "ini/hosts.ini")], "needs ansible-core to be read: pip install 'fleetctl[ansible]'"),
    (["-i", str(INVENTORIES / "yaml/hosts.yaml"), "--vault-password-file", "/nonexistent/pass"],
     "decrypting vault values needs ansible-core: pip install 'fleetctl[ansible]'"),
    (["-i", str(INVENTORIES / "yaml/hosts.yaml"), "--ask-vault-pass"], "needs ansible-core"),
])
def test_cli_inventory_options_and_errors(monkeypatch, capsys, argv, message):
    """The vault options reach the inventory, and an error's text is printed as it is (Rich
    markup would eat `[ansible]` or a host range)."""
    from fleetctl import cli

    monkeypatch.setattr(sources, "available", lambda: False)
    monkeypatch.setattr("sys.argv", ["fleetctl", "status", "all", *argv])
    with pytest.raises(SystemExit) as done:
        cli.main()
    assert done.value.code == 4
    assert message in capsys.readouterr().err


def test_a_bad_decrypted_value_is_not_printed(tmp_path):
    path = write(tmp_path, "all:\n  hosts:\n    a:\n      ansible_port: !vault |\n        $ANSIBLE_VAULT;1.1;AES256\n")
    with pytest.raises(InventoryError) as err:
        inventory.load(path, decrypt=lambda value, name, where: "hunter2")
    assert str(err.value).startswith(f"{path}:4: ansible_port: the decrypted vault value is not what fleetctl needs")
    assert "hunter2" not in str(err.value)


def test_magic_variables_of_other_hosts(tmp_path):
    """hostvars[h] holds h's magic variables too, and `groups` always has `ungrouped`, as in Ansible."""
    text = """\
    gpu:
      hosts:
        gpu-1.example.invalid: {ansible_host: 10.213.250.1}
        gpu-2.example.invalid:
          ansible_host: "{{ hostvars['gpu-1.example.invalid'].inventory_hostname_short }}-peer"
          fleetctl_smoke_cmd: "echo {{ hostvars['gpu-1.example.invalid']['group_names'] | join(',') }} {{ groups.ungrouped | length }}"
    """
    host = inventory.load(write(tmp_path, text)).hosts["gpu-2.example.invalid"]
    assert (host.address, host.smoke_cmd) == ("gpu-1-peer", "echo gpu 0")
