#!/usr/bin/env bash
# CI job for the Debian package (issue 4): build canner_*.deb, install it onto THIS machine,
# check what it installed, run the installed receiver by hand, upload one file, fetch its
# receipt, purge the package. Prints one PASS/FAIL line per check; exits non-zero on failure.
#
#   sudo packaging/ci-package-test.sh                # CI entry point (needs root and PyPI access)
#   sudo packaging/ci-package-test.sh --clean-first  # first purge a canner left installed by an
#                                                    # earlier (failed) run, INCLUDING /var/lib/canner
#
# Environment: CANNER_SKIP_APT=1 skips `apt-get update/install` of the build dependencies.
# Build products end up in build/package/ (git-ignored). Takes ~1-3 min on 2 cores.
# PID 1 need not be systemd: units are checked offline with `systemd-analyze verify`.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=$REPO/build/package
VENV=/opt/venvs/canner
DATA=/var/lib/canner
T0=$(date +%s)
FAILS=0
WORK=""
RECEIVER_PID=""

now() { date +%s; }
say() { printf '==> %s\n' "$*"; }
pass() { printf 'PASS: %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*"; FAILS=$((FAILS + 1)); }
# die: a failure after which nothing else can be checked
die() { printf 'FAIL: %s\n' "$*"; FAILS=$((FAILS + 1)); exit 1; }
check() { # check "description" command...
  local what=$1; shift
  if "$@" >/dev/null 2>&1; then pass "$what"; else fail "$what"; fi
}
phase_start() { PHASE=$1; PHASE_T=$(now); say "$1"; }
phase_end() { say "$PHASE: $(( $(now) - PHASE_T )) s"; }

cleanup() {
  local rc=$?
  if [ -n "$RECEIVER_PID" ] && kill -0 "$RECEIVER_PID" 2>/dev/null; then
    kill -TERM "$RECEIVER_PID" 2>/dev/null || true
    sleep 2
    kill -KILL "$RECEIVER_PID" 2>/dev/null || true
  fi
  if [ -n "$WORK" ]; then rm -rf "$WORK"; fi
  local total=$(( $(now) - T0 ))
  if [ "$rc" -eq 0 ] && [ "$FAILS" -eq 0 ]; then
    printf 'PASS: canner package test (%d s)\n' "$total"
  else
    printf 'FAIL: canner package test: %d check(s) failed, exit %d (%d s)\n' "$FAILS" "$rc" "$total"
    [ "$rc" -ne 0 ] || rc=1
  fi
  exit "$rc"
}
trap cleanup EXIT

if [ "$(id -u)" -ne 0 ]; then
  exec sudo --preserve-env=CANNER_SKIP_APT "$0" "$@"
fi
export DEBIAN_FRONTEND=noninteractive
CLEAN_FIRST=no
for arg in "$@"; do
  case "$arg" in
    --clean-first) CLEAN_FIRST=yes ;;
    *) echo "usage: $0 [--clean-first]" >&2; exit 2 ;;
  esac
done

# ---------------------------------------------------------------------------------------------
phase_start "preconditions"
if dpkg-query -W -f='${Status}' canner 2>/dev/null | grep -q 'installed\|config-files'; then
  if [ "$CLEAN_FIRST" = yes ]; then
    CANNER_PURGE_DATA=yes apt-get purge -y -q canner >/dev/null
  else
    die "canner is already installed here; run with --clean-first (purges it and $DATA) or: apt-get purge canner"
  fi
fi
if [ -e "$DATA" ]; then
  if [ "$CLEAN_FIRST" = yes ]; then
    rm -rf "$DATA"
  else
    die "$DATA exists (left by an earlier purge, by design); run with --clean-first or remove it by hand"
  fi
fi
pass "no canner package and no $DATA before the test"
USER_EXISTED=no
getent passwd canner >/dev/null && USER_EXISTED=yes
phase_end

# ---------------------------------------------------------------------------------------------
phase_start "build dependencies (apt-get)"
if [ "${CANNER_SKIP_APT:-0}" != 1 ]; then
  apt-get update -q >/dev/null
  # build deps of debian/control + what this test uses (curl, systemd-analyze, setpriv)
  apt-get install -y -q --no-install-recommends \
    build-essential debhelper dh-virtualenv python3 python3-dev python3-venv \
    curl adduser systemd util-linux ca-certificates >/dev/null
