//go:build linux

package main

import "golang.org/x/sys/unix"

// becomeSubreaper makes lockctl the parent of every orphan among its
// descendants (PR_SET_CHILD_SUBREAPER), so that it can wait for, and reap,
// the whole process group of the command, also where PID 1 reaps nothing.
// It does not block.
func becomeSubreaper() error {
	return unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
}
