"""The systemd services that run SGLang (probes/facts/units.py): the SGLang interpreter found in a
service's command line, and the services read from unit files or from `systemctl show`. How
`systemctl show` output and unit files read is in the recorded cases (tests/unit/probes/units/,
test_fact_fixtures.py), whose texts these tests lay out."""

from __future__ import annotations

import os
import shlex

from fleetctl.probes.facts import units
from helpers.probe_cases import case, text

# `systemctl show` of sglang.service, uv-sglang.service and cron.service
SHOW = text(case("units", "systemctl-show-three-units")["stdout"])
# case 09's public SGLang unit, and a drop-in that replaces its command
UNIT, DROP_IN = (text(lines) for lines in case("units", "unit-file-and-drop-in")["files"].values())


def test_the_sglang_interpreter_is_found_in_a_service_command_line(tmp_path):
    py = "/opt/sglang-env/bin/python"
    assert units.server_python([py, "-m", "sglang.launch_server", "--port", "1"]) == (
        py, [py, "-m", "sglang.launch_server", "--port", "1"])
    # after a launcher, and inside sh -c
    assert units.server_python(["/usr/bin/timeout", "9", py, "-m", "sglang_router.launch_server"])[0] == py
    assert units.server_python(["/bin/sh", "-c", f"cd /x && exec {py} -m sglang.launch_server --tp 2"])[0] == py
    # `uv run python ...`: the project's .venv in the working directory
    assert units.server_python(["/usr/local/bin/uv", "run", "python", "-m", "sglang.launch_server"], "/srv/llm")[0] == \
        "/srv/llm/.venv/bin/python"
    # the console script: its #! interpreter
    script = tmp_path / "sglang"
    script.write_text(f"#!{tmp_path}/python\nimport sys\n")
    assert units.server_python([str(script), "serve", "--model-path", "m"]) == (
        f"{tmp_path}/python", [f"{tmp_path}/python", str(script), "serve", "--model-path", "m"])
    # no SGLang server: a wrapper's words alone, another program
    assert units.server_python(["/usr/bin/echo", "sglang.launch_server"]) is None
    assert units.server_python([py, "-c", "import sglang.launch_server"]) is None
    assert units.server_python(["/usr/sbin/cron", "-f"]) is None


def _layout(tmp_path):
    etc, lib = tmp_path / "etc", tmp_path / "lib"
    (etc / "sglang.service.d").mkdir(parents=True)
    (lib / "sglang.service.d").mkdir(parents=True)
    (lib / "sglang.service").write_text(UNIT)
    (etc / "sglang.service").write_text(UNIT.replace("--tp 4", "--tp 8"))  # /etc wins over /lib
    (lib / "sglang.service.d" / "10-port.conf").write_text(DROP_IN)
    (etc / "sglang.service.d" / "10-port.conf").write_text("[Service]\nUser=other\n")  # hides lib's 10-port.conf
    (lib / "sglang@.service").write_text(UNIT)  # a template: only its instances run
    (lib / "cron.service").write_text("[Service]\nExecStart=/usr/sbin/cron -f\n")
    os.mkfifo(lib / "fifo.service")  # never opened for reading
    return [str(etc), str(lib)]


def test_services_from_unit_files_when_systemd_does_not_run(tmp_path):
    search = _layout(tmp_path)
    files = units.unit_files(search)
    assert files["sglang.service"] == [f"{search[0]}/sglang.service", f"{search[0]}/sglang.service.d/10-port.conf"]
    assert "sglang@.service" not in files
    assert units.services(search, systemctl=False) == [{
        "unit": "sglang.service", "source": f"{search[0]}/sglang.service", "python": "/opt/sglang-env/bin/python",
        "argv": ["/opt/sglang-env/bin/python", "-m", "sglang.launch_server", "--model", "/models/gpt-oss-120b",
                 "--port", "30000", "--tp", "8"],
        "cwd": "/opt/sglang", "user": "other", "pythonpath": ["/opt/sglang/extra"]}]
    u = units.services(search, systemctl=False)[0]
    assert units.import_path(u) == ["/opt/sglang", "/opt/sglang/extra"]


def test_services_as_systemctl_shows_them(tmp_path):
    """A program in systemctl's place (a stand-in: this machine's systemd is not running) that
    records its arguments and prints SHOW: the units named are the ones whose files name sglang,
    each property asked; what it says wins over the unit files."""
    search = _layout(tmp_path)
    args = tmp_path / "args"
    fake = tmp_path / "systemctl"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {shlex.quote(str(args))}\ncat {shlex.quote(str(tmp_path / 'show'))}\n")
    fake.chmod(0o755)
    (tmp_path / "show").write_text(SHOW)
    got = units.services(search, systemctl=str(fake))
    assert args.read_text().split("\n")[:-1] == ["show", "--no-pager", "-pId", "-pExecStart", "-pWorkingDirectory",
                                                 "-pUser", "-pEnvironment", "--", "sglang.service"]
    assert got == [{"unit": "sglang.service", "source": "systemctl", "python": "/opt/sglang-env/bin/python",
                    "argv": ["/opt/sglang-env/bin/python", "-m", "sglang.launch_server", "--model",
                             "/models/gpt-oss-120b", "--port", "30000", "--tp", "4"],
                    "cwd": "/opt/sglang", "user": "llm", "pythonpath": ["/opt/sglang/extra", "rel"]}]
    assert units.import_path(got[0]) == ["/opt/sglang", "/opt/sglang/extra", "/opt/sglang/rel"]
    fake.write_text("#!/bin/sh\nexit 1\n")  # systemctl fails: the unit files are read instead
    assert units.services(search, systemctl=str(fake))[0]["source"] == f"{search[0]}/sglang.service"