fi
(cd "$REPO" && dpkg-checkbuilddeps) || die "build dependencies of debian/control are not installed"
pass "build dependencies installed"
phase_end

# ---------------------------------------------------------------------------------------------
phase_start "build (dpkg-buildpackage -us -uc -b)"
VERSION=$(cd "$REPO" && dpkg-parsechangelog -S Version)
ARCH=$(dpkg --print-architecture)
PARENT=$(dirname "$REPO")
rm -f "$PARENT/canner_${VERSION}_${ARCH}".{deb,buildinfo,changes}
mkdir -p "$OUT"
rm -f "$OUT"/canner_*
# Outside any venv, clean PATH: the package's venv must get Debian's /usr/bin/python3, not a
# pyenv/venv python3 that comes first on the caller's PATH (debian/rules pins it too).
if ! (cd "$REPO" && env -i HOME="${HOME:-/root}" PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
      dpkg-buildpackage -us -uc -b) >"$OUT/build.log" 2>&1; then
  tail -n 60 "$OUT/build.log"
  grep -q 'which is not installed\|has requirement' "$OUT/build.log" \
    && echo "    hint: requirements.lock is stale; regenerate it with packaging/update-lock.sh"
  die "dpkg-buildpackage failed (full log: $OUT/build.log)"
fi
mv "$PARENT/canner_${VERSION}_${ARCH}".{deb,buildinfo,changes} "$OUT/"
DEB=$OUT/canner_${VERSION}_${ARCH}.deb
pass "built $(basename "$DEB") ($(du -h "$DEB" | cut -f1))"
(cd "$REPO" && env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin debian/rules clean >/dev/null 2>&1) || true
check ".deb does not ship a twisted dropin.cache" \
  bash -c "! dpkg-deb -c '$DEB' | grep -q dropin.cache"
check ".deb conffiles are exactly canner.toml and the rsyncd templates" \
  bash -c "[ \"\$(dpkg-deb -I '$DEB' conffiles | sort | tr '\n' ' ')\" = '/etc/canner/canner.toml /etc/canner/rsyncd/module.conf /etc/canner/rsyncd/rsyncd.conf ' ]"
check ".deb depends on python3.11 (the venv's interpreter)" \
  bash -c "dpkg-deb -f '$DEB' Depends | grep -q 'python3\.11'"
phase_end

# ---------------------------------------------------------------------------------------------
phase_start "install (apt-get install ./$(basename "$DEB"))"
if ! (cd "$OUT" && apt-get install -y -q "./$(basename "$DEB")") >"$OUT/install.log" 2>&1; then
  tail -n 40 "$OUT/install.log"
  die "apt-get install ./$(basename "$DEB") failed"
fi
pass "apt-get install ./$(basename "$DEB")"
check "dpkg reports canner $VERSION installed" \
  bash -c "[ \"\$(dpkg-query -W -f='\${Status} \${Version}' canner)\" = 'install ok installed $VERSION' ]"
phase_end

# ---------------------------------------------------------------------------------------------
phase_start "installed files, user, units"
if getent passwd canner >/dev/null; then
  IFS=: read -r _ _ C_UID C_GID _ C_HOME C_SHELL < <(getent passwd canner)
  [ "$USER_EXISTED" = yes ] && note=" (it existed before the install)" || note=""
  if [ "$C_UID" -lt 1000 ] && [ "$C_HOME" = "$DATA" ] && [ "$C_SHELL" = /usr/sbin/nologin ]; then
    pass "system user canner: uid $C_UID, home $C_HOME, shell $C_SHELL$note"
  else
    fail "system user canner: uid $C_UID home $C_HOME shell $C_SHELL (want uid<1000, $DATA, nologin)"
  fi
  check "group canner is the user's primary group" \
    bash -c "[ \"\$(getent group canner | cut -d: -f3)\" = '$C_GID' ]"
else
  fail "system user canner exists"
fi
check "/etc/canner/canner.toml is the example config" cmp /etc/canner/canner.toml "$REPO/conf/canner.example.toml"
check "/etc/canner/canner.toml is a conffile of the installed package" \
  bash -c "dpkg-query -W -f='\${Conffiles}\n' canner | grep -q '^ /etc/canner/canner.toml '"
