//go:build long

package tests

// longRuns turns on the long fault and robustness runs: go test -tags long
// (.ci/run does).
const longRuns = true
