"""Secret redaction, run on the host before anything leaves it (stdlib only, Python 3.8+).

A secret is the value of an option (`--name VALUE`, `--name=VALUE`) or of a `NAME=VALUE` word
whose name, split on `-` and `_`, has a part equal to one of SECRET_PARTS, or ends in "apikey":
`--api-key`, `--admin-api-key`, `--hf-token`, `HF_TOKEN`, `OPENAI_APIKEY` are secrets;
`--max-total-tokens`, `--tokenizer-path` are not. The user:password of a URL is a secret too.
Each becomes REDACTED. The probes that report server argv, shell commands and command output
(facts, smoke) load this module first; the control side uses the same rules on the output of
the commands it runs itself (handlers).
"""

import re

REDACTED = "<redacted>"
SECRET_PARTS = ("token", "key", "secret", "password", "passwd", "credential")
_NAME = r"[A-Za-z][A-Za-z0-9_-]*"
# --name=value | --name value | NAME=value, in free text (a shell command, an output line);
# the value is a quoted string or a run of non-blank characters.
_VALUE = r"(?:'[^']*'|\"[^\"]*\"|[^\s'\";&|]+)"
_OPTION = re.compile(r"(?P<lead>(?<![\w-])--?)(?P<name>%s)(?P<sep>=|\s+)(?P<value>%s)" % (_NAME, _VALUE))
_ASSIGN = re.compile(r"(?P<lead>(?<![\w-]))(?P<name>%s)(?P<sep>=)(?P<value>%s)" % (_NAME, _VALUE))
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]+@")


def secret_name(name):
    """True when option or variable `name` (leading dashes ignored) names a secret (see module)."""
    name = name.lstrip("-").lower()
    parts = [p for p in re.split(r"[-_]+", name) if p]
    return any(p in SECRET_PARTS for p in parts) or re.sub(r"[-_]", "", name).endswith("apikey")


def argv(args):
    """A copy of the argument list with every secret value replaced by REDACTED."""
    out, hide = [], False
    for a in args:
        if hide and not a.startswith("--"):
            out.append(REDACTED)
            hide = False
            continue
        hide = False
        m = re.match(r"(--?%s)=" % _NAME, a) or re.match(r"(%s)=" % _NAME, a)
        if m and secret_name(m.group(1)):
            out.append(m.group(0) + REDACTED)
            continue
        if a.startswith("-") and re.fullmatch(r"--?%s" % _NAME, a) and secret_name(a):
            hide = True
        out.append(_URL_CREDENTIALS.sub(r"\g<scheme>%s@" % REDACTED, a))
    return out


def text(s):
    """`s` (a shell command, output) with every secret value replaced by REDACTED; None stays None."""
    if s is None:
        return None

    def hide(m):
        if not secret_name(m.group("name")):
            return m.group(0)
        return m.group("lead") + m.group("name") + m.group("sep") + REDACTED

    s = _OPTION.sub(hide, s)
    s = _ASSIGN.sub(hide, s)
    return _URL_CREDENTIALS.sub(r"\g<scheme>%s@" % REDACTED, s)
