#!/usr/bin/env bash
# Runs the benchmarks three times, ours and etcd's concurrency package side by
# side, into docs/bench.txt, then redraws docs/handoff.svg and prints the
# tables for BENCHMARKS.md. Takes about 20 minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p docs
out=docs/bench.txt
{
  go test -run '^$' -bench 'LockUnlock|TryLockHeld|CampaignProclaimResign|Floor|Handoff|ElectionHandoff|Throughput64|RWMutexUncontended' -benchtime 100x -count 3 -timeout 60m ./tests
  go test -run '^$' -bench 'WaiterCost|EventsPerRelease' -benchtime 20x -count 3 -timeout 60m ./tests
  go test -run '^$' -bench 'Hold10k' -benchtime 1x -count 3 -timeout 60m ./tests
  go test -run '^$' -bench 'ClientAllocs' -benchtime 2000x -count 3 -timeout 60m ./tests
} | tee "$out"
go run ./tests/benchchart -svg docs/handoff.svg "$out"
