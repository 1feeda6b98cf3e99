A kernel deploy in check mode: which backend the host gets and why, and whether it would build
(nothing is built, uploaded or activated):

  $ fleetctl deploy kernel verify_attention all --check --json | python3 -c '
  > import json, sys
  > for h in json.load(sys.stdin)["hosts"]:
  >     print(h["host"], h["status"], "backend", h["backend"], "(%s)" % h["why"], "would build:", h["would_build"])'
  lab-01 changed backend cpu (no GPU answers nvidia-smi) would build: True