perm=$(stat -c '%a %U %G' "$DATA" 2>/dev/null || echo missing)
if [ "$perm" = "750 canner canner" ]; then pass "$DATA is 0750 canner:canner"; else fail "$DATA is '$perm', want '750 canner canner'"; fi
UNITDIR=""
for d in /lib/systemd/system /usr/lib/systemd/system; do
  [ -f "$d/canner-receiver.service" ] && { UNITDIR=$d; break; }
done
if [ -n "$UNITDIR" ] && [ -f "$UNITDIR/canner-deliver.service" ]; then
  pass "unit files $UNITDIR/canner-{receiver,deliver}.service"
else
  die "unit files canner-receiver.service and canner-deliver.service are installed"
fi
check "canner-rsyncd.service is installed, not enabled (the rsync intake is opt-in)" \
  bash -c "[ -f $UNITDIR/canner-rsyncd.service ] && [ ! -e /etc/systemd/system/multi-user.target.wants/canner-rsyncd.service ]"
check "the rsyncd templates are conffiles in /etc/canner/rsyncd" \
  bash -c "cmp /etc/canner/rsyncd/module.conf '$REPO/conf/rsyncd/module.conf' && dpkg-query -W -f='\${Conffiles}\n' canner | grep -q '^ /etc/canner/rsyncd/module.conf '"
EX=/usr/share/doc/canner/examples
if [ -f $EX/haproxy/canner.cfg ] && [ -f $EX/nginx/canner.conf ] && [ -f $EX/prometheus/canner-alerts.yml ] \
  && [ -f $EX/grafana/canner.json ]; then
  pass "examples in $EX: haproxy, nginx, prometheus, grafana"
else
  fail "examples (haproxy, nginx, prometheus, grafana) are not all in $EX"
