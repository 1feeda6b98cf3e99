#!/usr/bin/env bash
# Mutation testing (mutmut 3, in the `test` extra) of the modules that carry fleetctl's promises:
# inventory patterns, plan and diff, the validation gate, the change probe, the call-site walk.
# Each mutant runs against the unit tests that cover the mutated function (the selection in
# pyproject.toml [tool.mutmut]; never the lab tests, never the tests that scan whole releases).
# Not part of CI: it takes minutes to tens of minutes.
#
# Usage: scripts/mutation.sh [MODULE ...]   MODULE: inventory plan gate change callsites (default: all)
# Env:   MUTATION_JOBS   mutants tested in parallel (default 2)
# Prints the score per module (killed / all mutants) and every survivor; tests/mutation-survivors.md
# says why each remaining survivor is equivalent. Exits 0 whatever the score.
#
# mutmut names mutants after the module path relative to the project and strips only a `src.`
# prefix, so with the package under agent/ the test-to-function map it records (fleetctl.x) never
# matches its mutants (agent.fleetctl.x) and every mutant would be "no tests". The run therefore
# happens in .mutation/, a copy of the checkout with agent/ as src/.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
STAGE=$ROOT/.mutation
JOBS=${MUTATION_JOBS:-2}
command -v mutmut >/dev/null || { echo "mutmut is missing: pip install -e '.[test]'" >&2; exit 2; }

rm -rf "$STAGE"
mkdir -p "$STAGE"
cp -a agent "$STAGE/src"
cp -a tests playbooks hosts.yaml "$STAGE/"
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
python3 - "$ROOT/pyproject.toml" "$STAGE/pyproject.toml" "$@" <<'EOF'
import re, sys, tomllib
src, dst, wanted = sys.argv[1], sys.argv[2], sys.argv[3:]
text = open(src).read()
conf = tomllib.loads(text)["tool"]["mutmut"]
files = conf["only_mutate"]
if wanted:
    files = [f for f in files if f.rsplit("/", 1)[-1][:-3] in wanted]
    unknown = set(wanted) - {f.rsplit("/", 1)[-1][:-3] for f in files}
    if unknown:
        sys.exit("unknown module(s): %s; known: %s" % (", ".join(sorted(unknown)), " ".join(
            f.rsplit("/", 1)[-1][:-3] for f in conf["only_mutate"])))
head, _, tail = text.partition("[tool.mutmut]")
head = head.replace('pythonpath = ["agent"]', 'pythonpath = ["src"]')
tail = re.sub(r'only_mutate = \[.*?\]', "only_mutate = [%s]" % ", ".join(
    '"%s"' % f.replace("agent/", "src/", 1) for f in files), tail, flags=re.S)
tail = tail.replace('source_paths = ["agent"]', 'source_paths = ["src"]')
open(dst, "w").write(head + "[tool.mutmut]" + tail)
EOF

# What is mutated in each module: the functions that carry its promises. inventory: the host
# pattern methods of Inventory (select, _split, _match), not the YAML parser; the others whole.
declare -A SCOPE=(
    [inventory]='fleetctl.inventory.xǁInventoryǁ*'
    [plan]='fleetctl.plan.*'
    [gate]='fleetctl.gate.*'
    [change]='fleetctl.probes.change.*'
    [callsites]='fleetctl.probes.callsites.*'
)
modules=("$@")
[ ${#modules[@]} -gt 0 ] || modules=(inventory plan gate change callsites)
patterns=()
for m in "${modules[@]}"; do patterns+=("${SCOPE[$m]}"); done

cd "$STAGE"
start=$(date +%s)
# mutmut's own exit status is not the score; its progress output is long, keep the tail
nice -n 10 mutmut run --max-children "$JOBS" "${patterns[@]}" > run.log 2>&1 \
    || { tail -n 40 run.log; echo "mutmut run failed (log: $STAGE/run.log)" >&2; exit 1; }
mutmut results --all true > results.txt
python3 - results.txt "$(( $(date +%s) - start ))" "${patterns[@]}" <<'EOF'
import collections, fnmatch, sys
rows = collections.defaultdict(collections.Counter)
survivors = []
for line in open(sys.argv[1]):
    name, _, status = line.strip().rpartition(": ")
    if "__mutmut_" not in name or not any(fnmatch.fnmatch(name, p) for p in sys.argv[3:]):
        continue
    module = name.split(".x")[0].removeprefix("src.")
    rows[module][status] += 1
    if status not in ("killed", "timeout"):
        survivors.append((module, name, status))
print("\nmutation score per module (killed / mutants; a timeout counts as killed), %s s" % sys.argv[2])
print("%-28s %8s %8s %9s %9s %7s" % ("module", "mutants", "killed", "survived", "no tests", "score"))
for module, c in sorted(rows.items()):
    total = sum(c.values())
    caught = c["killed"] + c["timeout"]
    print("%-28s %8d %8d %9d %9d %6.1f%%" % (module, total, caught, c["survived"], c["no tests"],
                                             100.0 * caught / total))
if survivors:
    print("\nnot killed (`cd .mutation && mutmut show NAME` shows the change):")
    for module, name, status in survivors:
        print("  %-10s %s" % (status, name))
EOF
