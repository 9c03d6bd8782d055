//go:build unix && race

package main

// raceFlags build the binary under test with the race detector when the
// tests run with it, so that lockctl's own goroutines are checked too.
var raceFlags = []string{"-race"}
