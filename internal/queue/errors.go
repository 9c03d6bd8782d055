package queue

// The errors of the protocol: the package etcdsync's sentinels (defined
// here, so that the protocol wraps them; its errors.go gives them their
// public names and doc comments), the errors only the protocol makes, and
// how an error is made to match a sentinel as well (Tag).

import (
	"errors"
	"fmt"
)

// The sentinel errors of the package etcdsync, which says what each means
// (its errors.go assigns these values to its own names, so that errors.Is
// matches either).
var (
	ErrLocked          = errors.New("etcdsync: locked")
	ErrSessionExpired  = errors.New("etcdsync: session expired")
	ErrLostContact     = errors.New("etcdsync: lost contact with etcd")
	ErrSessionClosed   = errors.New("etcdsync: session closed")
	ErrLockReleased    = errors.New("etcdsync: lock released")
	ErrNotHeld         = errors.New("etcdsync: not held")
	ErrInvalidName     = errors.New("etcdsync: invalid name")
	ErrInvalidArgument = errors.New("etcdsync: invalid argument")
)

var (
	// errClientClosed is returned, at once and with nothing sent, by a call
	// on a closed client; errClientClosedSession is the cause of a session
	// whose client was closed (it also matches ErrSessionClosed).
	errClientClosed        = fmt.Errorf("%w: client closed", ErrInvalidArgument)
	errClientClosedSession = Tag(fmt.Errorf("%w: client closed", ErrSessionClosed), ErrInvalidArgument)

	// errNoAnswer is why NewSession gave up: no answer to its first
	// request within the client's DialTimeout (see answerBound).
	errNoAnswer = errors.New("no answer from etcd")

	// ErrOwnKeyGone means a waiter's own key vanished.
	ErrOwnKeyGone = fmt.Errorf("%w: own key deleted while waiting", ErrSessionExpired)
)

// tagged is an error with err's text that also matches sentinel (errors.Is),
// so that a message says what failed and why without repeating a sentinel's
// text.
type tagged struct{ err, sentinel error }

func (t tagged) Error() string   { return t.err.Error() }
func (t tagged) Unwrap() []error { return []error{t.err, t.sentinel} }

// Tag returns err, also matching sentinel.
func Tag(err, sentinel error) error {
	if errors.Is(err, sentinel) {
		return err
	}
	return tagged{err: err, sentinel: sentinel}
}

// NotHeldBy is the error of a call that needs a hold on what that the value
// does not have: it wraps notHeld (ErrLockReleased, ErrNotHeld), and also
// ErrInvalidArgument when the session's client was closed.
func NotHeldBy(s *Session, notHeld error, what string) error {
	if ClosedClient(s.client) != nil {
		return Tag(fmt.Errorf("%w: %s is not held by this value: client closed", notHeld, what), ErrInvalidArgument)
	}
	return fmt.Errorf("%w: %s is not held by this value", notHeld, what)
}
