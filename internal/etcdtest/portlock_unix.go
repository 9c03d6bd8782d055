//go:build unix

package etcdtest

// The lock that keeps a port reserved by this process (givenPorts) from
// being taken by another process on the machine, such as another package's
// test binary that `go test` runs at the same time: a write lock on the
// port's byte of one file in the temporary directory. The kernel drops a
// process's locks when it exits, however it exits.

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"syscall"
)

// portLockFile opens, once, the file whose byte at offset port is locked by
// the process that reserves port; one per user, as /tmp is shared. It stays
// open until the process exits: closing any descriptor of the file would
// drop all of the process's locks on it.
var portLockFile = sync.OnceValues(func() (*os.File, error) {
	name := filepath.Join(os.TempDir(), fmt.Sprintf("etcdsync-test-ports-%d.lock", os.Getuid()))
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("port lock file: %w", err)
	}
	return f, nil
})

// lockPort locks port against the other processes, without waiting; it
// reports false when another process has it locked.
func lockPort(port int) (bool, error) {
	err := setPortLock(port, syscall.F_WRLCK)
	if errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EACCES) {
		return false, nil
	}
	return err == nil, err
}

// unlockPort ends lockPort's lock of port.
func unlockPort(port int) error {
	return setPortLock(port, syscall.F_UNLCK)
}

// setPortLock sets the lock of port's byte of the port lock file to typ
// (F_WRLCK or F_UNLCK), failing at once if another process holds it.
func setPortLock(port int, typ int16) error {
	f, err := portLockFile()
	if err != nil {
		return err
	}
	lk := syscall.Flock_t{Type: typ, Whence: io.SeekStart, Start: int64(port), Len: 1}
	if err := syscall.FcntlFlock(f.Fd(), syscall.F_SETLK, &lk); err != nil {
		return fmt.Errorf("lock byte %d of %s: %w", port, f.Name(), err)
	}
	return nil
}
