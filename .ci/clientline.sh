#!/usr/bin/env bash
# The test suite with another etcd client line: in a scratch copy of this
# checkout (the committed files are never touched), every module that runs
# tests gets etcd's modules (go.etcd.io/etcd/{api,client/pkg,client/v3,
# server,pkg,etcdctl,...}) pinned at VERSION (e.g. v3.5.35, v3.6.16), its
# indirect requirements recomputed from that pin (`go mod tidy`), and then
# `go test -count=1 ./...` runs in each, without the workspace. The embedded
# members are then etcd's server of that line too (server and client are one
# release). A consumer's go.mod picks the client line under Go's minimal
# version selection, so the library must work with each.
#
#   .ci/clientline.sh v3.5.35
#   .ci/clientline.sh v3.6.16 -run TestCompat   # extra arguments go to go test
#   CLIENTLINE_DIR=/tmp/cl35 .ci/clientline.sh v3.5.35 -run '^$'   # keep the copy
set -euo pipefail
version=${1:?usage: .ci/clientline.sh CLIENT-VERSION [go test flags]}
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
# CLIENTLINE_DIR=DIR keeps the copy in DIR (empty or new), to look into a failure.
if [ -n "${CLIENTLINE_DIR:-}" ]; then
  mkdir -p "$CLIENTLINE_DIR"
  dir=$(cd "$CLIENTLINE_DIR" && pwd)
else
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' EXIT
fi

# The checkout as it is (tracked files and new ones not ignored), without .git.
(cd "$repo" && git ls-files -z -c -o --exclude-standard) | (cd "$repo" && tar --null -T - -cf -) | tar -xf - -C "$dir"
rm -f "$dir/go.work" "$dir/go.work.sum"
export GOWORK=off

# Dependencies first: each module's tidy reads the go.mod of the ones it
# replaces with a local directory. cmd/lockctl and the examples are programs
# (CI runs them with the workspace's 3.7 line).
modules=(. internal/etcdtest etcdsynctest tests)
for m in "${modules[@]}"; do
  (
    cd "$dir/$m"
    # Pin every etcd module the module requires (directly, or indirectly as
    # etcdctl, a tool) at VERSION, and drop the other indirect requirements:
    # tidy below recomputes them, else the 3.7 line's own dependencies would
    # stay at its versions.
    go mod edit -fmt
    edits=$(awk -v v="$version" '
      /^require \(/ { block = 1; next }
      block && /^\)/ { block = 0; next }
      block || /^require / {
        sub(/^require /, "")
        if ($1 ~ /^go\.etcd\.io\/etcd\//) print "-require=" $1 "@" v
        else if ($0 ~ /\/\/ indirect/) print "-droprequire=" $1
      }' go.mod)
    # shellcheck disable=SC2086 # one flag a word
    go mod edit $edits
  )
done
for m in "${modules[@]}"; do
  (cd "$dir/$m" && go mod tidy)
done
for m in "${modules[@]}"; do
  got=$(cd "$dir/$m" && go list -m -f '{{.Version}}' go.etcd.io/etcd/client/v3)
  [ "$got" = "$version" ] || { echo "$m: client $got, not $version" >&2; exit 1; }
done
server=$(cd "$dir/tests" && go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)
echo "client line $version (embedded server $server): go test in ${modules[*]}"

status=0
for m in "${modules[@]}"; do
  start=$SECONDS
  (cd "$dir/$m" && go test -count=1 "$@" ./...) || status=1
  echo "client $version: $m: $((SECONDS - start)) s"
done
exit $status
