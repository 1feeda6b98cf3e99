Every command that works on hosts is recorded on the control node (here in a history file of
this directory's own), and the fleet report is written from that record alone:

  $ export FLEETCTL_HISTORY=$PWD/history.sqlite
  $ fleetctl inspect all > /dev/null
  $ fleetctl apply defrag-tier0 all --check > /dev/null
  $ fleetctl history list --json | python3 -c '
  > import json, sys
  > for r in json.load(sys.stdin)["runs"]:
  >     print(" ".join(r["argv"]), "->", r["state"], "exit", r["exit_code"], [h["status"] for h in r["hosts"]])'
  fleetctl inspect all -> finished exit 0 ['ok']
  fleetctl apply defrag-tier0 all --check -> finished exit 0 ['changed']
  $ fleetctl report -o fleet.html
  report written: fleet.html (2 run(s), 1 host(s), from */history.sqlite) (glob)
  $ grep -c 'Content-Security-Policy' fleet.html
  1
