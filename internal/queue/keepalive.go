package queue

// A session's keepalive (type keepalive, run): one KeepAliveOnce per beat
// through the client's Lease, paced from the beats' send times with more
// than one in flight, and the local deadline each acknowledged beat moves:
// never later than the server's expiry, as a beat's deadline counts from
// its send time.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// keepalive is a session's keepalive loop (run) and the local deadline it
// moves (see Session).
type keepalive struct {
	check chan struct{} // asks the loop for a beat now
	loop  chan struct{} // closed when the loop has returned

	mu       sync.Mutex
	deadline time.Time     // the local deadline
	moved    chan struct{} // closed when deadline next moves or the loop ends (nextMove); nil until asked for
	ended    bool          // the loop ended: nextMove answers Closed
}

func newKeepalive(deadline time.Time) *keepalive {
	return &keepalive{check: make(chan struct{}, 1), loop: make(chan struct{}), deadline: deadline}
}

// run refreshes the lease of s until s ends: each beat is one
// KeepAliveOnce through the client's Lease (so a wrapper, a namespace, an
// in-process client or a proxy sees it), run in a goroutine of its own and
// bounded by the TTL. Beats are paced from their send times, every TTL/3
// whatever the replies do, so on a slow link several may be in flight: while
// the server acknowledges a beat within the TTL of its sending the session
// lives. Each acknowledgement moves the local deadline to its beat's send
// time plus the TTL the server granted, less the slack and the lock delay
// (WithSlack, WithLockDelay); a beat knows its own send time, so replies
// may come in any order. The first beat goes at first. run owns
// the beats' goroutines (joined on return) and the end of s by lost
// contact or a lease that vanished; once s has ended it ends s's holds,
// stops its watch of its parent context and reports the end, and then
// closes k.loop.
func (k *keepalive) run(s *Session, first time.Time) {
	defer close(k.loop)
	defer s.reportEnd()
	defer k.end()
	defer s.finishHolds()
	defer s.unlink()
	pace := s.ttl / 3
	next := first
	replies := make(chan reply)
	bctx, stopBeats := context.WithCancel(clientv3.WithRequireLeader(s.ctx))
	var beats sync.WaitGroup
	defer beats.Wait()
	defer stopBeats()
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		deadline := k.at()
		if late := time.Since(deadline); late >= 0 {
			if s.rep != nil {
				s.rep.ActedLate(s, late)
			}
			s.cancel(fmt.Errorf("%w (%w): no keepalive acknowledged within the TTL (%v) of its sending, seen %v after the deadline; the server may free its keys from %v after it", ErrSessionExpired, ErrLostContact, s.ttl, late.Round(time.Millisecond), s.beyond()))
			return
		}
		due := earliest(next, deadline)
		timer.Reset(time.Until(due))
		select {
		case <-s.ctx.Done():
			return
		case <-k.check:
			next = time.Now() // a hold lost its key: is the lease gone?
			continue
		case r := <-replies:
			switch {
			case errors.Is(r.err, rpctypes.ErrLeaseNotFound):
				s.cancel(fmt.Errorf("%w: lease 0x%x not found (expired or revoked)", ErrSessionExpired, int64(s.id)))
				return
			case r.err != nil: // try again after a pause, unless a beat is due sooner
				if s.rep != nil {
					s.rep.KeepaliveFailed(s, r.err)
				}
				next = earliest(next, time.Now().Add(min(retryPause, pace)))
			default:
				if s.rep != nil {
					s.rep.KeepaliveAcked(s, time.Since(r.sent))
				}
				k.extend(r.sent.Add(time.Duration(r.ttl)*time.Second - s.beyond()))
			}
			continue
		case <-timer.C:
			if s.rep != nil {
				s.rep.ActedLate(s, time.Since(due))
			}
		}
		if time.Now().Before(next) {
			continue
		}
		beats.Add(1)
		go func() {
			defer beats.Done()
			r := beat(bctx, s)
			select {
			case replies <- r:
			case <-bctx.Done():
			}
		}()
		next = time.Now().Add(pace)
	}
}

// beat sends one keepalive of s's lease and waits for its reply, bounded by
// ctx and the TTL (a later reply could not extend the deadline).
func beat(ctx context.Context, s *Session) reply {
	ctx, cancel := context.WithTimeout(ctx, s.ttl)
	defer cancel()
	sent := time.Now()
	resp, err := s.client.KeepAliveOnce(ctx, s.id)
	if err != nil {
		return reply{sent: sent, err: fmt.Errorf("etcdsync: keepalive: %w", err)}
	}
	return reply{sent: sent, ttl: resp.TTL}
}

func earliest(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// extend moves the local deadline to d if that is later.
func (k *keepalive) extend(d time.Time) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if d.After(k.deadline) {
		k.deadline = d
		k.stopMovingLocked()
	}
}

// end closes the channel nextMove handed out, if any, and makes nextMove
// answer Closed from now on: the loop, and the session, have ended.
func (k *keepalive) end() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.ended = true
	k.stopMovingLocked()
}

func (k *keepalive) stopMovingLocked() {
	if k.moved != nil {
		close(k.moved)
		k.moved = nil
	}
}

// reply is a beat's acknowledgement (its send time and the TTL the server
// granted), or why it failed.
type reply struct {
	sent time.Time
	ttl  int64
	err  error
}

// at returns the local deadline.
func (k *keepalive) at() time.Time {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.deadline
}

// nextMove returns a channel that is closed when the local deadline next
// moves, or when the loop ends; once it has ended, one closed already.
func (k *keepalive) nextMove() <-chan struct{} {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.ended {
		return Closed
	}
	if k.moved == nil {
		k.moved = make(chan struct{})
	}
	return k.moved
}