fi
RECV_UNIT=$UNITDIR/canner-receiver.service
DLVR_UNIT=$UNITDIR/canner-deliver.service
for u in "$RECV_UNIT" "$DLVR_UNIT"; do
  n=$(basename "$u" .service); role=${n#canner-}
  check "$n: ExecStart runs twistd $n as canner with the JSON logger" \
    grep -qx "ExecStart=$VENV/bin/twistd --nodaemon --pidfile= --logger=canner.logs.json_observer $n --config /etc/canner/canner.toml" "$u"
  check "$n: User=canner, Restart=on-failure" \
    bash -c "grep -qx User=canner '$u' && grep -qx Restart=on-failure '$u'"
  check "$n: hardened (ProtectSystem=strict, NoNewPrivileges, PrivateTmp, ReadWritePaths=$DATA)" \
    bash -c "grep -qx ProtectSystem=strict '$u' && grep -qx NoNewPrivileges=yes '$u' && grep -qx PrivateTmp=yes '$u' && grep -qx ReadWritePaths=$DATA '$u'"
  check "$n: RuntimeDirectory=canner/$role" grep -qx "RuntimeDirectory=canner/$role" "$u"
  check "$n: enabled for multi-user.target (deb-systemd-helper)" \
    test -L "/etc/systemd/system/multi-user.target.wants/$n.service"
done
check "canner-deliver: IA credentials via LoadCredential=ia.ini:/etc/canner/ia.ini" \
  grep -qx 'LoadCredential=ia.ini:/etc/canner/ia.ini' "$DLVR_UNIT"
check "canner-receiver: no credentials, ia.ini inaccessible" \
  bash -c "! grep -qi -e '^LoadCredential' -e '^SetCredential' -e 'IA_CONFIG_FILE' '$RECV_UNIT' && grep -qx 'InaccessiblePaths=-/etc/canner/ia.ini' '$RECV_UNIT'"
check "venv interpreter is Debian's /usr/bin/python3.11" \
  bash -c "[ \"\$(readlink -f $VENV/bin/python)\" = /usr/bin/python3.11 ] && grep -q '^home = /usr/bin' $VENV/pyvenv.cfg"
check "postinst built the twisted plugin cache" \
  bash -c "ls $VENV/lib/python3*/site-packages/twisted/plugins/dropin.cache"
check "twistd (run as canner) lists canner-receiver and canner-deliver" \
  bash -c "cd / && out=\$(setpriv --reuid=canner --regid=canner --init-groups env -i PATH=/usr/bin:/bin $VENV/bin/twistd --help) && grep -q canner-receiver <<<\"\$out\" && grep -q canner-deliver <<<\"\$out\""
check "/usr/bin/canner --help" bash -c "cd / && env -i PATH=/usr/bin:/bin /usr/bin/canner --help"
check "installed .pyc files are hash-checked (valid despite dpkg's mtime clamping)" \
  $VENV/bin/python -c "
import glob, sys
pycs = glob.glob('$VENV/lib/python3*/site-packages/canner/__pycache__/*.pyc')
sys.exit(not pycs or any(int.from_bytes(open(p, 'rb').read()[4:8], 'little') != 3 for p in pycs))"
phase_end

# ---------------------------------------------------------------------------------------------
phase_start "systemd-analyze (offline)"
# verify exits 0 on "Unknown key"/"Failed to parse ... ignoring", so gate on empty output.
for u in "$RECV_UNIT" "$DLVR_UNIT"; do
  n=$(basename "$u")
  out=$(systemd-analyze verify --man=no "$u" 2>&1) && rc=0 || rc=$?
  if [ "$rc" -eq 0 ] && [ -z "$out" ]; then
    pass "systemd-analyze verify $n: no warnings"
  else
    fail "systemd-analyze verify $n (exit $rc):"; printf '%s\n' "$out" | sed 's/^/    /'
  fi
  if out=$(systemd-analyze security --offline=yes --threshold=20 "$u" 2>&1); then
    pass "systemd-analyze security $n: $(printf '%s\n' "$out" | grep -o 'Overall exposure level.*' | head -n1)"
  else
    fail "systemd-analyze security $n above exposure 2.0:"; printf '%s\n' "$out" | tail -n 5 | sed 's/^/    /'
  fi
done
phase_end

# ---------------------------------------------------------------------------------------------
phase_start "run the installed receiver by hand, upload one file, fetch its receipt"
WORK=$(mktemp -d /tmp/canner-pkgtest.XXXXXX)
chmod 0755 "$WORK"
PORT=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
CONF=$WORK/canner.toml
# the shipped config's placeholder issuer: the daemon refuses it in one line
REFUSED=$(cd / && setpriv --reuid=canner --regid=canner --init-groups env -i PATH=/usr/bin:/bin \
  $VENV/bin/twistd --nodaemon --pidfile= canner-receiver --config /etc/canner/canner.toml 2>&1) \
  && rc=0 || rc=$?
if [ "$rc" -eq 1 ] && [ "$(printf '%s\n' "$REFUSED" | wc -l)" -eq 1 ] \
   && grep -q "config key 'issuer': is still the placeholder" <<<"$REFUSED"; then
  pass "the receiver refuses the shipped placeholder issuer in one line: $REFUSED"
else
  fail "the receiver refuses the placeholder issuer in one line (exit $rc): $REFUSED"
fi
for u in "$RECV_UNIT" "$DLVR_UNIT"; do
  check "$(basename "$u"): Type=notify with WatchdogSec" \
    bash -c "grep -qx Type=notify '$u' && grep -qx NotifyAccess=main '$u' && grep -q '^WatchdogSec=' '$u'"
done
sed -e "s|^listen = .*|listen = \"tcp:$PORT:interface=127.0.0.1\"|" \
    -e 's|^issuer = .*|issuer = "https://canner.pkgtest"|' \
    -e 's|^min_free_bytes = .*|min_free_bytes = 1048576|' /etc/canner/canner.toml > "$CONF"
chmod 0644 "$CONF"
grep -q "^listen = \"tcp:$PORT:" "$CONF" && grep -q '^min_free_bytes = 1048576$' "$CONF" \
  && grep -q '^issuer = "https://canner.pkgtest"$' "$CONF" \
  || die "could not derive a test config from /etc/canner/canner.toml"
grep -q "^data_dir = \"$DATA\"" "$CONF" || fail "the shipped config's data_dir is $DATA"
# the installed unit's ExecStart, with the test config instead of /etc/canner/canner.toml
EXEC=$(sed -n 's/^ExecStart=//p' "$RECV_UNIT")
EXEC=${EXEC//\/etc\/canner\/canner.toml/$CONF}
read -r -a CMD <<<"$EXEC"
# what systemd would provide: RuntimeDirectory=canner/receiver (0750), cwd /, UMask=0027, clean env
install -d -m 0755 /run/canner
install -d -o canner -g canner -m 0750 /run/canner/receiver
say "as canner: ${CMD[*]}"
(cd / && umask 0027 && exec setpriv --reuid=canner --regid=canner --init-groups \
   env -i PATH=/usr/bin:/bin LANG=C.UTF-8 "${CMD[@]}") >"$WORK/receiver.log" 2>&1 &
RECEIVER_PID=$!
BASE=http://127.0.0.1:$PORT
up=no
for _ in $(seq 60); do
  if curl -fsS -o "$WORK/healthz.json" "$BASE/healthz" 2>/dev/null; then up=yes; break; fi
  kill -0 "$RECEIVER_PID" 2>/dev/null || break
  sleep 0.5
done
if [ "$up" != yes ]; then
  sed 's/^/    /' "$WORK/receiver.log" | tail -n 40
  die "receiver answers GET /healthz on 127.0.0.1:$PORT within 30 s"
fi
pass "receiver (pid $RECEIVER_PID, user $(ps -o user= -p "$RECEIVER_PID")) answers GET /healthz: $(cat "$WORK/healthz.json")"

# one small file: 64 KiB of random bytes
FILE=$WORK/artifact.bin
head -c 65536 /dev/urandom > "$FILE"
SIZE=$(stat -c %s "$FILE")
SUM=$($VENV/bin/python -c 'import blake3, sys; print(blake3.blake3(open(sys.argv[1], "rb").read()).hexdigest())' "$FILE")
b64() { printf %s "$1" | base64 -w0; }
META="project $(b64 example),checksum $(b64 "blake3:$SUM"),filename $(b64 artifact.bin)"
code=$(curl -sS -o /dev/null -D "$WORK/post.headers" -w '%{http_code}' -X POST "$BASE/files/" \
  -H 'Tus-Resumable: 1.0.0' -H "Upload-Length: $SIZE" -H "Upload-Metadata: $META") || code=000
LOC=$(tr -d '\r' < "$WORK/post.headers" | sed -n 's/^[Ll]ocation: //p')
if [ "$code" = 201 ] && [ -n "$LOC" ]; then pass "POST /files/ (Upload-Length $SIZE): 201, Location $LOC"
else cat "$WORK/post.headers" 2>/dev/null | sed 's/^/    /'; die "POST /files/ answered $code, Location '$LOC'"; fi
case "$LOC" in  # resolved against the creation URL $BASE/files/, as clients do
  http*) ;;
  /*) LOC=$BASE$LOC ;;
  *) LOC=$BASE/files/${LOC#./} ;;
esac
ID=${LOC##*/}
code=$(curl -sS -o "$WORK/patch.body" -D "$WORK/patch.headers" -w '%{http_code}' -X PATCH "$LOC" \
  -H 'Tus-Resumable: 1.0.0' -H 'Upload-Offset: 0' \
  -H 'Content-Type: application/offset+octet-stream' --data-binary @"$FILE") || code=000
