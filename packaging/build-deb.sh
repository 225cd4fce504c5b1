#!/usr/bin/env bash
# Builds the Debian package (target/debian/otherix_*.deb, or under
# $CARGO_TARGET_DIR) with cargo-deb, installing cargo-deb first if it is
# missing, then checks with `dpkg -c` that the package holds the binary, the
# systemd units, the sysusers file and the default configs.
#
#   packaging/build-deb.sh            # release build, as shipped
#
# Needs dpkg-deb (package dpkg). A release build of the workspace from
# scratch is the slow part; see "Running as a service" in docs/architecture.md.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo deb --version >/dev/null 2>&1; then
  echo "build-deb: installing cargo-deb"
  cargo install cargo-deb --locked
fi

# Stripped: the release profile keeps line tables (for backtraces in
# development), which would make the package four times larger.
out=$(cargo deb -p otherix --locked --strip "$@" | tail -1)
if [ ! -f "$out" ]; then
  echo "build-deb: cargo deb printed no package path (got: $out)" >&2
  exit 1
fi
echo "build-deb: built $out"

listing=$(dpkg -c "$out")
missing=0
for path in ./usr/bin/otherix \
            ./usr/lib/systemd/system/otherix-server.service \
            ./usr/lib/systemd/system/otherix-agent.service \
            ./usr/lib/sysusers.d/otherix.conf \
            ./etc/otherix/server.toml \
            ./etc/otherix/agent.toml; do
  # dpkg -c prints `ls -l`-like lines; the path is the last field.
  if ! awk '{print $NF}' <<<"$listing" | grep -qx -- "$path"; then
    echo "build-deb: $path is not in the package" >&2
    missing=1
  fi
done
if [ "$missing" -ne 0 ]; then
  echo "$listing" >&2
  exit 1
fi
conffiles=$(dpkg-deb -f "$out" Package >/dev/null && dpkg-deb --ctrl-tarfile "$out" | tar -xO ./conffiles)
for f in /etc/otherix/server.toml /etc/otherix/agent.toml; do
  grep -qx "$f" <<<"$conffiles" || { echo "build-deb: $f is not a conffile" >&2; exit 1; }
done
echo "build-deb: dpkg -c lists the binary, both units, the sysusers file and the configs (conffiles)"
