package queue

// A session's start (Session.start): the lease granted, or adopted
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

// start grants or adopts the lease and sets the first deadline. It returns
// when the first keepalive is due: a third of the TTL from now, or at once
// when an adopted lease has less than that left beyond it. Its calls are
// bounded by the first answer's bound (answerBound) and the TTL.
func (s *Session) start(o Options) (time.Time, error) {
	bound := min(answerBound(s.client), o.TTL)
	ctx, cancel := context.WithTimeoutCause(clientv3.WithRequireLeader(s.ctx), bound, Tag(fmt.Errorf("%w within %v", errNoAnswer, bound), context.DeadlineExceeded))
	defer cancel()
	var sent time.Time // of the call that answered: the deadline counts from it
	if o.LeaseID != clientv3.NoLease {
		resp, err := whenLed(ctx, &sent, func() (*clientv3.LeaseTimeToLiveResponse, error) {
			return s.client.TimeToLive(ctx, o.LeaseID, clientv3.WithAttachedKeys())
		})
		if err != nil {
			return sent, s.unreachable(ctx, fmt.Sprintf("adopt lease 0x%x", int64(o.LeaseID)), err)
		}
		if resp.TTL <= 0 {
			return sent, Tag(fmt.Errorf("etcdsync: adopt lease 0x%x: not found (expired, revoked, or never granted)", int64(o.LeaseID)), ErrSessionExpired)
		}
		// The server truncates the remaining TTL, so this is never late.
		granted := time.Duration(resp.GrantedTTL) * time.Second
		if !o.SlackOn {
			s.slack = defaultSlack(granted - o.Delay)
		}
		s.id, s.ttl, s.startRev = o.LeaseID, granted-s.beyond(), resp.Revision
		s.deadline = sent.Add(time.Duration(resp.TTL)*time.Second - s.beyond())
		if s.ttl < time.Second || !s.deadline.After(sent) {
			return sent, Tag(fmt.Errorf("etcdsync: adopt lease 0x%x: %ds left of a %ds TTL, within the slack %v and lock delay %v", int64(o.LeaseID), resp.TTL, resp.GrantedTTL, s.slack, o.Delay), ErrSessionExpired)
		}
		if len(resp.Keys) > 0 {
			// The header of TimeToLive is the serving member's revision,
			// which may lag behind the keys the lease has; a linearizable
			// read's is at least the revision of every create before it.
			get, err := s.client.Get(ctx, string(resp.Keys[0]), clientv3.WithCountOnly())
			if err != nil {
				return sent, s.unreachable(ctx, fmt.Sprintf("adopt lease 0x%x", int64(o.LeaseID)), err)
			}
			s.startRev = max(s.startRev, get.Header.Revision)
		}
	} else {
		resp, err := whenLed(ctx, &sent, func() (*clientv3.LeaseGrantResponse, error) {
			return s.client.Grant(ctx, int64((o.TTL+s.beyond())/time.Second))
		})
		if err != nil {
			return sent, s.unreachable(ctx, "grant lease", err)
		}
		s.id, s.ttl, s.startRev = resp.ID, time.Duration(resp.TTL)*time.Second-s.beyond(), resp.Revision
		s.deadline = sent.Add(s.ttl)
	}
	pace := s.ttl / 3
	return earliest(sent.Add(pace), s.deadline.Add(-pace)), nil
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

// unreachable describes a failed first call: what failed, the endpoints,
// and, when no answer came in time, what each endpoint does when dialled
// (refuses, or accepts and stays silent): a diagnostic on this failure path
// only, which dials their addresses and sends nothing to etcd (see
// internal/reach).
func (s *Session) unreachable(ctx context.Context, what string, err error) error {
	switch {
	case s.ctx.Err() != nil: // the WithContext context ended, or the client closed
		err = context.Cause(s.ctx)
	case ctx.Err() != nil && errors.Is(context.Cause(ctx), errNoAnswer) && errors.Is(err, rpctypes.ErrNoLeader):
		return fmt.Errorf("etcdsync: %s (endpoints %s): %w, and %w", what, strings.Join(s.client.Endpoints(), ","), err, context.Cause(ctx))
	case ctx.Err() != nil && errors.Is(context.Cause(ctx), errNoAnswer):
		return fmt.Errorf("etcdsync: %s: %w (%s)", what, context.Cause(ctx), reach.Each(s.client.Endpoints(), 200*time.Millisecond))
	}
	return fmt.Errorf("etcdsync: %s (endpoints %s): %w", what, strings.Join(s.client.Endpoints(), ","), err)
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
