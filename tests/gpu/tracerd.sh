# Sourced by the scripts here, with BIN set to the binaries' directory: starts tracerd on a
# temporary socket and state directory ($STATE), stops it when the script exits; $CTL is
# tracerctl pointed at it.
STATE=$(mktemp -d)
"$BIN/tracerd" --socket "$STATE/s" --state-dir "$STATE/st" 2>"$STATE/log" &
DAEMON=$!
trap 'kill $DAEMON; wait $DAEMON 2>/dev/null || true' EXIT
while [ ! -S "$STATE/s" ]; do sleep 0.1; done
CTL="$BIN/tracerctl --socket $STATE/s"

# report_when_ended ID ARGS…: the session's report once it has ended (its target exited).
report_when_ended() {
  id=$1
  shift
  for _ in $(seq 50); do
    $CTL report "$id" "$@" 2>/dev/null && return 0
    sleep 0.2
  done
  $CTL report "$id" "$@"
}
