"""Secret redaction, run on the host before anything leaves it (stdlib only, Python 3.8+).

A secret name (an option, a variable, a JSON/YAML key, an HTTP header, a URL query parameter) is
one whose last word, split on `-`, `_` and `.` (a trailing number dropped: API_KEY_2), is one of
SECRET_WORDS or ends in one of COMPOUND_ENDS: `--api-key`, `--admin-api-key`, `--hf-token`,
`--ssl-keyfile-password`, `X-API-Key`, `X-Amz-Signature`, `Authorization`, `DB_PASS`, and
`PGPASSWORD`, `MYSQL_PWD`, `OPENAI_APIKEY`. A secret word earlier in a name says what something
else is for (`--ssl-keyfile`, `--api-key-file`, `--speculative-token-map`, `--ds-heavy-token-num`),
a word that merely starts or ends like one is another word (`--tokenizer-path`, `--monkey`,
`--custom-sigquit-handler`, `--max-total-tokens`), a `token` after a word of TEXT_TOKENS is a
piece of text or a count (`--bucket-time-to-first-token`, `bos_token`), and the shell's `PWD`
and `OLDPWD` are directories. A plain substring rule would hide the values of SGLang's own
`--tokenizer-path` and `--prefill-delayer-forward-passes-buckets`.

The value of a secret becomes REDACTED in each of these forms (text() finds them in a shell
command or an output line; argv() in a process's arguments, each argument also read as text):
- an option: `--name VALUE`, `--name=VALUE`, `-name VALUE`; the word after a secret option is its
  value even when it starts with a dash (`--api-key --x`: getopt and click take it as the value);
- an assignment `NAME=VALUE`: environment variables, `k=v` lists, Python reprs, the parameters
  of a signed URL (`?sig=` of Azure SAS, `X-Amz-Signature=`, `X-Goog-Signature=`, `token=`);
- `name: value`, `"name": "value"`, `'name': 'value'` (YAML, JSON, Python dicts, HTTP headers
  such as `-H 'X-API-Key: V'`); quotes are kept, so a redacted document still parses, an
  `Authorization: Bearer V` keeps its scheme, and a `Cookie:`/`Set-Cookie:` header is hidden to its
  end. A `#name: N` is a count of SGLang's logs (`#token: 1024`), kept;
- a password given to a known tool by its own option (TOOL_PASSWORDS): `mysql -pSECRET`,
  `sshpass -p SECRET`, `redis-cli -a SECRET`, `curl -u user:SECRET`;
- the userinfo (user:password) of a URL: `https://<redacted>@host/...`.
The probes that report server argv, model paths, shell commands and command output (facts,
smoke) load this module first; the control side uses the same rules on the output of the commands
it runs itself (handlers) and on what the servers answer (their model_path).
"""

import os
import re

REDACTED = "<redacted>"
SECRET_WORDS = frozenset((
    "password", "passwords", "passwd", "pass", "pwd", "passphrase", "secret", "secrets", "token", "key", "keys",
    "apikey", "auth", "authorization", "credential", "credentials", "sig", "signature", "cookie", "cookies"))
COMPOUND_ENDS = ("password", "passwd", "passphrase", "pwd", "secret", "token", "apikey", "auth", "credential",
                 "signature")
# a "token" after these is a model's special token (tokenizer_config.json), a multimodal or
# reasoning/tool-call marker (SGLang's parsers: think_start_token), or a unit (server_args.py:
# --bucket-time-to-first-token, --kt-max-deferred-experts-per-token)
TEXT_TOKENS = frozenset(("bos", "eos", "pad", "unk", "sep", "cls", "mask", "image", "video", "audio", "start", "end",
                         "first", "per"))
