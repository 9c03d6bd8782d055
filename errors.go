package etcdsync

// The sentinel errors, in one var block: the protocol's are defined in
// internal/queue (which wraps them) and named here, so that errors.Is
// matches either name.

import (
	"errors"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// Sentinel errors. Every error the package returns wraps one of these, or a
// context error, or an error from the etcd client; test with errors.Is.
var (
	// ErrLocked is returned by TryLock when the lock is held, by anyone,
	// including the value that calls TryLock; by Barrier.Hold when the
	// barrier is held; by DoubleBarrier.Enter when count parties are in
	// already, or a round is under way.
	ErrLocked = queue.ErrLocked
	// ErrSessionExpired means the session's lease is gone (expired, revoked,
	// or not kept alive within its TTL), or a waiter's own key vanished.
	ErrSessionExpired = queue.ErrSessionExpired
	// ErrLostContact is wrapped, beside ErrSessionExpired, by the cause of a
	// session that ended because no keepalive was acknowledged within the TTL
	// of the last one sent: the server may expire the lease from the slack
	// (WithSlack) after that on.
	ErrLostContact = queue.ErrLostContact
	// ErrSessionClosed is the cause of a session that was ended on purpose
	// (Close, Orphan, its WithContext context, its client closed); calls on
	// it return it, and not ErrSessionExpired.
	ErrSessionClosed = queue.ErrSessionClosed
	// ErrLockReleased is returned by Unlock when there is no hold to release
	// (and by Barrier.Release when there is no barrier to release). It is
	// also the cause of a hold that ended by Unlock or Resign.
	ErrLockReleased = queue.ErrLockReleased
	// ErrNotHeld is returned by a guarded operation (Do) when the hold it
	// guards is no longer current; it is also the cause of a hold whose key
	// was deleted by someone else.
	ErrNotHeld = queue.ErrNotHeld
	// ErrElectionNotLeader is returned by Proclaim when not leading.
	ErrElectionNotLeader = errors.New("etcdsync: not leader")
	// ErrElectionNoLeader is returned by Leader when there is no leader.
	ErrElectionNoLeader = errors.New("etcdsync: no leader")
	// ErrInvalidName is wrapped by every call given an empty name or one with
	// a NUL byte.
	ErrInvalidName = queue.ErrInvalidName
	// ErrInvalidArgument is wrapped by every call given another bad argument:
	// a nil client or session, a TTL below one second, conflicting options,
	// a closed client (by every call that takes it, or a session on it: at
	// once, with no RPC sent); and by a DoubleBarrier call out of turn
	// (Leave without Enter, Enter twice, two parties on one Session).
	ErrInvalidArgument = queue.ErrInvalidArgument
)