HDR=$(tr -d '\r' < "$WORK/patch.headers" | sed -n 's/^[Aa]rtifact-[Rr]eceipt: //p')
if [ "$code" = 204 ] && [ -n "$HDR" ]; then pass "PATCH $SIZE bytes: 204 with an Artifact-Receipt header"
else sed 's/^/    /' "$WORK/patch.headers" "$WORK/patch.body" 2>/dev/null; die "PATCH answered $code, Artifact-Receipt '$HDR'"; fi
code=$(curl -sS -o "$WORK/receipt.json" -w '%{http_code}' "$BASE/api/v1/receipts/$ID") || code=000
[ "$code" = 200 ] && pass "GET /api/v1/receipts/$ID: 200" || fail "GET /api/v1/receipts/$ID answered $code"
if msg=$(/usr/bin/python3 - "$HDR" "$WORK/receipt.json" "$ID" "$SUM" "$SIZE" <<'EOF'
import base64, json, sys
hdr, path, oid, digest, size = sys.argv[1:]
from_header = base64.urlsafe_b64decode(hdr + "=" * (-len(hdr) % 4))
body = open(path, "rb").read()
if from_header != body:
    sys.exit(f"header {from_header!r} != body {body!r}")
r = json.loads(body)
want = {"object_id": oid, "checksum": "blake3:" + digest, "size_bytes": int(size), "id": "receipt:" + oid}
bad = {k: r.get(k) for k, v in want.items() if r.get(k) != v}
if bad:
    sys.exit(f"receipt fields {bad} differ from {want}")
print(body.decode())
EOF
); then
  pass "receipt JSON == Artifact-Receipt header, checksum/size/object_id match: $msg"
