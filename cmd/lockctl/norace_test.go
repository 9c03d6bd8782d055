//go:build unix && !race

package main

var raceFlags []string
