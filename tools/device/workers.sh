# Sourced by call4/call6 after PYTHONPATH, ORPHEUS_GATEWAY_WORKER_SOCKETS=/tmp/gw-sockets and mps_start: the
# production layout, `serve --workers $WORKERS` with its own `vllm serve` on 127.0.0.1:$PORT, the random
# Orpheus-shaped model of call 1, its log in $SERVE_LOG ($OUT/$NAME/serve.log).
# With KEEP=1 the workers outlive the call (setsid; the device tool keeps such a process until the machine goes
# back): their log is /tmp/serve.log, their pid /tmp/serve.pid, and the next call's workers_start finds them
# running and reuses them, so one start (~150 s) serves several short calls and a lost call loses only its own part.
# env: WORKERS, PORT, SERVE_ARGS, TOKENS_PER_CHAR (6: the random-weight model never stops by itself), READY_TIMEOUT
#      (s, 300), SERVE_CPUS (a taskset list), GRAPHS (--no-snac-cuda-graphs after a failed check)
# workers_start: sets SERVE_PID, returns 0 once every worker answers /readyz. workers_stop: stops them all.
workers_running() { [ -f /tmp/serve.pid ] && kill -0 "$(cat /tmp/serve.pid)" 2>/dev/null; }
workers_start() {
  local pin=""; [ -n "$SERVE_CPUS" ] && pin="taskset -c $SERVE_CPUS"
  SERVE_LOG=$OUT/$NAME/serve.log; [ -n "$KEEP" ] && SERVE_LOG=/tmp/serve.log
  if [ -n "$KEEP" ] && workers_running; then
    SERVE_PID=$(cat /tmp/serve.pid); echo "workers kept from the last call (pid $SERVE_PID)"; return 0
  fi
  setsid $pin python3 -m gateway serve --workers $WORKERS --host 127.0.0.1 --port $PORT --model /tmp/orpheus-struct \
    --snac-model /tmp/orpheus-struct/snac --log-level warning --max-tokens-per-char ${TOKENS_PER_CHAR:-6} $GRAPHS \
    $SERVE_ARGS > $SERVE_LOG 2>&1 &
  SERVE_PID=$!; echo $SERVE_PID > /tmp/serve.pid
  python3 - $WORKERS ${READY_TIMEOUT:-300} $SERVE_LOG <<'PYEOF'
import asyncio, sys, time
import aiohttp
from gateway.cluster.addressing import socket_path

async def main(workers: int, timeout: float, log: str) -> None:
    deadline = time.monotonic() + timeout
    for index in range(workers):
        while True:
            if time.monotonic() > deadline:
                sys.exit(f"worker {index} not ready after {timeout} s")
            if "exited with" in open(log, errors="replace").read():
                sys.exit("a child exited during start-up (see serve.log)")
            try:
                connector = aiohttp.UnixConnector(path=str(socket_path("/tmp/gw-sockets", index)))
                async with aiohttp.ClientSession(connector=connector) as http, http.get("http://w/readyz") as r:
                    if r.status == 200:
                        break
            except (aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(1)

asyncio.run(main(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]))
PYEOF
}

workers_stop() {  # with KEEP=1 the workers stay up (a copy of their log goes to $OUT/$NAME/serve.log)
  if [ -n "$KEEP" ]; then cp $SERVE_LOG $OUT/$NAME/serve.log 2>/dev/null; return 0; fi
  rm -f /tmp/serve.pid
  # The supervisor stops its children (each in its own process group) before it exits: give it the time.
  kill -TERM -- -$SERVE_PID 2>/dev/null
  for _ in $(seq 30); do kill -0 $SERVE_PID 2>/dev/null || break; sleep 1; done
  kill -KILL -- -$SERVE_PID 2>/dev/null
}
