#!/usr/bin/env bash
# Mutation testing (mutmut 3, in the `test` extra) of the modules that carry fleetctl's promises:
# inventory patterns, plan and diff, the validation gate, the change probe, the call-site walk.
# Each mutant runs against the unit tests that cover the mutated function (the selection in
# pyproject.toml [tool.mutmut]; never the lab tests, never the tests that scan whole releases).
# Not part of CI: it takes minutes to tens of minutes.
#
# Usage: scripts/mutation.sh [MODULE ...]   MODULE: patterns plan gate change safefs callsites (default: these)
# Env:   MUTATION_JOBS   mutants tested in parallel (default 2)
#        MUTATION_ONLY   space-separated mutant names or name patterns (fnmatch): test only these
#                        (a rerun of survivors, or one part of a module, each in its own stage dir)
# Prints the score per module (killed / all mutants) and every survivor; tests/mutation-survivors.md
# says why each remaining survivor is equivalent. Exits 0 whatever the score.
#
# mutmut names mutants after the module path relative to the project and strips only a `src.`
# prefix, so with the package under agent/ the test-to-function map it records (fleetctl.x) never
# matches its mutants (agent.fleetctl.x) and every mutant would be "no tests". The run therefore
# happens in .mutation/, a copy of the checkout with agent/ as src/.
set -euo pipefail
set -f  # the mutant name patterns below are globs for mutmut, not for the shell
cd "$(dirname "$0")/.."
ROOT=$PWD
modules=("$@")
[ ${#modules[@]} -gt 0 ] || modules=(patterns plan gate change safefs callsites)
# one copy per module set, and per MUTATION_ONLY selection (runs of different subsets coexist)
STAGE=$ROOT/.mutation/$(IFS=-; echo "${modules[*]}")${MUTATION_ONLY:+-only-$(md5sum <<< "$MUTATION_ONLY" | cut -c1-8)}
JOBS=${MUTATION_JOBS:-2}
command -v mutmut >/dev/null || { echo "mutmut is missing: pip install -e '.[test]'" >&2; exit 2; }

rm -rf "$STAGE"
mkdir -p "$STAGE"
cp -a agent "$STAGE/src"
cp -a tests playbooks hosts.yaml "$STAGE/"
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
python3 - "$ROOT/pyproject.toml" "$STAGE/pyproject.toml" "${modules[@]}" <<'EOF'
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
if wanted and set(wanted) <= {"change", "safefs"}:
    # only tests/unit/test_change_probe.py reaches the change probe (a full run's stats say so): a
    # change-only run need not collect, time and clean-run the other modules' tests
    tail = re.sub(r'pytest_add_cli_args_test_selection = \[.*?\]',
                  'pytest_add_cli_args_test_selection = ["tests/unit/test_change_probe.py"]', tail, flags=re.S)
if not wanted or {"change", "safefs"} & set(wanted):
    # mutmut picks a mutant's tests by the functions each test reached in this process; these
    # tests reach the change probe only in a child process (they SIGKILL it), so they run for
    # every mutant instead
    killers = ["tests/unit/test_change_probe.py::test_recover_after_kill_mid_apply",
               "tests/unit/test_change_probe.py::test_recover_after_kill_inside_the_undo"]
    tail = re.sub(r'(pytest_add_cli_args = \[)', lambda m: m.group(1) + "".join('"%s", ' % k for k in killers), tail)
open(dst, "w").write(head + "[tool.mutmut]" + tail)
EOF

# What is mutated in each module: the functions that carry its promises. (These five files hold
# ~3400 mutants; on a shared two-core machine a mutant takes seconds, so a whole-file run takes
# hours.) Space-separated mutmut name patterns (fnmatch):
#   patterns   host patterns: inventory/patterns.py (select/_split/_match; not the YAML parser)
#   plan       the edit and the diff the operator approves: _edit_file, the comment position
#              (tasks/work.py: Source.line_end_after), the pre-image check (checked_source), one_line
#   gate       the smoke gate (engine/gates/smoke.py), all of it
#   change     apply and what it undoes on failure (_undo_written, _restore), and recover
#   safefs     the writes that cannot be redirected: atomic_write, open_dir, confine
#   callsites  the AST walk and what it records: _walk, _scan_source, _call_site, _origin
declare -A SCOPE=(
    [patterns]='fleetctl.inventory.patterns.*'
    [plan]='fleetctl.engine.playbooks.plan.x__edit_file__* fleetctl.engine.playbooks.tasks.work.xǁSourceǁline_end_after__*
            fleetctl.engine.playbooks.tasks.work.x_checked_source__* fleetctl.engine.playbooks.tasks.work.x_one_line__*'
    [gate]='fleetctl.engine.gates.smoke.*'
    [change]='fleetctl.probes.change.actions.x_apply__* fleetctl.probes.change.actions.x__undo_written__*
              fleetctl.probes.change.actions.x__restore__* fleetctl.probes.change.actions.x_recover__*'
    [safefs]='fleetctl.probes.safefs.x_atomic_write__* fleetctl.probes.safefs.x_open_dir__*
              fleetctl.probes.safefs.x_confine__*'
    [callsites]='fleetctl.probes.facts.callsites.x__walk__* fleetctl.probes.facts.callsites.x__scan_source__*
                 fleetctl.probes.facts.callsites.x__call_site__* fleetctl.probes.facts.callsites.x__origin__*'
)
patterns=()
for m in "${modules[@]}"; do
    for p in ${SCOPE[$m]}; do patterns+=("$p"); done  # split on blanks only (set -f above)
done
# MUTATION_ONLY="name ...": test just these mutants (say, last run's survivors after new tests)
[ -z "${MUTATION_ONLY:-}" ] || read -r -a patterns <<< "$MUTATION_ONLY"

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
    print("\nnot killed (`mutmut show NAME` in the run's .mutation/ folder shows the change):")
    for module, name, status in survivors:
        print("  %-10s %s" % (status, name))
EOF
