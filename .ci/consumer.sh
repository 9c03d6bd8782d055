#!/usr/bin/env bash
# A consumer's build of the library: a module that pins etcd's client at the
# given version (v3.5.35, v3.6.16, ...) and imports etcdsync (this checkout)
# keeps that client version, gets no etcd server in its module graph, and
# builds. Prints the module counts with and without etcdsync.
set -euo pipefail
version=${1:?usage: .ci/consumer.sh CLIENT-VERSION}
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir"
export GOWORK=off GOFLAGS=-mod=mod
cat > go.mod <<MOD
module example.com/consumer

go 1.26.0

require go.etcd.io/etcd/client/v3 $version
MOD
cat > main.go <<'GO'
package main

import (
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

func main() { _, _ = concurrency.NewSession(&clientv3.Client{}) }
GO
go mod tidy > /dev/null 2>&1
before=$(go list -m all | wc -l)
cat > main.go <<'GO'
package main

import (
	"github.com/etcdsync/etcdsync"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

func main() {
	_, _ = concurrency.NewSession(&clientv3.Client{})
	_, _ = etcdsync.NewSession(&clientv3.Client{})
}
GO
go mod edit -require github.com/etcdsync/etcdsync@v0.0.0-00010101000000-000000000000 -replace github.com/etcdsync/etcdsync="$repo"
go mod tidy > /dev/null 2>&1
go build ./...
got=$(go list -m -f '{{.Version}}' go.etcd.io/etcd/client/v3)
after=$(go list -m all | wc -l)
echo "consumer pinned at client $version: client $got with etcdsync; modules $before without, $after with"
[ "$got" = "$version" ] || { echo "etcdsync raised the consumer's etcd client from $version to $got"; exit 1; }
mods=$(go list -m all) # whole, not piped: grep -q would close the pipe early (pipefail)
if grep -q '^go.etcd.io/etcd/server/v3 ' <<< "$mods"; then
  echo "etcd's server is in the consumer's module graph:"; go mod why -m go.etcd.io/etcd/server/v3; exit 1
fi
