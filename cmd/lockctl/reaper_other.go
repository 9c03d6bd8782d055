//go:build unix && !linux

package main

// becomeSubreaper does nothing where the system has no child subreapers:
// lockctl then waits only for its own children in the command's group (the
// others still get its signals).
func becomeSubreaper() error { return nil }
