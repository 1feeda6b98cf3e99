How each host would be reached, without connecting (what OpenSSH's `ssh -G` resolves, and the
known_hosts lines that apply):

  $ fleetctl hosts all --json | python3 -c '
  > import json, sys
  > for h in json.load(sys.stdin)["hosts"]:
  >     print(h["host"], h["connection"], "port", h["port"], "user", h["user"], "jump", h["jump"] or "direct",
  >           "pinned keys", len(h["known_hosts_lines"]))'
  lab-01 paramiko port 22 user root jump direct pinned keys 1