SHELL_DIRS = frozenset(("pwd", "oldpwd"))
# (tools, their options whose value is a password, whether that value may be the next word);
# the first such option after a tool's name is taken as its own (`sshpass -p PW ssh -p 22 h`)
TOOL_PASSWORDS = (
    # a lone -p asks for the password; the word after it is a database name
    (("mysql", "mysqldump", "mysqladmin", "mysqlimport", "mysqlshow", "mysqlcheck", "mysqlpump", "mysqlbinlog",
      "mysqlslap", "mariadb", "mariadb-dump", "mariadb-admin"), ("-p",), False),
    (("sshpass",), ("-p",), True),
    (("redis-cli",), ("-a",), True),
    (("curl",), ("-u", "--user"), True),  # user:password
)
_NAME = r"[A-Za-z][A-Za-z0-9_.-]*"
# the value is a quoted string or a run of non-blank characters
_VALUE = r"(?:'[^']*'|\"[^\"]*\"|[^\s'\";&|]+)"
# --name=value | --name value | -name value, in free text (a shell command, an output line)
_OPTION = re.compile(r"(?P<lead>(?<![\w-])--?)(?P<name>%s)(?P<sep>=|[ \t]+)(?P<value>%s)" % (_NAME, _VALUE))
# NAME=value (a URL's query parameter too: ?sig=..., &X-Amz-Signature=...)
_ASSIGN = re.compile(r"(?P<lead>(?<![\w.-]))(?P<name>%s)(?P<sep>=)(?P<value>%s)" % (_NAME, _VALUE))
# name: value, "name": "value", 'name': 'value', a header; an auth scheme before the value is kept
_SCHEMES = r"(?i:bearer|basic|digest|token|negotiate|ntlm|apikey|key)"
_COLON = re.compile(r"(?P<lead>(?<![\w#/.-])(?P<q>[\"']?))(?P<name>%s)(?P<sep>(?P=q)[ \t]*:[ \t]*(?:%s[ \t]+)?)"
                    r"(?P<value>\"(?:[^\"\\]|\\.)*\"|'[^']*'|[^\s'\",;}\]]+)" % (_NAME, _SCHEMES))
_COOKIE = re.compile(r"(?i)(?P<head>(?<![\w-])(?:set-)?cookie[ \t]*:[ \t]*)[^'\"\r\n]+")
_URL_CREDENTIALS = re.compile(r"(?P<scheme>(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]+@")
_TOOLS = {n: (opts, nxt) for names, opts, nxt in TOOL_PASSWORDS for n in names}  # name -> (options, next word?)
# a known tool's name as a command word (a path to it too); then the words of its command, up to ; & | or a line's end
_TOOL_NAME = re.compile(r"(?<![\w./-])(?:[\w.-]*/)*(?P<tool>%s)(?=[ \t])"
                        % "|".join(sorted(map(re.escape, _TOOLS), key=len, reverse=True)))
_WORD = re.compile(r"[ \t]+(?P<word>(?:'[^']*'|\"[^\"]*\"|[^\s'\";&|])+)")  # a shell word: quoted and bare parts
# what every redaction below needs somewhere in the text, in any case: a piece of a secret word
# (each of SECRET_WORDS and COMPOUND_ENDS holds one; names are ASCII), "cookie", a URL's "://", or a
# known tool's name (sshpass's holds "pass"); a text without any is returned as it is, unread by the
# rules (most of what a host reports). An ASCII text is searched lowercased (a case-blind pattern
# costs 5x more); any other case-blind, as the rules' own (?i) match: str.lower() is no simple case
# fold ("\u0130".lower() is two characters, and _COOKIE's (?i) takes it for an "i").
_MAYBE_PATTERN = "pass|pwd|secret|token|key|auth|credential|sig|cookie|://|%s" % "|".join(
    sorted(map(re.escape, _TOOLS), key=len, reverse=True))
_MAYBE = re.compile(_MAYBE_PATTERN)
_MAYBE_ANY_CASE = re.compile("(?i)" + _MAYBE_PATTERN)


