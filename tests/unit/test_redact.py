"""Secret redaction (probes/redact.py): the rules of issue 13 (a secret name hides its value) and the
forms of review N11 (headers, JSON/YAML keys, environment assignments, -p<password> of known tools,
signed-URL parameters, URL credentials, a secret option's dash-led value), with what must stay:
a real SGLang command line and its options' values."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time

import pytest

from fleetctl import probes
from fleetctl.probes import redact
from fleetctl.probes.facts import procs


@pytest.mark.parametrize("name", ["--api-key", "--admin-api-key", "--hf-token", "HF_TOKEN", "OPENAI_APIKEY",
                                  "--openaiapikey", "DB_PASSWORD", "--client-secret", "AWS_CREDENTIAL", "passwd",
                                  "PGPASSWORD", "MYSQL_PWD", "DB_PASS", "API_KEY_2", "X-API-Key", "Authorization",
                                  "Proxy-Authorization", "Cookie", "sig", "X-Amz-Signature", "X-Goog-Signature",
                                  "X-Amz-Security-Token", "token", "--ssl-keyfile-password", "AWS_SECRET_ACCESS_KEY",
                                  "spring.datasource.password", "--auth"])
def test_secret_names(name):
    assert redact.secret_name(name)


@pytest.mark.parametrize("name", ["--max-total-tokens", "--tokenizer-path", "--keyfile-dir", "--monkey",
                                  "--port", "--model-path", "TOKENIZERS_PARALLELISM", "--kv-cache-dtype",
                                  "--disable-radix-cache", "--page-size", "--ssl-keyfile", "--api-key-file",
                                  "--speculative-token-map", "--ds-heavy-token-num", "--bucket-time-to-first-token",
                                  "--kt-max-deferred-experts-per-token", "--custom-sigquit-handler", "bos_token",
                                  "--prefill-delayer-forward-passes-buckets", "PWD", "OLDPWD", "AWS_ACCESS_KEY_ID",
                                  "StrictHostKeyChecking", "PasswordAuthentication", "KeyError", "author", "signal"])
def test_not_secret_names(name):
    assert not redact.secret_name(name)


def test_argv_keeps_everything_but_the_secret_values():
    argv = ["python3", "-m", "sglang.launch_server", "--model-path", "https://u:pw@hf.example.invalid/m",
            "--api-key", "sk-1", "--admin-api-key=adm-2", "--max-total-tokens", "4096", "--tokenizer-path", "/t",
            "HF_TOKEN=hf_3", "--hf-token", "--port", "30000"]
    # the word after a secret option is its value, whatever it looks like (review N11: `--api-key --x`)
    assert redact.argv(argv) == [
        "python3", "-m", "sglang.launch_server", "--model-path", "https://<redacted>@hf.example.invalid/m",
        "--api-key", "<redacted>", "--admin-api-key=<redacted>", "--max-total-tokens", "4096",
        "--tokenizer-path", "/t", "HF_TOKEN=<redacted>", "--hf-token", "<redacted>", "30000"]


def test_text_redacts_commands_and_output_lines():
    cmd = ("HF_TOKEN=hf_3 OPENAI_APIKEY='a b' python -m sglang.launch_server --api-key sk-1 "
           "--max-total-tokens 5 --admin-api-key=\"q r\"; echo done --password  pw|cat")
    assert redact.text(cmd) == (
        "HF_TOKEN=<redacted> OPENAI_APIKEY=<redacted> python -m sglang.launch_server --api-key <redacted> "
        "--max-total-tokens 5 --admin-api-key=<redacted>; echo done --password  <redacted>|cat")
    assert redact.text("token usage: 5, max_total_tokens=9") == "token usage: 5, max_total_tokens=9"
    assert redact.text(None) is None


def test_the_smoke_probe_redacts_its_offline_command_and_output_on_the_host():
    """Through the real bundle (redact loaded before smoke), as on a host."""
    params = {"offline_cmd": "HF_TOKEN=hf_secret sh -c 'echo api_key=sk-out; echo fine'"}
    doc = probes.bundle("traffic.smoke", params)
    p = subprocess.run(probes.command(sys.executable), input=doc, capture_output=True, timeout=60)
    out = probes.parse_output(p.stdout, p.stderr, p.returncode)["offline"]
    assert out["cmd"] == "HF_TOKEN=<redacted> sh -c 'echo api_key=<redacted>; echo fine'"
    assert out["tail"] == ["api_key=<redacted>", "fine"]
    assert "hf_secret" not in json.dumps(out) and "sk-out" not in json.dumps(out)


@pytest.mark.parametrize("given, shown", [
    ("curl -H 'Authorization: Bearer sk-live-123' http://127.0.0.1:30000/v1/models",
     "curl -H 'Authorization: Bearer <redacted>' http://127.0.0.1:30000/v1/models"),
    ('curl -H "X-API-Key: abc123" -H "Proxy-Authorization: Basic dTpw" http://127.0.0.1:30000/',
     'curl -H "X-API-Key: <redacted>" -H "Proxy-Authorization: Basic <redacted>" http://127.0.0.1:30000/'),
    ("curl -H 'Cookie: session=c00kie; csrftoken=xyz' -b a", "curl -H 'Cookie: <redacted>' -b a"),
    ("Set-Cookie: sid=abc; Path=/; HttpOnly", "Set-Cookie: <redacted>"),
    ('{"api_key": "sk-json-123", "password": "pw1", "model": "m", "hf_token": "a\\"b"}',
     '{"api_key": "<redacted>", "password": "<redacted>", "model": "m", "hf_token": "<redacted>"}'),
    ("{'hf_token': 'hf_x', 'port': 30000}", "{'hf_token': '<redacted>', 'port': 30000}"),
    ("api_key: sk-yaml-123", "api_key: <redacted>"),
    ("  password: 'pw 2'  # the db's", "  password: '<redacted>'  # the db's"),
    ("PGPASSWORD=x psql -h db -U u", "PGPASSWORD=<redacted> psql -h db -U u"),
    ("MYSQL_PWD=abc mysql -h db", "MYSQL_PWD=<redacted> mysql -h db"),
    ("mysql -uroot -pS3cret fleet", "mysql -uroot -p<redacted> fleet"),
    ("mysqldump -p fleet > d.sql; /usr/bin/mariadb -h db -p'a b' x",
     "mysqldump -p fleet > d.sql; /usr/bin/mariadb -h db -p<redacted> x"),
    ("sshpass -p pw1 ssh -p 22 h", "sshpass -p <redacted> ssh -p 22 h"),
    ("redis-cli -h r -a rpw ping", "redis-cli -h r -a <redacted> ping"),
    ("curl -u admin:pw http://h/ && curl --user=admin:pw2 http://h/",
     "curl -u <redacted> http://h/ && curl --user=<redacted> http://h/"),
    ("https://acct.blob.core.windows.net/c/m.safetensors?sv=2022-11-02&sp=r&se=2030-01-01&sig=SAS-SIGNATURE",
     "https://acct.blob.core.windows.net/c/m.safetensors?sv=2022-11-02&sp=r&se=2030-01-01&sig=<redacted>"),
    ("https://b.s3.amazonaws.com/m?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Security-Token=ST&X-Amz-Signature=AMZ",
     "https://b.s3.amazonaws.com/m?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Security-Token=<redacted>"
     "&X-Amz-Signature=<redacted>"),
    ("https://storage.googleapis.com/b/m?X-Goog-Signature=GSIG&X-Goog-Expires=900",
     "https://storage.googleapis.com/b/m?X-Goog-Signature=<redacted>&X-Goog-Expires=900"),
    ("https://hf.example.invalid/m?token=TOK&rev=main", "https://hf.example.invalid/m?token=<redacted>&rev=main"),
    ("serve --api-key --leading-dashes-secret --port 30000", "serve --api-key <redacted> --port 30000"),
    ("git clone https://user:tok@git.example.invalid/m.git", "git clone https://<redacted>@git.example.invalid/m.git"),
    ("ServerArgs(model_path='/m', api_key='sk-x', tokenizer_path='/t')",
     "ServerArgs(model_path='/m', api_key=<redacted>, tokenizer_path='/t')"),
])
def test_each_secret_form_is_redacted_in_text(given, shown):
    assert redact.text(given) == shown


@pytest.mark.parametrize("kept", [
    "Decode batch. #running-req: 1, #token: 1024, token usage: 0.01, gen throughput (token/s): 50.00",
    "Prefill batch. #new-seq: 1, #new-token: 512, #cached-token: 0",  # SGLang's own log lines
    "/models/keymaster", "PWD=/root OLDPWD=/ HOME=/root", "KeyError: 'x'", "Password:\nnext line",
    "ssh -o StrictHostKeyChecking=no -o PasswordAuthentication=no -p 2222 h", "mysql -p fleet",
    '{"bos_token": "<s>", "eos_token": "</s>", "max_total_tokens": 4096}',
])
def test_what_is_no_secret_is_kept(kept):
    assert redact.text(kept) == kept


# A real SGLang command line (options of sglang/srt/server_args.py, 0.4.6.post5 to 0.5.23).
SGLANG = ("python3 -m sglang.launch_server --model-path /models/keymaster --tokenizer-path /models/keymaster/tok "
          "--host 0.0.0.0 --port 30000 --tp-size 2 --dp-size 1 --kv-cache-dtype fp8_e5m2 --disable-radix-cache "
          "--page-size 16 --mem-fraction-static 0.85 --chunked-prefill-size 8192 --max-total-tokens 65536 "
          "--max-prefill-tokens 16384 --schedule-policy lpm --attention-backend flashinfer --cuda-graph-max-bs 160 "
          "--speculative-algorithm EAGLE --speculative-draft-model-path /models/keymaster-draft "
          "--speculative-num-draft-tokens 4 --speculative-token-map /models/keymaster/hot_token_map.pt "
          "--ds-heavy-token-num 256 --ssl-keyfile /etc/sglang/tls.key --skip-tokenizer-init "
          "--enable-tokenizer-batch-encode --bucket-time-to-first-token 0.1 0.5 1 --served-model-name keymaster "
          "--trust-remote-code --random-seed 42 --tool-call-parser llama3 --lora-paths a=/loras/a")
# Every option of those releases whose name holds a word of a secret's.
SGLANG_WORDY = [
    "--admin-api-key", "--api-key", "--bucket-inter-token-latency", "--bucket-time-to-first-token",
    "--collect-tokens-histogram", "--custom-sigquit-handler", "--disable-tokenizer-batch-decode", "--ds-heavy-token-num",
    "--dynamic-batch-tokenizer-batch-size", "--dynamic-batch-tokenizer-batch-timeout", "--enable-dynamic-batch-tokenizer",
    "--enable-tokenizer-batch-encode", "--generation-tokens-buckets", "--kt-max-deferred-experts-per-token",
    "--max-prefill-tokens", "--max-total-tokens", "--num-reserved-decode-tokens", "--piecewise-cuda-graph-max-tokens",
    "--piecewise-cuda-graph-tokens", "--prefill-delayer-forward-passes-buckets", "--prefill-delayer-max-delay-passes",
    "--prefill-delayer-token-usage-low-watermark", "--prompt-tokens-buckets", "--skip-tokenizer-init",
    "--speculative-num-draft-tokens", "--speculative-token-map", "--ssl-keyfile", "--ssl-keyfile-password",
    "--swa-full-tokens-ratio", "--tbo-token-distribution-threshold", "--tokenizer-metrics-allowed-custom-labels",
    "--tokenizer-metrics-custom-labels-header", "--tokenizer-mode", "--tokenizer-path", "--tokenizer-worker-num"]


def test_a_real_sglang_command_line_keeps_everything_but_its_secrets():
    """No false positive on SGLang's options: the command line is unchanged, as text and as
    argv; of the options named like secrets only the three that are get their values hidden."""
    assert redact.text(SGLANG) == SGLANG
    assert redact.argv(shlex.split(SGLANG)) == shlex.split(SGLANG)
    assert [n for n in SGLANG_WORDY if redact.secret_name(n)] == ["--admin-api-key", "--api-key", "--ssl-keyfile-password"]
    secrets = SGLANG + " --api-key sk-1 --admin-api-key=adm-2 --ssl-keyfile-password kp-3"
    shown = SGLANG + " --api-key <redacted> --admin-api-key=<redacted> --ssl-keyfile-password <redacted>"
    assert redact.text(secrets) == shown
    assert redact.argv(shlex.split(secrets)) == shlex.split(shown)


def test_each_secret_form_is_redacted_in_argv():
    assert redact.argv(["curl", "-H", "Authorization: Bearer sk-live-123", "-H", "X-API-Key: abc123",
                        "-H", "Cookie: a=b; c=d", "-u", "u:pw", "https://u:tok@h/m?sig=SAS&sp=r"]) == [
        "curl", "-H", "Authorization: Bearer <redacted>", "-H", "X-API-Key: <redacted>",
        "-H", "Cookie: <redacted>", "-u", "<redacted>", "https://<redacted>@h/m?sig=<redacted>&sp=r"]
    assert redact.argv(["sudo", "-u", "db", "/usr/bin/mysql", "-uroot", "-pS3cret", "fleet"]) == [
        "sudo", "-u", "db", "/usr/bin/mysql", "-uroot", "-p<redacted>", "fleet"]
    assert redact.argv(["mysql", "-p", "fleet"]) == ["mysql", "-p", "fleet"]  # -p alone asks; fleet is the database
    assert redact.argv(["sshpass", "-p", "pw", "ssh", "-p", "22", "h"]) == [
        "sshpass", "-p", "<redacted>", "ssh", "-p", "22", "h"]
    assert redact.argv(["env", "PGPASSWORD=x", "MYSQL_PWD=abc", "psql"]) == [
        "env", "PGPASSWORD=<redacted>", "MYSQL_PWD=<redacted>", "psql"]
    # an argument is also read as text (a script); one that starts NAME= is hidden from the = on
    assert redact.argv(["sh", "-c", "echo '{\"api_key\": \"k\"}'; MYSQL_PWD=abc mysql -pX", "--api-key", "--x"]) == [
        "sh", "-c", "echo '{\"api_key\": \"<redacted>\"}'; MYSQL_PWD=<redacted> mysql -p<redacted>",
        "--api-key", "<redacted>"]
    assert redact.argv(["--api-key=a b", "HF_TOKEN=c d"]) == ["--api-key=<redacted>", "HF_TOKEN=<redacted>"]


def test_the_servers_model_path_and_host_are_redacted_on_the_host(tmp_path):
    """procs.find_servers (the facts probe's) on a real process: a STAND-IN for a server (a
    sleeping script named as the lab's stand-in, so procs takes it for one) whose --model-path
    carries a URL's credentials and a signed URL, and whose --host a secret: argv, model_path and
    host all show <redacted> where the secrets were."""
    home = tmp_path / "fleetctl-standin"
    home.mkdir()
    (home / "server.py").write_text("import time\ntime.sleep(60)\n")
    model = "https://hf-user:hf_tok-1@hf.example.invalid/models/keymaster?sv=1&sig=SAS-SIGNATURE&token=T0K"
    p = subprocess.Popen([sys.executable, str(home / "server.py"), "--host", "token=h0st-secret", "--port", "39999",
                          "--model-path", model, "--api-key", "--leading-dashes-secret"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            found = {s["pid"]: s for s in procs.find_servers()[0]}.get(p.pid)
            if found and found["argv"][-1] == "<redacted>":
                break
            time.sleep(0.05)
    finally:
        p.kill()
        p.wait(10)
    assert found["model_path"] == ("https://<redacted>@hf.example.invalid/models/keymaster"
                                   "?sv=1&sig=<redacted>&token=<redacted>")
    assert found["host"] == "token=<redacted>"
    assert found["argv"][1:] == [str(home / "server.py"), "--host", "token=<redacted>", "--port", "39999", "--model-path",
                                 found["model_path"], "--api-key", "<redacted>"]
    for secret in ("hf_tok-1", "SAS-SIGNATURE", "T0K", "h0st-secret", "leading-dashes-secret"):
        assert secret not in json.dumps(found)


@pytest.mark.parametrize("hostile", ["a" * 64000, "/".join(["abc"] * 16000), "mysql " * 10000 + "-x",
                                     '"token": "' * 6000, "curl -H 'Cookie: " * 5000],
                         ids=["long-word", "path", "mysql-words", "json-keys", "cookie-headers"])
def test_redaction_time_is_linear_in_the_text(hostile):
    """64 KiB a host chose (handler output is redacted on the control side) take well under a
    second; a quadratic rule took 20 s and more on the first two (a URL scheme looked for from
    every letter of a long word; a tool's path looked for from every `/`)."""
    t0 = time.monotonic()
    redact.text(hostile)
    assert time.monotonic() - t0 < 5


def test_the_shortcut_for_texts_without_a_secret_word_never_changes_the_result():
    """text() returns a text with no secret word, URL or tool name in it (_MAYBE, on the
    lowercased text) without reading it with the rules: over every form above, in upper case, with
    the Kelvin sign for a k and the dotted capital I for an i (the rules' case-blind patterns match
    both; "\u0130".lower() is two characters) and with each of the secret names and tool names, the
    result is what the rules alone give."""
    names = sorted(redact.SECRET_WORDS) + [f"x_{e}" for e in redact.COMPOUND_ENDS] + ["model", "port", "tp_size"]
    forms = ["--{n}=v1 --{n} v2 -{n} v3", "{n}=v4", "{n}: v5", '"{n}": "v6"', "{n} -p v7 -a v8 -u v9",
             "Cookie: {n}=v10", "scheme{n}://u:{n}@h/"]
    given = [g for g, _ in test_each_secret_form_is_redacted_in_text.pytestmark[0].args[1]]
    texts = given + [f.format(n=n) for f in forms for n in names + sorted(redact._TOOLS)]
    texts += [t.upper() for t in texts] + [t.replace("k", "\u212a") for t in texts]
    texts += [t.replace("i", "\u0130") for t in texts]
    changed = 0
    for t in texts:
        assert redact.text(t) == redact._rules(t), t
        changed += redact._rules(t) != t
    assert changed > len(texts) // 2  # the corpus does reach the rules
