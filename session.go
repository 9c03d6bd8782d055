package etcdsync

// The session (type Session): the public face of a lease kept alive in the
// background. The lease, its keepalive and local deadline, and the keys its
// primitives use are the protocol's (internal/queue, type queue.Session).

import (
	"context"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// Session is a lease kept alive in the background. Every key a primitive
// writes is bound to the lease, so the keys vanish when the session ends.
//
// The session keeps a local deadline: the send time of the last keepalive
// the server acknowledged plus the TTL. The server cannot expire the lease
// before that instant plus the slack (WithSlack: by default the larger of 2s
// and a tenth of the TTL), so when keepalives stop getting through, Done
// closes before the server may hand the lock to someone else, even in a
// process that runs late by up to the slack.
type Session struct {
	q   *queue.Session // the lease, its keepalive, the keys its primitives use
	rep *report        // WithLogger, WithMetrics; nil: none
}

// NewSession grants a lease (or adopts one, see WithLease) and starts keeping
// it alive. It blocks for one round trip (two to adopt a lease with keys).
// That wait is bounded by the WithContext context, by the TTL, and by the
// client's DialTimeout (3 s when the client has none): when the servers do
// not answer within it, because the endpoints refuse connections or accept
// them and never answer (a stopped process, a firewall that drops packets),
// or while the cluster has no leader, NewSession gives up with an error
// wrapping context.DeadlineExceeded that
// names each endpoint and says which it did. A closed client is an error
// wrapping ErrInvalidArgument, at once. On error no lease is left behind
// that this call granted and still could revoke.
func NewSession(client *clientv3.Client, opts ...SessionOption) (*Session, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: nil client", ErrInvalidArgument)
	}
	if err := queue.ClosedClient(client); err != nil {
		return nil, err
	}
	o, err := resolve(client, opts)
	if err != nil {
		return nil, err
	}
	q, err := queue.Start(client, o)
	if err != nil {
		return nil, err
	}
	rep, _ := o.Rep.(*report)
	return &Session{q: q, rep: rep}, nil
}

// core returns the protocol's session, nil for a nil Session (which the
// primitives report as an error wrapping ErrInvalidArgument).
func (s *Session) core() *queue.Session {
	if s == nil {
		return nil
	}
	return s.q
}

// Client returns the etcd client the session uses.
func (s *Session) Client() *clientv3.Client { return s.q.Client() }

// Lease returns the session's lease ID.
func (s *Session) Lease() clientv3.LeaseID { return s.q.Lease() }

// TTL returns how long the session lives past the send time of its last
// acknowledged keepalive: the lease's granted TTL, less the slack and the
// lock delay (WithSlack, WithLockDelay), which the lease has beyond it.
func (s *Session) TTL() time.Duration { return s.q.TTL() }

// Slack returns how long the lease outlives the local deadline for a late
// holder (WithSlack; the lock delay comes on top of it).
func (s *Session) Slack() time.Duration { return s.q.Slack() }

// Ctx returns a context cancelled when the session ends; context.Cause tells
// why: an error wrapping ErrSessionClosed (Close, Orphan), ErrSessionExpired
// (lease gone, or lost contact past the local deadline), or the cause of the
// WithContext context.
func (s *Session) Ctx() context.Context { return s.q.Ctx() }

// Done returns a channel closed when the session ends (see Ctx). After lost
// contact the session's own keepalive loop closes it at the local deadline,
// before the server can free the keys while that loop runs within the
// slack. When a goroutine of the caller's that waits on it runs is not the
// library's to promise (a process short of CPU, a pause longer than the
// slack): fence what the lock protects (Rev, Do), see docs/time.md.
func (s *Session) Done() <-chan struct{} { return s.q.Done() }

// Err returns nil while the session lives, else why it ended (see Ctx).
// A session whose client was closed has ended, with a cause wrapping
// ErrSessionClosed and ErrInvalidArgument.
func (s *Session) Err() error { return s.q.Err() }

// Check is a health answer for a service that must not act without its
// session: nil while the session lives, else why not (as Err). It also
// answers ErrSessionExpired (with ErrLostContact) once the local deadline
// has passed, even before the keepalive loop has ended the session, so a
// late timer never makes it answer nil. It does not block and sends nothing.
func (s *Session) Check() error { return s.q.Check() }

// Orphan ends the session without revoking its lease: its keys stay until
// the lease expires on the server (for a hand-over to a process that adopts
// the lease with WithLease). It does not block on etcd; it is idempotent, and
// a Close after it changes nothing in etcd.
func (s *Session) Orphan() { s.q.Orphan() }

// Close ends the session and revokes its lease, which deletes every key the
// session holds, and ends the Runs under its holds (of every primitive,
// and Shards' fns) at the same moment: to stop them gracefully, end their
// contexts and wait for them first. After lost contact (also a Close past
// the local deadline before the session noticed), when their fns were told
// at the deadline, the revoke waits until those fns returned, at most the
// slack's rest (until the server could expire the lease anyway), so that a
// fn slow to stop never runs beside the next holder. It blocks for the
// revoke, bounded by the TTL, also after
// lost contact: each leader change re-arms every lease on the server, so
// the server's own expiry may come much later than the session's deadline,
// and the revoke is retried through leader changes. It also waits, within
// that bound, for the closing of the watch streams its waits left open when
// they ended mid-request. With the client closed it returns at once (the
// lease is left to expire). With WithLockDelay, a session that ended for
// lost contact is not revoked: its lease runs out the delay on the server.
// It is idempotent: later calls return the first call's result. After
// Orphan it changes nothing in etcd. A lease the server no longer has is
// not an error. For a shutdown that must not wait on etcd, use Orphan.
func (s *Session) Close() error { return s.q.Close() }

// Deadline returns the session's local deadline: the send time of the last
// acknowledged keepalive plus the TTL. The server cannot expire the lease
// before it.
func (s *Session) Deadline() time.Time { return s.q.Deadline() }

// DeadlineMoved returns a channel that is closed when the local deadline
// (see Deadline) next moves, after an acknowledged keepalive, or when the
// session ends; after the end the channel is closed already. It does not
// block. Take the channel before reading Deadline, so that no move is
// missed: a program that hands the deadline on (to a child process, a
// device, a worker with a hard stop) loops
//
//	for s.Err() == nil {
//		moved := s.DeadlineMoved()
//		handOn(s.Deadline())
//		<-moved
//	}
func (s *Session) DeadlineMoved() <-chan struct{} { return s.q.DeadlineMoved() }
