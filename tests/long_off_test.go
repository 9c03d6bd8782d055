//go:build !long

package tests

// longRuns is off: go test -tags long turns on the long fault and
// robustness runs (.ci/run does).
const longRuns = false
