//go:build unix && race

package main

// raceFlags build the binary under test with the race detector when the
// tests run with it, so that lockctl's own goroutines are checked too.
var raceFlags = []string{"-race"}

// slowdown stretches the tests' bounds on how soon lockctl ends: built with
// the race detector, lockctl and its guard start and end several times
// slower.
const slowdown = 2
