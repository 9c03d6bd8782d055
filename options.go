package etcdsync

// The options of NewSession (type SessionOption): each With… states its
// default; their checks and defaults are queue.Options.Resolve.

import (
	"context"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// DefaultTTL is the session TTL used when WithTTL is not given.
const DefaultTTL = 60 * time.Second

// SessionOption configures NewSession. Options are made only by the With…
// functions of this package.
type SessionOption interface {
	apply(*sessionOptions)
}

// sessionOptions are the settings the options make (queue.Options).
type sessionOptions = queue.Options

type optionFunc func(*sessionOptions)

func (f optionFunc) apply(o *sessionOptions) { f(o) }

// WithTTL sets the session lease's time to live. The default is DefaultTTL
// (60s). The TTL is rounded up to whole seconds, as etcd counts leases in
// seconds; a TTL below one second makes NewSession return an error wrapping
// ErrInvalidArgument. It cannot be combined with WithLease.
func WithTTL(ttl time.Duration) SessionOption {
	return optionFunc(func(o *sessionOptions) { o.TTL, o.TTLSet = ttl, true })
}

// WithLease makes the session adopt an existing lease instead of granting a
// new one, so that a restarted process continues the holds it had (a Lock on
// a name whose key exists with this lease resumes that hold). The lease's
// granted TTL, less the slack and the lock delay (WithSlack, WithLockDelay),
// sets the keepalive pace; a lease with no more than those left is an error
// wrapping ErrSessionExpired. Adopting a lease that a live process
// still uses breaks mutual exclusion between the two: it is for restarts only.
// By default a new lease is granted.
func WithLease(id clientv3.LeaseID) SessionOption {
	return optionFunc(func(o *sessionOptions) { o.LeaseID = id })
}

// WithContext sets the context that bounds NewSession and the session's
// life: cancelling it ends the session (as in etcd). The default is the
// client's context. Either way NewSession gives up when no answer comes
// within the client's DialTimeout (3s when it has none) or the TTL,
// whichever is shorter.
func WithContext(ctx context.Context) SessionOption {
	return optionFunc(func(o *sessionOptions) { o.Ctx = ctx })
}

// WithLockDelay keeps a name from the next holder for d after this
// session lost its hold by losing contact (keepalives stopped getting
// through: the process frozen, killed or cut off), as Consul's lock-delay
// does: the lease is granted for the TTL plus the slack (WithSlack) plus d,
// while the session keeps its local deadline (Deadline, Done, the end of
// Run's context) by the TTL alone, so the server frees the session's keys no
// sooner than the slack and then d after the holder was told it lost them. A clean end hands over at once: Unlock, Resign and Close
// (which revokes the lease), but not a Close after the session ended for
// lost contact (the delay stands). d is rounded up to whole seconds; a negative d
// makes NewSession return an error wrapping ErrInvalidArgument. The default
// is 0: off, and then nothing is sent or kept for it.
//
// The delay lives in the lease of the holder that is lost. It cannot hold
// back a successor after a holder without it loses its lease (etcd's own
// client, etcdctl, a session without this option), nor after someone else
// deletes a held key or revokes the lease (the holder is told within a watch
// round trip, and the next holder takes over at once). With WithLease, the
// adopted lease must have been granted with the same delay: d is taken out
// of its TTL, as the slack is.
func WithLockDelay(d time.Duration) SessionOption {
	return optionFunc(func(o *sessionOptions) { o.Delay = d })
}

// WithSlack sets how long the lease outlives the session's local deadline
// (Deadline, Done, Check, the end of Run's context), so that a holder whose
// process is late by up to d when contact is lost (short of CPU at a
// container's quota, slowed by GC) is told it lost its hold before the server
// can free its keys for anyone else. The lease is granted for the TTL plus d
// (plus the lock delay, see WithLockDelay); the local deadline and the
// keepalive pace keep to the TTL, so a slow but working link keeps the
// session as before. The cost is failover: after a crash, the next holder
// takes over up to the TTL plus d after the last acknowledged keepalive,
// rather than the TTL (through etcd's gRPC proxy, which renews a lease
// itself for its granted TTL after the last request it answered, up to
// twice that). Unlock, Resign and Close (a revoke) still hand over at
// once. A process paused outright for longer (SIGSTOP, a frozen VM) is not
// covered by any slack: fencing tokens (Rev, Do) are. The default is the
// larger of 2s and a tenth of the TTL; 0 turns it off; d is rounded up to
// whole seconds, and a negative d makes NewSession return an error wrapping
// ErrInvalidArgument. With WithLease the default is reckoned from the
// adopted lease's granted TTL, and the slack is taken out of that TTL: pass
// the WithSlack the lease was granted with to keep its TTL as it was.
//
// The slack and the lock delay add up: the lease outlives the local deadline
// by both, so the lock delay runs from the latest moment a late holder is
// told.
func WithSlack(d time.Duration) SessionOption {
	return optionFunc(func(o *sessionOptions) { o.Slack, o.SlackOn = d, true })
}

// resolve applies opts over the defaults and checks them.
func resolve(client *clientv3.Client, opts []SessionOption) (sessionOptions, error) {
	o := sessionOptions{TTL: DefaultTTL}
	for _, opt := range opts {
		if opt == nil {
			return o, fmt.Errorf("%w: nil SessionOption", ErrInvalidArgument)
		}
		opt.apply(&o)
	}
	err := o.Resolve(client) // before o is read: a return's operands may be read in any order
	return o, err
}
