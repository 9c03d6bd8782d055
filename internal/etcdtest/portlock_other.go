//go:build !unix

package etcdtest

// Where there are no fcntl locks (Windows, Plan 9, wasm), ports are
// reserved against this process's own tests only (givenPorts): a port
// another process binds meanwhile makes the member's start fail with
// EADDRINUSE, and StartCluster starts again on other ports.

// lockPort would lock port against the other processes; here it reports
// true and locks nothing.
func lockPort(port int) (bool, error) { return true, nil }

// unlockPort would end lockPort's lock of port; here it does nothing.
func unlockPort(port int) error { return nil }
