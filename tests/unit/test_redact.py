"""Secret redaction (probes/redact.py), the rules of issue 13: a name split on - and _ with a part
token/key/secret/password/passwd/credential, or ending in apikey, hides its value."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fleetctl import probes
from fleetctl.probes import redact


@pytest.mark.parametrize("name", ["--api-key", "--admin-api-key", "--hf-token", "HF_TOKEN", "OPENAI_APIKEY",
                                  "--openaiapikey", "DB_PASSWORD", "--client-secret", "AWS_CREDENTIAL", "passwd"])
def test_secret_names(name):
    assert redact.secret_name(name)


@pytest.mark.parametrize("name", ["--max-total-tokens", "--tokenizer-path", "--keyfile-dir", "--monkey",
                                  "--port", "--model-path", "TOKENIZERS_PARALLELISM"])
def test_not_secret_names(name):
    assert not redact.secret_name(name)


def test_argv_keeps_everything_but_the_secret_values():
    argv = ["python3", "-m", "sglang.launch_server", "--model-path", "https://u:pw@hf.example.invalid/m",
            "--api-key", "sk-1", "--admin-api-key=adm-2", "--max-total-tokens", "4096", "--tokenizer-path", "/t",
            "HF_TOKEN=hf_3", "--hf-token", "--port", "30000"]
    assert redact.argv(argv) == [
        "python3", "-m", "sglang.launch_server", "--model-path", "https://<redacted>@hf.example.invalid/m",
        "--api-key", "<redacted>", "--admin-api-key=<redacted>", "--max-total-tokens", "4096",
        "--tokenizer-path", "/t", "HF_TOKEN=<redacted>", "--hf-token", "--port", "30000"]


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
    doc = probes.bundle("smoke", params)
    p = subprocess.run(probes.command(sys.executable), input=doc, capture_output=True, timeout=60)
    out = probes.parse_output(p.stdout, p.stderr, p.returncode)["offline"]
    assert out["cmd"] == "HF_TOKEN=<redacted> sh -c 'echo api_key=<redacted>; echo fine'"
    assert out["tail"] == ["api_key=<redacted>", "fine"]
    assert "hf_secret" not in json.dumps(out) and "sk-out" not in json.dumps(out)
