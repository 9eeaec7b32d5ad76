#!/usr/bin/env bash
# Optional, deeper package test under a REAL systemd (PID 1 on CI machines usually is not):
# debootstrap a throwaway Debian 12, install the .deb, boot it with systemd-nspawn and check
# both units with their full hardening, the IA credentials (deliver only), and one upload.
#
#   sudo packaging/nspawn-boot-test.sh build/package/canner_*.deb     # ~1-2 min, needs root,
#   # network (deb.debian.org) and: apt-get install debootstrap systemd-container
#
# Not called by ci-package-test.sh. Prints PASS/FAIL lines; exits non-zero on failure.
set -euo pipefail
[ "$(id -u)" -eq 0 ] || exec sudo "$0" "$@"
[ $# -eq 1 ] && [ -f "$1" ] || { echo "usage: $0 canner_VERSION_ARCH.deb" >&2; exit 2; }
DEB=$(readlink -f "$1")
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
FAILS=0
pass() { printf 'PASS: %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*"; FAILS=$((FAILS + 1)); }

ROOT=$(mktemp -d /var/tmp/canner-nspawn.XXXXXX)
chmod 755 "$ROOT"   # mktemp makes it 0700: service users could not even chdir to /
NSPID=""
cleanup() {
  local rc=$?
  if [ -n "$NSPID" ]; then kill "$NSPID" 2>/dev/null || true; wait "$NSPID" 2>/dev/null || true; fi
  rm -rf "$ROOT"
  if [ "$rc" -eq 0 ] && [ "$FAILS" -eq 0 ]; then echo "PASS: canner nspawn boot test"
  else echo "FAIL: canner nspawn boot test ($FAILS failed checks, exit $rc)"; [ "$rc" -ne 0 ] || rc=1; fi
  exit "$rc"
}
trap cleanup EXIT

debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus,python3,adduser,curl \
  bookworm "$ROOT" "$MIRROR" >/dev/null
cp "$DEB" "$ROOT/root/canner.deb"
chroot "$ROOT" dpkg -i /root/canner.deb >/dev/null 2>&1
pass "dpkg -i $(basename "$DEB") in a fresh bookworm root"
printf '[s3]\naccess = TESTKEY\nsecret = TESTSECRET\n' > "$ROOT/etc/canner/ia.ini"
chmod 600 "$ROOT/etc/canner/ia.ini"
sed -i -e 's/^min_free_bytes = .*/min_free_bytes = 1048576/' \
    -e 's|^issuer = .*|issuer = "https://canner.nspawn.test"|' "$ROOT/etc/canner/canner.toml"
# probes: run inside each unit's sandbox, as its user, before the daemon starts
for role in receiver deliver; do
  mkdir -p "$ROOT/etc/systemd/system/canner-$role.service.d"
  cat > "$ROOT/etc/systemd/system/canner-$role.service.d/probe.conf" <<EOF
[Service]
ExecStartPre=-/bin/sh -c 'if cat /etc/canner/ia.ini >/dev/null 2>&1; then echo "PROBE $role user=\$(id -un) ia.ini=readable"; else echo "PROBE $role user=\$(id -un) ia.ini=unreadable"; fi; touch /opt/venvs/canner/x 2>/dev/null && echo "PROBE $role venv=writable" || echo "PROBE $role venv=read-only"'
EOF
done

# cgroup-v1 host without a system bus: legacy hierarchy, no machined registration, keep our cgroup
SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=0 systemd-nspawn -D "$ROOT" -b --private-network \
  --register=no --keep-unit --console=passive >/dev/null 2>&1 &
NSPID=$!
LEADER=""
for _ in $(seq 60); do LEADER=$(pgrep -P "$NSPID" -x systemd || true); [ -n "$LEADER" ] && break; sleep 1; done
[ -n "$LEADER" ] || { fail "systemd booted in the container"; exit 1; }
in_ct() { nsenter -t "$LEADER" -a "$@"; }
state=""
for _ in $(seq 60); do
  state=$(in_ct systemctl is-system-running 2>/dev/null || true)
  case "$state" in running|degraded) break ;; esac; sleep 1
done
echo "container system state: $state"
sleep 3

for u in canner-receiver canner-deliver; do
  s=$(in_ct systemctl is-active "$u" 2>/dev/null || true)
  if [ "$s" = active ]; then pass "$u is active under systemd"
  else fail "$u is '$s'"; in_ct journalctl -u "$u" --no-pager -o cat | grep -v PROBE | tail -n 8 | sed 's/^/    /'; fi
done
probes=$(in_ct journalctl -u canner-receiver -u canner-deliver --no-pager -o cat | grep '^PROBE' || true)
grep -q 'PROBE receiver user=canner ia.ini=unreadable' <<<"$probes" && pass "receiver (as canner) cannot read /etc/canner/ia.ini" || fail "receiver and ia.ini: $probes"
grep -q 'PROBE deliver user=canner ia.ini=readable' <<<"$probes" && pass "deliver (as canner) reads its credential copy at /etc/canner/ia.ini" || fail "deliver and ia.ini: $probes"
grep -q 'PROBE receiver.*venv=read-only' <<<"$probes" && pass "ProtectSystem=strict: /opt/venvs/canner is read-only to the receiver" || fail "receiver venv: $probes"

# one upload through the hardened receiver
if out=$(in_ct /bin/bash -c '
  set -e
  f=/root/a.bin; head -c 100000 /dev/urandom > $f
  sum=$(/opt/venvs/canner/bin/python -c "import blake3,sys; print(blake3.blake3(open(sys.argv[1],\"rb\").read()).hexdigest())" $f)
  b64() { printf %s "$1" | base64 -w0; }
  curl -fsS --retry 15 --retry-connrefused --retry-delay 1 -o /dev/null http://127.0.0.1:8080/healthz
  loc=$(curl -fsSi -X POST http://127.0.0.1:8080/files/ -H "Tus-Resumable: 1.0.0" -H "Upload-Length: 100000" \
        -H "Upload-Metadata: project $(b64 example),checksum $(b64 blake3:$sum)" | tr -d "\r" | sed -n "s/^Location: //p")
  curl -fsS -o /dev/null -X PATCH "$loc" -H "Tus-Resumable: 1.0.0" -H "Upload-Offset: 0" \
       -H "Content-Type: application/offset+octet-stream" --data-binary @$f
  curl -fsS "http://127.0.0.1:8080/api/v1/receipts/${loc##*/}"' 2>&1); then
  pass "upload through the systemd-run receiver: $out"
else
  fail "upload through the systemd-run receiver: $out"
fi
in_ct systemctl stop canner-receiver
r=$(in_ct systemctl show -p Result --value canner-receiver)
[ "$r" = success ] && pass "systemctl stop canner-receiver: Result=success" || fail "stop result: $r"
in_ct systemctl poweroff >/dev/null 2>&1 || true
[ "$FAILS" -eq 0 ]
