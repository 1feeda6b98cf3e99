What the lab's host runs, from `inspect --json` (the per-host document), and a host pattern that
matches nothing (exit 5, never a run on fewer hosts than meant):

  $ fleetctl inspect all --json | python3 -c '
  > import json, sys
  > for h in json.load(sys.stdin)["hosts"]:
  >     s = h["facts"]["sglang"]
  >     print(h["host"], h["status"], "sglang", s["version"], s["install"])
  >     for srv in h["facts"]["servers"]:
  >         print("  server :%s tp=%s gpus %s" % (srv["port"], srv["tp_size"], srv["gpu_ids"]))
  >     print("  need_sort origins:", len(h["need_sort_origins"]))'
  lab-01 ok sglang 0.5.23 wheel
    server :30000 tp=1 gpus ['0']
    need_sort origins: 6
  $ fleetctl inspect nosuchhost
  error: 'nosuchhost' in host pattern 'nosuchhost' matches no host in /var/lib/fleetctl-lab/*/hosts.yaml; groups: all, lab, sglang_0_5_23 (glob)
  [5]