def secret_name(name):
    """True when `name` (an option, variable, key or header; leading dashes ignored) names a
    secret (the rule: see the module docstring)."""
    words = [w for w in re.split(r"[-_.]+", name.lstrip("-").lower()) if w]
    while words and words[-1].isdigit():
        words.pop()
    if not words or (len(words) == 1 and words[0] in SHELL_DIRS):
        return False
    last = words[-1]
    if last == "token" and len(words) > 1 and words[-2] in TEXT_TOKENS:
        return False
    return last in SECRET_WORDS or last.endswith(COMPOUND_ENDS)


def _tool_option(tool, a):
    """For argument `a` after a known tool's name (`tool`: its TOOL_PASSWORDS options and whether
    the value may be the next word): `a` with the password REDACTED when it carries it, True when
    the next argument is the password, None when `a` is no password option."""
    opts, next_word = tool
    for o in opts:
        if a == o:
            return True if next_word else None
        if o.startswith("--") and a.startswith(o + "="):
            return o + "=" + REDACTED
        if not o.startswith("--") and a.startswith(o) and len(a) > len(o):
            return o + REDACTED
    return None


def _tool_passwords(s):
    """`s` with the password of each known tool's command (TOOL_PASSWORDS) REDACTED, read word by
    word as argv() reads arguments (one pass: the time is linear in len(s))."""
    out, pos = [], 0
    while True:
        m = _TOOL_NAME.search(s, pos)
        if m is None:
            return "".join(out) + s[pos:]
        tool, i = _TOOLS[m.group("tool")], m.end()
        w = _WORD.match(s, i)
        while w is not None:
            found = _tool_option(tool, w.group("word"))
            if found is True:
                w = _WORD.match(s, w.end())
                if w is not None:
                    out.append(s[pos:w.start("word")] + REDACTED)
                    pos = i = w.end()
                break
            if found is not None:
                out.append(s[pos:w.start("word")] + found)
                pos = i = w.end()
                break
            i = w.end()
            w = _WORD.match(s, i)
        out.append(s[pos:i])
        pos = i


def argv(args):
    """A copy of the argument list `args` (strings) with every secret value replaced by
    REDACTED (the forms: see the module docstring)."""
    out, hide, tool = [], False, None
    for a in args:
        if hide:
            out.append(REDACTED)
            hide = False
            continue
        tool = _TOOLS.get(os.path.basename(a), tool)
        found = _tool_option(tool, a) if tool else None
        if found is not None:
            tool, hide = None, found is True  # the tool's first password option is its own
            out.append(a if hide else found)
            continue
        m = re.match(r"(--?%s)=" % _NAME, a) or re.match(r"(%s)=" % _NAME, a)
        if m and secret_name(m.group(1)):
            out.append(m.group(0) + REDACTED)
            continue
        hide = bool(re.fullmatch(r"--?%s" % _NAME, a)) and secret_name(a)
        out.append(text(a))
    return out


def text(s):
    """`s` (a shell command, output) with every secret value replaced by REDACTED; None stays None."""
    if s is None or not (_MAYBE.search(s.lower()) if s.isascii() else _MAYBE_ANY_CASE.search(s)):
        return s
    return _rules(s)


def _rules(s):
    """`s` with each form of the module docstring redacted (text(): without its _MAYBE shortcut)."""
    def hide(m):
        if not secret_name(m.group("name")):
            return m.group(0)
        return m.group("lead") + m.group("name") + m.group("sep") + REDACTED

    def hide_quoted(m):
        if not secret_name(m.group("name")):
            return m.group(0)
        v = m.group("value")
        kept = v[0] + REDACTED + v[-1] if len(v) > 1 and v[0] in "\"'" and v[-1] == v[0] else REDACTED
        return m.group("lead") + m.group("name") + m.group("sep") + kept

    s = _tool_passwords(s)
    s = _OPTION.sub(hide, s)
    s = _ASSIGN.sub(hide, s)
    s = _COOKIE.sub(lambda m: m.group("head") + REDACTED, s)
    s = _COLON.sub(hide_quoted, s)
    return _URL_CREDENTIALS.sub(r"\g<scheme>%s@" % REDACTED, s)
