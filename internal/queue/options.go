package queue

// A session's settings (type Options), as the options of etcdsync.NewSession
// make them: their checks and their defaults; and the pause before a
// failed request, keepalive or watch is retried (Pause).

import (
	"context"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Options are a session's settings, as the options of NewSession leave them
// (WithTTL and the others, in its options.go).
type Options struct {
	TTL     time.Duration // 0 means DefaultTTL
	TTLSet  bool
	LeaseID clientv3.LeaseID
	Delay   time.Duration   // WithLockDelay
	Slack   time.Duration   // WithSlack
	SlackOn bool            // WithSlack given; else the default (defaultSlack)
	Ctx     context.Context // nil means the client's context
	Rep     Reports         // WithLogger, WithMetrics (the package etcdsync's metrics.go); nil: none
}

// Resolve checks the options and fills in the defaults that depend on
// others: the TTL, the lock delay and the slack rounded up to whole seconds,
// the default slack, and the client's context.
func (o *Options) Resolve(client *clientv3.Client) error {
	if o.TTLSet && o.LeaseID != clientv3.NoLease {
		return fmt.Errorf("%w: WithTTL and WithLease together (an adopted lease keeps its own TTL)", ErrInvalidArgument)
	}
	if o.TTL < time.Second {
		return fmt.Errorf("%w: TTL %v is below one second", ErrInvalidArgument, o.TTL)
	}
	if o.Delay < 0 {
		return fmt.Errorf("%w: lock delay %v is negative", ErrInvalidArgument, o.Delay)
	}
	if o.Slack < 0 {
		return fmt.Errorf("%w: slack %v is negative", ErrInvalidArgument, o.Slack)
	}
	o.TTL, o.Delay, o.Slack = roundUp(o.TTL), roundUp(o.Delay), roundUp(o.Slack)
	if !o.SlackOn && o.LeaseID == clientv3.NoLease {
		o.Slack = defaultSlack(o.TTL)
	}
	if o.Ctx == nil {
		o.Ctx = client.Ctx()
	}
	return nil
}

// defaultSlack is WithSlack's default for a lease of ttl (beyond any lock
// delay): the larger of 2s and ttl/10, in whole seconds.
func defaultSlack(ttl time.Duration) time.Duration {
	return roundUp(max(2*time.Second, ttl/10))
}

// roundUp rounds d up to whole seconds, as etcd counts leases in seconds.
func roundUp(d time.Duration) time.Duration {
	if rest := d % time.Second; rest > 0 {
		return d - rest + time.Second
	}
	return d
}

// retryPause is the pause between failed keepalives (bounded by TTL/3),
// and before a failed request or a broken watch is retried (Pause).
const retryPause = 500 * time.Millisecond

// Pause waits retryPause, the pause before a failed request or a broken
// watch is retried, or until ctx ends (returning ctx.Err()).
func Pause(ctx context.Context) error { return Sleep(ctx, retryPause) }

// Sleep waits d, or until ctx ends (returning ctx.Err()).
func Sleep(ctx context.Context, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
		return nil
	}
}
