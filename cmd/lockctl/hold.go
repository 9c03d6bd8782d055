//go:build unix

package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	"github.com/etcdsync/etcdsync"
	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/sys/unix"
)

// held is what every etcdsync primitive tells about its current hold.
type held interface {
	Key() string
	Rev() int64
	Done() <-chan struct{}
	Err() error
	Check() error
}

// hold is one kind of hold on a name: a Mutex, a read or write hold of an
// RWMutex, permits of a Semaphore, or an Election's leadership.
type hold struct {
	held
	what    string // "lock", "read lock", ..., for messages
	take    func(ctx context.Context) error
	try     func(ctx context.Context) error // nil: the kind has none
	release func(ctx context.Context) error
	// label writes v as the held keys' value, guarded by the hold (one
	// RPC); nil where the value means something (a Semaphore's permits, a
	// leader's value).
	label func(ctx context.Context, v string) error
	// keys returns the held keys, in name order, where there are several
	// (a MultiLock); else it is nil.
	keys func() []string
}

// labelOf returns a label function for the primitive that holds through d
// and key (see hold.label).
func labelOf(d interface {
	Do(context.Context, ...clientv3.Op) (*clientv3.TxnResponse, error)
	Key() string
}) func(ctx context.Context, v string) error {
	return func(ctx context.Context, v string) error {
		_, err := d.Do(ctx, clientv3.OpPut(d.Key(), v, clientv3.WithIgnoreLease()))
		return err
	}
}

// mutexHold is a Mutex on name (key NAME/<lease-hex>). It does not touch etcd.
func mutexHold(s *etcdsync.Session, name string) hold {
	m := etcdsync.NewMutex(s, name)
	return hold{held: m, what: "lock", take: m.Lock, try: m.TryLock, release: m.Unlock, label: labelOf(m)}
}

// multiHold is a lock on every one of names (a MultiLock). Key and Rev are
// the first name's. It does not touch etcd.
func multiHold(s *etcdsync.Session, names []string) hold {
	ml := etcdsync.NewMultiLock(s, names...)
	return hold{
		held: multiHeld{ml, names[0]},
		what: "locks",
		take: ml.Lock, try: ml.TryLock, release: ml.Unlock,
		label: func(ctx context.Context, v string) error {
			ops := make([]clientv3.Op, len(names))
			for i, name := range names {
				ops[i] = clientv3.OpPut(ml.Key(name), v, clientv3.WithIgnoreLease())
			}
			_, err := ml.Do(ctx, ops...)
			return err
		},
		keys: func() []string {
			keys := make([]string, len(names))
			for i, name := range names {
				keys[i] = ml.Key(name)
			}
			return keys
		},
	}
}

// multiHeld is a MultiLock as a held: Key and Rev are those of first.
type multiHeld struct {
	*etcdsync.MultiLock
	first string
}

func (m multiHeld) Key() string { return m.MultiLock.Key(m.first) }
func (m multiHeld) Rev() int64  { return m.MultiLock.Rev(m.first) }

// readHold is a read hold of an RWMutex on name. It does not touch etcd.
func readHold(s *etcdsync.Session, name string) hold {
	rw := etcdsync.NewRWMutex(s, name)
	return hold{held: rw, what: "read lock", take: rw.RLock, try: rw.TryRLock, release: rw.RUnlock, label: labelOf(rw)}
}

// writeHold is the write hold of an RWMutex on name. It does not touch etcd.
func writeHold(s *etcdsync.Session, name string) hold {
	rw := etcdsync.NewRWMutex(s, name)
	return hold{held: rw, what: "write lock", take: rw.Lock, try: rw.TryLock, release: rw.Unlock, label: labelOf(rw)}
}

// semaphoreHold is permits of a Semaphore of capacity on name. It does not
// touch etcd.
func semaphoreHold(s *etcdsync.Session, name string, capacity, permits int64) hold {
	sm := etcdsync.NewSemaphore(s, name, capacity)
	return hold{
		held:    sm,
		what:    fmt.Sprintf("semaphore permits (%d of %d)", permits, capacity),
		take:    func(ctx context.Context) error { return sm.Acquire(ctx, permits) },
		try:     func(ctx context.Context) error { return sm.TryAcquire(ctx, permits) },
		release: sm.Release,
	}
}

// electionHold is leadership of the election on name with value; its
// release is a handover (the next candidate leads at once). It does not
// touch etcd.
func electionHold(s *etcdsync.Session, name, value string) hold {
	e := etcdsync.NewElection(s, name)
	return hold{
		held:    e,
		what:    "leadership",
		take:    func(ctx context.Context) error { return e.Campaign(ctx, value) },
		try:     func(ctx context.Context) error { return e.TryCampaign(ctx, value) },
		release: e.Handover,
	}
}

// signalError is the cause of a wait that a signal to lockctl ended.
type signalError struct{ sig syscall.Signal }

func (e signalError) Error() string { return "interrupted by " + unix.SignalName(e.sig) }

// errTimeout is the cause of a wait that --timeout ended.
var errTimeout = errors.New("--timeout passed")

// acquire takes h on name. It blocks until the hold is taken, the wait ends
// (timeout, when positive, passed: exit 124; a signal arrived on sigs: exit
// 128+signal), or taking fails (exit 1; with try, a held lock is exit 75).
// On error it holds nothing: the library leaves no key behind a failed or
// cancelled take, and a hold taken as a signal arrived is released here.
// The goroutine it starts ends before it returns.
func acquire(h hold, name string, try bool, timeout time.Duration, sigs <-chan os.Signal) error {
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	if timeout > 0 {
		var stop context.CancelFunc
		ctx, stop = context.WithTimeoutCause(ctx, timeout, errTimeout)
		defer stop()
	}
	stop := watchSignals(sigs, func(sig syscall.Signal) { cancel(signalError{sig: sig}) })
	var err error
	if try {
		err = h.try(ctx)
	} else {
		err = h.take(ctx)
	}
	stop()
	cause := context.Cause(ctx)
	var sig signalError
	switch {
	case errors.As(cause, &sig) && err == nil: // taken as the signal came
		rctx, rcancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer rcancel()
		if rerr := h.release(rctx); rerr != nil && !errors.Is(rerr, etcdsync.ErrLockReleased) {
			return fail(exitSignal+int(sig.sig), fmt.Errorf("%s while taking the %s on %s; release: %w", sig, h.what, name, rerr))
		}
		return fail(exitSignal+int(sig.sig), fmt.Errorf("%s while taking the %s on %s", sig, h.what, name))
	case err == nil:
		return nil
	case errors.As(cause, &sig):
		return fail(exitSignal+int(sig.sig), fmt.Errorf("%s while waiting for the %s on %s", sig, h.what, name))
	case errors.Is(cause, errTimeout):
		return fail(exitTimeout, fmt.Errorf("--timeout %v passed while waiting for the %s on %s", timeout, h.what, name))
	case try && errors.Is(err, etcdsync.ErrLocked):
		return fail(exitHeld, fmt.Errorf("%s on %s: %w", h.what, name, errHeld))
	}
	return fail(exitFailure, fmt.Errorf("take the %s on %s: %w", h.what, name, err))
}