else
  fail "receipt matches the Artifact-Receipt header: $msg"
fi
check "receipt stored under $DATA as canner" \
  bash -c "[ \"\$(stat -c %U $DATA/receipts/$ID.json)\" = canner ]"
# under systemd the JSON observer's lines go to journald; here they are in the log file
check "receiver logs are JSON lines (--logger=canner.logs.json_observer)" \
  /usr/bin/python3 -c "
import json, sys
lines = [l for l in open('$WORK/receiver.log') if l.strip()]
assert lines
for l in lines: json.loads(l.lstrip('\x1e'))"

kill -TERM "$RECEIVER_PID"
stopped=no
for _ in $(seq 60); do kill -0 "$RECEIVER_PID" 2>/dev/null || { stopped=yes; break; }; sleep 0.5; done
if [ "$stopped" = yes ]; then
  wait "$RECEIVER_PID" && rc=0 || rc=$?
  RECEIVER_PID=""
  # twistd stops the reactor, then re-raises SIGTERM on itself (status 143), which systemd
  # counts as a clean stop (SuccessExitStatus includes SIGTERM)
  if { [ "$rc" -eq 0 ] || [ "$rc" -eq 143 ]; } && grep -q 'Main loop terminated' "$WORK/receiver.log"; then
    pass "receiver shut down cleanly on SIGTERM (status $rc, 'Main loop terminated' logged)"
  else
    tail -n 20 "$WORK/receiver.log" | sed 's/^/    /'
    fail "receiver shutdown after SIGTERM: status $rc"
  fi
else
  fail "receiver did not stop within 30 s of SIGTERM"
fi
rm -rf /run/canner/receiver
rmdir /run/canner 2>/dev/null || true
phase_end

# ---------------------------------------------------------------------------------------------
phase_start "purge (apt-get purge canner)"
if apt-get purge -y -q canner >"$OUT/purge.log" 2>&1; then pass "apt-get purge canner"
else tail -n 30 "$OUT/purge.log"; die "apt-get purge canner failed"; fi
check "package gone" bash -c "! dpkg-query -W -f='\${Status}' canner 2>/dev/null | grep -q installed"
check "$VENV removed" test ! -e "$VENV"
check "/etc/canner/canner.toml removed" test ! -e /etc/canner/canner.toml
check "unit files removed" bash -c "! ls /lib/systemd/system/canner-*.service /usr/lib/systemd/system/canner-*.service"
check "$DATA left alone (still there, 0750 canner:canner)" \
  bash -c "[ \"\$(stat -c '%a %U %G' $DATA)\" = '750 canner canner' ]"
check "the uploaded receipt survived the purge" cmp "$DATA/receipts/$ID.json" "$WORK/receipt.json"
check "system user canner kept (Debian convention)" getent passwd canner
grep -q 'kept the data directory' "$OUT/purge.log" && pass "purge said how to delete the data" \
  || fail "purge did not tell the operator that $DATA was kept"
phase_end

# ---------------------------------------------------------------------------------------------
phase_start "reinstall over the kept data, then purge with the opt-in flag"
if (cd "$OUT" && apt-get install -y -q "./$(basename "$DEB")") >"$OUT/install2.log" 2>&1; then
  pass "reinstall onto the existing user and $DATA"
else
  tail -n 30 "$OUT/install2.log"; die "reinstall failed"
fi
check "reinstall kept the receipt and $DATA 0750 canner:canner" \
  bash -c "cmp -s $DATA/receipts/$ID.json $WORK/receipt.json && [ \"\$(stat -c '%a %U %G' $DATA)\" = '750 canner canner' ]"
touch "$DATA/.purge-with-package"
if apt-get purge -y -q canner >"$OUT/purge2.log" 2>&1; then pass "apt-get purge canner (with $DATA/.purge-with-package)"
else tail -n 30 "$OUT/purge2.log"; die "second purge failed"; fi
check "$DATA removed when asked (.purge-with-package)" test ! -e "$DATA"
phase_end

[ "$FAILS" -eq 0 ]
