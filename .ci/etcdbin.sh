#!/usr/bin/env bash
# Builds etcd's server at VERSION (e.g. v3.5.35) from etcd's own module into
# DIR and prints the binary's path, for the compatibility matrix's rows of
# that line (compat_test.go) and the examples. etcd's server module cannot be
# `go install`ed (its go.mod has replace directives), so this builds it from a
# throwaway module that requires go.etcd.io/etcd/server/v3@VERSION and whose
# main calls etcdmain.Main(os.Args) (the same signature in 3.5, 3.6 and 3.7).
# To be called by .ci/run, e.g.:
#
#   export ETCDSYNC_ETCD35=$(.ci/etcdbin.sh v3.5.35 "$tmp/etcd35")
#   go test -run 'TestCompat/etcd35' -count=1 ./tests
set -euo pipefail
version=${1:?usage: .ci/etcdbin.sh VERSION DIR}
dir=${2:?usage: .ci/etcdbin.sh VERSION DIR}
mkdir -p "$dir/src"
dir=$(cd "$dir" && pwd)
cd "$dir/src"
export GOWORK=off GOFLAGS="${GOFLAGS:-} -mod=mod"
[ -f go.mod ] || go mod init etcdbin > /dev/null 2>&1
cat > main.go <<'GO'
// Command etcd is etcd's server, built from its module (see .ci/etcdbin.sh).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
go get "go.etcd.io/etcd/server/v3@$version" > /dev/null 2>&1 || go get "go.etcd.io/etcd/server/v3@$version"
go mod tidy > /dev/null 2>&1 || go mod tidy
go build -o "$dir/etcd" .
bin=$dir/etcd
want=${version#v}
got=$("$bin" --version) # whole, not piped: grep -q would close the pipe early (pipefail)
grep -qxF "etcd Version: $want" <<< "$got" || { echo "not etcd $want: $got" >&2; exit 1; }
echo "$bin"
