#!/bin/sh
# (Re)start the fleetctl SGLang STAND-IN server (not SGLang) in the background and return at once.
# The caller waits for GET /health == 200 itself.
#   PYTHON   interpreter to run server.py with (default /opt/sglang/venv/bin/python)
#   LAUNCHER words put before it, a launcher that stays the server's parent (e.g. "timeout 86400");
#            the pid file then holds the launcher's pid, which passes SIGTERM on to the server
#   extra arguments are passed to server.py and override the defaults below
#   (--host 127.0.0.1 --port 30000 --model-path fleetctl-standin/tiny --tp-size 1).
# The pid file, log (server.log) and behaviour file (behavior.json) live next to this script.
set -eu
DIR=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-/opt/sglang/venv/bin/python}
LAUNCHER=${LAUNCHER:-}
PIDFILE="$DIR/server.pid"
# running and not a zombie (an exited child nobody has reaped yet counts as gone)
alive() {
    s=$(sed -n 's/^.*) \(.\).*/\1/p' "/proc/$1/stat" 2>/dev/null) && [ -n "$s" ] && [ "$s" != Z ]
}

if [ -f "$PIDFILE" ]; then
    pid=$(cat "$PIDFILE")
    # only a process that is this stand-in (the pid may have been reused)
    if [ -n "$pid" ] && grep -aq "server.py" "/proc/$pid/cmdline" 2>/dev/null; then
        echo "fleetctl stand-in: stopping pid $pid" >>"$DIR/server.log"
        kill "$pid" 2>/dev/null || true
        i=0
        while alive "$pid"; do
            i=$((i + 1))
            if [ "$i" -eq 100 ]; then kill -9 "$pid" 2>/dev/null || true; fi
            if [ "$i" -gt 150 ]; then echo "fleetctl stand-in: pid $pid does not exit" >&2; exit 1; fi
            sleep 0.1
        done
    fi
    rm -f "$PIDFILE"
fi

echo "fleetctl stand-in: starting with $PYTHON" >>"$DIR/server.log"
# setsid does not fork here (a background job is not a process group leader), so $! is the server
# shellcheck disable=SC2086  # LAUNCHER is words on purpose
setsid nohup $LAUNCHER "$PYTHON" "$DIR/server.py" --host 127.0.0.1 --port 30000 \
    --model-path fleetctl-standin/tiny --tp-size 1 --behavior "$DIR/behavior.json" "$@" \
    >>"$DIR/server.log" 2>&1 </dev/null &
echo $! >"$PIDFILE"
