"""Stand-in for pypa's get-pip.py, which ansible-test downloads from ci-files.testing.ansible.com
(not reachable from the test machines). ansible-test runs it in each sanity venv it makes, with a
cleaned environment and maybe another HOME: so first the test machine's pip settings (`pip config
list` as the test saw it, {option: value} in get_pip_settings.json beside this file) go to the
venv's own pip.conf, which every later pip
run in that venv reads; then pip is bootstrapped from the interpreter's bundled wheel (ensurepip)
and what ansible-test asked for (its arguments, less get-pip's own --no-setuptools/--no-wheel) is
installed from the package index. tests/machine/test_ansible_sanity.py puts both files where ansible-test
looks for its cached copy."""

import ensurepip
import json
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "get_pip_settings.json")) as f:
    settings = json.load(f)
with open(os.path.join(sys.prefix, "pip.conf"), "w") as f:
    f.write("[global]\n" + "".join("%s = %s\n" % kv for kv in sorted(settings.items())))
ensurepip.bootstrap(upgrade=True)
os.environ.pop("PIP_CONFIG_FILE", None)  # ensurepip sets it to /dev/null in this process
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
sys.exit(subprocess.call([sys.executable, "-m", "pip", "install", *args]))
