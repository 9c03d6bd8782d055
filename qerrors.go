package etcdsync

import (
	"errors"
	"fmt"
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

	// errOwnKeyGone means a waiter's own key vanished.
	ErrOwnKeyGone = fmt.Errorf("%w: own key deleted while waiting", ErrSessionExpired)
)

// tagged is an error with err's text that also matches sentinel (errors.Is),
// so that a message says what failed and why without repeating a sentinel's
// text.
type tagged struct{ err, sentinel error }

func (t tagged) Error() string   { return t.err.Error() }
func (t tagged) Unwrap() []error { return []error{t.err, t.sentinel} }

// tag returns err, also matching sentinel.
func Tag(err, sentinel error) error {
	if errors.Is(err, sentinel) {
		return err
	}
	return tagged{err: err, sentinel: sentinel}
}

// notHeldBy is the error of a call that needs a hold on what that the value
// does not have: it wraps notHeld (ErrLockReleased, ErrNotHeld), and also
// ErrInvalidArgument when the session's client was closed.
func NotHeldBy(s *Session, notHeld error, what string) error {
	if ClosedClient(s.client) != nil {
		return Tag(fmt.Errorf("%w: %s is not held by this value: client closed", notHeld, what), ErrInvalidArgument)
	}
	return fmt.Errorf("%w: %s is not held by this value", notHeld, what)
}
