#!/bin/bash
# Several soak walks at once, each on a lab of its own, summed into one result file (issue 54).
# Run as root from the repository root:
#   bash bench/soak_walks.sh MINUTES OPS OUT SEED:LAB_ID [SEED:LAB_ID...]
# Each walk stops starting operations after MINUTES (or OPS operations); its figures go to
# OUT.SEED.txt/.json and its step log to OUT.SEED.log; OUT gets the sum (bench/soak.py --sum).
# FAULT_P, if set, is each walk's --fault-p (the chance that an operation gets a fault).
set -u
minutes=$1 ops=$2 out=$3
shift 3
jsons=()
for sl in "$@"; do
    seed=${sl%%:*} lab=${sl##*:}
    PYTHONPATH=agent nice -n 10 python3 bench/soak.py --lab-id "$lab" --seed "$seed" --ops "$ops" \
        --minutes "$minutes" ${FAULT_P:+--fault-p "$FAULT_P"} --out "$out.$seed.txt" > "$out.$seed.log" 2>&1 &
    jsons+=("$out.$seed.json")
done
wait
PYTHONPATH=agent python3 bench/soak.py --sum "$out" "${jsons[@]}"
cat "$out"
