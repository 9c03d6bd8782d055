package queue

// A session's start (start, type lease): the lease granted, or adopted
// (WithLease), with the first deadline; the retries while the cluster has
// no leader; what NewSession says when no endpoint answers in time; and
// the check for a closed client.

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/reach"
)

// lease is what a session's start learned of its lease: its ID, the
// session's TTL and slack (see Session), a revision no later than the
// start (startRev), the first local deadline, and when the first
// keepalive is due.
type lease struct {
	id       clientv3.LeaseID
	ttl      time.Duration
	slack    time.Duration
	startRev int64
	deadline time.Time
	first    time.Time
}

// start grants or adopts the lease (o.LeaseID) on cli for a session whose
// context is sctx, and sets the first deadline. The first keepalive is due
// a third of the TTL from now, or at once when an adopted lease has less
// than that left beyond it. Its calls are bounded by the first answer's
// bound (answerBound) and the TTL.
func start(sctx context.Context, cli *clientv3.Client, o Options) (lease, error) {
	bound := min(answerBound(cli), o.TTL)
	ctx, cancel := context.WithTimeoutCause(clientv3.WithRequireLeader(sctx), bound, Tag(fmt.Errorf("%w within %v", errNoAnswer, bound), context.DeadlineExceeded))
	defer cancel()
	l := lease{slack: o.Slack}
	var sent time.Time // of the call that answered: the deadline counts from it
	if o.LeaseID != clientv3.NoLease {
		resp, err := whenLed(ctx, &sent, func() (*clientv3.LeaseTimeToLiveResponse, error) {
			return cli.TimeToLive(ctx, o.LeaseID, clientv3.WithAttachedKeys())
		})
		if err != nil {
			return l, unreachable(sctx, cli, ctx, fmt.Sprintf("adopt lease 0x%x", int64(o.LeaseID)), err)
		}
		if resp.TTL <= 0 {
			return l, Tag(fmt.Errorf("etcdsync: adopt lease 0x%x: not found (expired, revoked, or never granted)", int64(o.LeaseID)), ErrSessionExpired)
		}
		// The server truncates the remaining TTL, so this is never late.
		granted := time.Duration(resp.GrantedTTL) * time.Second
		if !o.SlackOn {
			l.slack = defaultSlack(granted - o.Delay)
		}
		beyond := l.slack + o.Delay
		l.id, l.ttl, l.startRev = o.LeaseID, granted-beyond, resp.Revision
		l.deadline = sent.Add(time.Duration(resp.TTL)*time.Second - beyond)
		if l.ttl < time.Second || !l.deadline.After(sent) {
			return l, Tag(fmt.Errorf("etcdsync: adopt lease 0x%x: %ds left of a %ds TTL, within the slack %v and lock delay %v", int64(o.LeaseID), resp.TTL, resp.GrantedTTL, l.slack, o.Delay), ErrSessionExpired)
		}
		if len(resp.Keys) > 0 {
			// The header of TimeToLive is the serving member's revision,
			// which may lag behind the keys the lease has; a linearizable
			// read's is at least the revision of every create before it.
			get, err := cli.Get(ctx, string(resp.Keys[0]), clientv3.WithCountOnly())
			if err != nil {
				return l, unreachable(sctx, cli, ctx, fmt.Sprintf("adopt lease 0x%x", int64(o.LeaseID)), err)
			}
			l.startRev = max(l.startRev, get.Header.Revision)
		}
	} else {
		beyond := l.slack + o.Delay
		resp, err := whenLed(ctx, &sent, func() (*clientv3.LeaseGrantResponse, error) {
			return cli.Grant(ctx, int64((o.TTL+beyond)/time.Second))
		})
		if err != nil {
			return l, unreachable(sctx, cli, ctx, "grant lease", err)
		}
		l.id, l.ttl, l.startRev = resp.ID, time.Duration(resp.TTL)*time.Second-beyond, resp.Revision
		l.deadline = sent.Add(l.ttl)
	}
	pace := l.ttl / 3
	l.first = earliest(sent.Add(pace), l.deadline.Add(-pace))
	return l, nil
}

// whenLed calls f, and again after leaderPause while it fails because the
// cluster has no leader (an election under way, a member cut off from its
// peers), until ctx ends; *sent is the time of the last call. A grant whose
// reply was lost before a retry leaves a lease with no keys, which expires.
func whenLed[T any](ctx context.Context, sent *time.Time, f func() (T, error)) (T, error) {
	for {
		*sent = time.Now()
		v, err := f()
		if !errors.Is(err, rpctypes.ErrNoLeader) {
			return v, err
		}
		if Sleep(ctx, leaderPause) != nil {
			return v, err
		}
	}
}

// leaderPause is the pause between NewSession's calls while the cluster has
// no leader.
const leaderPause = 100 * time.Millisecond

// unreachable describes a failed first call of a session whose context is
// sctx, bounded by ctx: what failed, the endpoints, and, when no answer came
// in time, what each endpoint does when dialled (refuses, or accepts and
// stays silent): a diagnostic on this failure path only, which dials their
// addresses and sends nothing to etcd (see internal/reach).
func unreachable(sctx context.Context, cli *clientv3.Client, ctx context.Context, what string, err error) error {
	switch {
	case sctx.Err() != nil: // the WithContext context ended, or the client closed
		err = context.Cause(sctx)
	case ctx.Err() != nil && errors.Is(context.Cause(ctx), errNoAnswer) && errors.Is(err, rpctypes.ErrNoLeader):
		return fmt.Errorf("etcdsync: %s (endpoints %s): %w, and %w", what, strings.Join(cli.Endpoints(), ","), err, context.Cause(ctx))
	case ctx.Err() != nil && errors.Is(context.Cause(ctx), errNoAnswer):
		return fmt.Errorf("etcdsync: %s: %w (%s)", what, context.Cause(ctx), reach.Each(cli.Endpoints(), 200*time.Millisecond))
	}
	return fmt.Errorf("etcdsync: %s (endpoints %s): %w", what, strings.Join(cli.Endpoints(), ","), err)
}

// answerBound is how long NewSession waits for its first answer: the
// client's DialTimeout, or defaultAnswerBound when it has none.
func answerBound(cli *clientv3.Client) time.Duration {
	if d := dialTimeout(cli); d > 0 {
		return d
	}
	return defaultAnswerBound
}

// defaultAnswerBound is answerBound for a client with no DialTimeout.
const defaultAnswerBound = 3 * time.Second

// dialTimeout returns cli's Config.DialTimeout, or 0 when it has none or it
// cannot be read. etcd's client keeps its configuration in an unexported
// field (cfg, in every line from 3.5 to 3.7) and has no getter for it;
// reflect reads the field and changes nothing. A client line without it
// gets the default (TestNewSessionGivesUpWithinDialTimeout would fail).
func dialTimeout(cli *clientv3.Client) time.Duration {
	cfg := reflect.ValueOf(cli).Elem().FieldByName("cfg")
	if !cfg.IsValid() || cfg.Kind() != reflect.Struct {
		return 0
	}
	d := cfg.FieldByName("DialTimeout")
	if !d.IsValid() || d.Kind() != reflect.Int64 {
		return 0
	}
	return time.Duration(d.Int())
}

// ClosedClient returns an error wrapping ErrInvalidArgument when cli has
// been closed, else nil: a call on a closed client fails at once and sends
// nothing (etcd's client would retry it, printing warnings, until its
// context ends).
func ClosedClient(cli *clientv3.Client) error {
	if cli.Ctx().Err() != nil {
		return errClientClosed
	}
	return nil
}
