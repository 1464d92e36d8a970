#!/usr/bin/env bash
# A full disk, end to end, on a real small tmpfs: `llmaas serve` with its data directory there; two
# contexts are made and called; the file system is filled to the last byte; a call then answers
# 507 `disk_full`; DELETE of a context still works (it frees its chunk files first); the filler goes
# and the other context answers again, with no restart and its conversation intact.
#
# Needs root (mount -t tmpfs), curl, and the project's environment (`make venv`). Run from anywhere:
#   sudo deploy/scripts/diskfull.sh
# Environment: SIZE (tmpfs size, default 32m), PORT (HTTP, default 8765), DASHBOARD_PORT (default
# 8266), PY (default .venv/bin/python of this checkout). Everything it mounts or starts it stops.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
SIZE=${SIZE:-32m}
PORT=${PORT:-8765}
DASHBOARD_PORT=${DASHBOARD_PORT:-8266}
URL=http://127.0.0.1:$PORT

[ "$(id -u)" = 0 ] || { echo "diskfull.sh: needs root to mount a tmpfs" >&2; exit 2; }
[ -x "$PY" ] || { echo "diskfull.sh: no Python at $PY (run make venv, or set PY)" >&2; exit 2; }

MNT=$(mktemp -d /tmp/llmaas-diskfull.XXXXXX)
DATA=$MNT/data
LOG=$(mktemp /tmp/llmaas-diskfull-server.XXXXXX.log)
BODY=$(mktemp)
SERVER=""

cleanup() {
    if [ -n "$SERVER" ] && kill -0 "$SERVER" 2>/dev/null; then
        kill -INT "$SERVER"  # llmaas serve shuts Serve and Ray down on SIGINT
        for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
    fi
    mountpoint -q "$MNT" && umount "$MNT"
    rmdir "$MNT"
    rm -f "$BODY"
    echo "server log: $LOG"
}
trap cleanup EXIT

mount -t tmpfs -o "size=$SIZE,mode=0700" tmpfs "$MNT"
echo "== a $SIZE tmpfs at $MNT; data directory $DATA"

# Pool of one byte and the swap policy: every call's chunks are written to files after it.
(cd "$ROOT" && exec "$PY" -m deploy.cli serve --data-dir "$DATA" --port "$PORT" \
    --dashboard-port "$DASHBOARD_PORT" --policy swap --kv-budget 1) >"$LOG" 2>&1 &
SERVER=$!
echo "== starting llmaas serve (pid $SERVER) ..."
for _ in $(seq 300); do
    curl -sf "$URL/readyz" >/dev/null 2>&1 && break
    kill -0 "$SERVER" 2>/dev/null || { echo "the server stopped; see $LOG" >&2; exit 1; }
    sleep 1
done
curl -sf "$URL/readyz" >/dev/null || { echo "the server did not get ready; see $LOG" >&2; exit 1; }

json() { "$PY" -c "import json, sys; print(json.load(sys.stdin)$1)"; }
# request METHOD PATH [BODY]: prints the HTTP status, then the body
request() {
    curl -s -o "$BODY" -w '%{http_code}' -X "$1" -H "Authorization: Bearer $TOKEN" \
        -H 'Content-Type: application/json' ${3:+-d "$3"} "$URL$2"
    echo; cat "$BODY"; echo
}

ADMIN=${LLMAAS_ADMIN_TOKEN:-$(cat "$DATA/admin_token")}
TOKEN=$(curl -sf -H "Authorization: Bearer $ADMIN" -H 'Content-Type: application/json' \
    -d '{"name": "diskfull"}' "$URL/v1/apps" | json '["token"]')
A=$(request POST /v1/contexts '{"system_prompt": "You are terse."}' | tail -n 1 | json '["id"]')
B=$(request POST /v1/contexts '{"system_prompt": "You are terse."}' | tail -n 1 | json '["id"]')
echo "== contexts $A (to delete) and $B (to keep), one call each"
request POST "/v1/contexts/$A/calls" '{"prompt": "Name a fruit.", "max_tokens": 8}'
request POST "/v1/contexts/$B/calls" '{"prompt": "Name a colour.", "max_tokens": 8}'
sleep 2  # the write-back after each reply
KEPT=$(request GET "/v1/contexts/$B" | tail -n 1)
df -h "$MNT" | tail -n 1

echo "== filling the file system"
dd if=/dev/zero of="$MNT/filler" bs=64k status=none 2>/dev/null || true
df -h "$MNT" | tail -n 1

echo "== a call on the full disk: expect 507 disk_full"
request POST "/v1/contexts/$B/calls" '{"prompt": "And another one?", "max_tokens": 8}'
echo "== a new context on the full disk"
request POST /v1/contexts '{"system_prompt": "You are terse."}'

echo "== DELETE $A on the full disk: expect 200 (its chunk files go first)"
request DELETE "/v1/contexts/$A"
df -h "$MNT" | tail -n 1

echo "== space comes back (the filler goes); no restart"
rm -f "$MNT/filler"
df -h "$MNT" | tail -n 1
echo "== $B is as it was before the disk filled up:"
NOW=$(request GET "/v1/contexts/$B" | tail -n 1)
if [ "$(echo "$NOW" | json '["turns"]')" = "$(echo "$KEPT" | json '["turns"]')" ]; then
    echo "turns unchanged"
else
    echo "turns CHANGED: before $KEPT, now $NOW" >&2; exit 1
fi
echo "== a call on $B: expect 200"
request POST "/v1/contexts/$B/calls" '{"prompt": "And another one?", "max_tokens": 8}'
