The smoke decode, the gate every change passes: greedy tokens through the server's own
`/generate`, on the host itself (the lab's stand-in server decodes the same tokens every time):

  $ fleetctl validate all --repeat 1 --json | python3 -c '
  > import json, sys
  > for h in json.load(sys.stdin)["hosts"]:
  >     for s in h["servers"]:
  >         print(h["host"], h["status"], "%s:%s" % (s["host"], s["port"]), s["model_path"],
  >               "stand-in" if s["stand_in"] else "", len(s["output_ids"]), "tokens:", s["output_ids"][:4], "...")'
  lab-01 ok 127.0.0.1:30000 fleetctl-standin/tiny stand-in 16 tokens: [83, 50, 43, 254] ...
