//go:build unix && !race

package main

var raceFlags []string

// slowdown stretches the tests' bounds on how soon lockctl ends.
const slowdown = 1
