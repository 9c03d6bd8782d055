#!/usr/bin/env bash
# Fetches etcd 3.4 (Debian's etcd-server package) into a directory and prints
# the binary's path, for the compatibility matrix's etcd34 rows
# (compat_test.go). Nothing is installed. To be called by .ci/run, e.g.:
#
#   export ETCDSYNC_ETCD34=$(.ci/etcd34.sh "$tmp/etcd34")
#   go test -run 'TestCompat/etcd34' -count=1 ./tests
#
# Without ETCDSYNC_ETCD34 those rows are skipped with a message saying so.
set -euo pipefail
dir=${1:?usage: .ci/etcd34.sh DIR}
mkdir -p "$dir"
cd "$dir"
apt-get update -qq > /dev/null || true # the lists may be there already
apt-get download etcd-server > /dev/null
dpkg -x etcd-server_*.deb root
bin=$PWD/root/usr/bin/etcd
got=$("$bin" --version) # whole, not piped: grep -q would close the pipe early (pipefail)
grep -q '^etcd Version: 3\.4\.' <<< "$got" || { echo "not etcd 3.4: $got" >&2; exit 1; }
echo "$bin"
