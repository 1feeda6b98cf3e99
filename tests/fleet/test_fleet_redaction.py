"""Review N11 through real sshd: a server whose command line carries secrets in every form the
review found unredacted (headers, JSON and YAML keys, environment assignments, `mysql -p`,
signed-URL parameters, URL credentials in --model-path, a dash-led --api-key value) shows each
of them as <redacted> in `fleetctl inspect --json` (argv, model_path) and `validate --json`
(the model_path the server answers), and no secret in any output, human reports included;
SGLang's own options around them are kept."""

from __future__ import annotations

import json
import secrets
import shlex

import yaml
from helpers.lab import standin_wrapper

HOST = "lab-03"
HOME = "/opt/fleetctl-n11"  # root's, 0755: the stand-in's import path must be trusted
PORT = 30041
PYTHON = "/opt/sglang/venv/bin/python"
SERVER = f"{HOME}/fleetctl-standin/server.py"
# The lab's STAND-IN server (not SGLang: a lab host has no GPU), started through a script that
# procs takes for it (a fleetctl-standin/server.py) and that gives it only the options it knows:
# the rest of the command line is there to be read from /proc.
WRAPPER = standin_wrapper(("--host", "--port", "--model-path", "--behavior"))


def test_each_secret_form_is_redacted_in_inspect_and_validate(server_lab, tmp_path):
    s = {k: f"{k}-{secrets.token_hex(6)}" for k in (
        "userinfo", "sas", "amz", "goog", "token", "dashes", "bearer", "xkey", "cookie", "json", "jsonpw", "yaml",
        "pg", "mysqlpwd", "mysqlp")}
    query = "?sv=2022-11-02&sig={sas}&X-Amz-Signature={amz}&X-Goog-Signature={goog}&token={token}"
    model = f"https://hf-user:{s['userinfo']}@hf.example.invalid/models/keymaster" + query.format(**s)
    shown_model = "https://<redacted>@hf.example.invalid/models/keymaster" + query.format(
        **{k: "<redacted>" for k in s})
    sglang = ["--kv-cache-dtype", "fp8_e5m2", "--tokenizer-path", "/models/keymaster", "--disable-radix-cache",
              "--page-size", "16"]
    argv = [PYTHON, SERVER, "--host", "127.0.0.1", "--port", str(PORT), "--model-path", model, *sglang,
            "--api-key", f"--{s['dashes']}", "-H", f"Authorization: Bearer {s['bearer']}",
            "-H", f"X-API-Key: {s['xkey']}", "-H", f"Cookie: session={s['cookie']}",
            json.dumps({"api_key": s["json"], "password": s["jsonpw"]}), f"api_key: {s['yaml']}",
            f"PGPASSWORD={s['pg']}", f"MYSQL_PWD={s['mysqlpwd']}", f"mysql -uroot -p{s['mysqlp']} fleet",
            "--behavior", f"{HOME}/behavior.json"]
    shown_argv = [PYTHON, SERVER, "--host", "127.0.0.1", "--port", str(PORT), "--model-path", shown_model, *sglang,
                  "--api-key", "<redacted>", "-H", "Authorization: Bearer <redacted>",
                  "-H", "X-API-Key: <redacted>", "-H", "Cookie: <redacted>",
                  '{"api_key": "<redacted>", "password": "<redacted>"}', "api_key: <redacted>",
                  "PGPASSWORD=<redacted>", "MYSQL_PWD=<redacted>", "mysql -uroot -p<redacted> fleet",
                  "--behavior", f"{HOME}/behavior.json"]
    doc = yaml.safe_load(server_lab.inventory.read_text())
    doc["all"]["children"]["lab"]["hosts"][HOST]["fleetctl_sglang_port"] = PORT
    inv = tmp_path / "hosts.yaml"
    inv.write_text(yaml.safe_dump(doc))
    r = server_lab.ssh(HOST, f"mkdir -p {HOME}/fleetctl-standin && chmod 755 {HOME} {HOME}/fleetctl-standin && "
                             f"printf %s {shlex.quote(WRAPPER)} > {SERVER} && "
                             f"{{ setsid nohup {shlex.join(argv)} > {HOME}/log 2>&1 < /dev/null & echo $!; }}")
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout.split()[-1])
    try:
        js, _, hosts = server_lab.cli_json("inspect", HOST, rc=0)
        served = next(x for x in hosts[HOST]["facts"]["servers"] if x["pid"] == pid)
        assert (served["argv"], served["model_path"], served["host"]) == (shown_argv, shown_model, "127.0.0.1")
        human = server_lab.cli("inspect", HOST, env={"COLUMNS": "1000"})
        assert human.returncode == 0, human.stdout[-2000:]
        assert f":{PORT} {shown_model} tp=1 " in human.stdout and "(stand-in)" in human.stdout, human.stdout[-3000:]

        checked, _, hosts = server_lab.cli_json("validate", HOST, "-i", str(inv), "--repeat", "1",
                                                "--health-timeout", "120", rc=0)
        [decoded] = hosts[HOST]["servers"]
        assert (decoded["port"], decoded["ok"], decoded["model_path"]) == (PORT, True, shown_model), decoded
        table = server_lab.cli("validate", HOST, "-i", str(inv), "--repeat", "1", "--health-timeout", "120",
                               env={"COLUMNS": "1000"})
        assert table.returncode == 0 and f":{PORT} {shown_model} (stand-in)" in table.stdout, table.stdout[-3000:]
        for out in (js, human, checked, table):
            for secret in s.values():
                assert secret not in out.stdout + out.stderr, secret
    finally:
        r = server_lab.ssh(HOST, f"kill {pid}; while kill -0 {pid} 2>/dev/null; do sleep 0.1; done; rm -rf {HOME}")
        assert r.returncode == 0, r.stderr
