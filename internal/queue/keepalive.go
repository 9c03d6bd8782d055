package queue

// A session's keepalive (Session.keepAlive): one KeepAliveOnce per beat
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

// keepAlive refreshes the lease until the session ends: each beat is one
// KeepAliveOnce through the client's Lease (so a wrapper, a namespace, an
// in-process client or a proxy sees it), run in a goroutine of its own and
// bounded by the TTL. Beats are paced from their send times, every TTL/3
// whatever the replies do, so on a slow link several may be in flight: while
// the server acknowledges a beat within the TTL of its sending the session
// lives. Each acknowledgement moves the local deadline to its beat's send
// time plus the TTL the server granted, less the slack and the lock delay
// (WithSlack, WithLockDelay);
// a beat knows its own send time, so
// replies may come in any order. The first beat goes at first. keepAlive
// owns the beats' goroutines (joined on return) and the end of the session
// by lost contact or a lease that vanished.
func (s *Session) keepAlive(first time.Time) {
	defer close(s.loop)
	defer s.reportEnd()
	defer s.stopMoving()
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
		deadline := s.Deadline()
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
		case <-s.check:
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
				s.extend(r.sent.Add(time.Duration(r.ttl)*time.Second - s.beyond()))
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
			r := s.beat(bctx)
			select {
			case replies <- r:
			case <-bctx.Done():
			}
		}()
		next = time.Now().Add(pace)
	}
}

// beat sends one keepalive and waits for its reply, bounded by ctx and the
// TTL (a later reply could not extend the deadline).
func (s *Session) beat(ctx context.Context) reply {
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
func (s *Session) extend(d time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if d.After(s.deadline) {
		s.deadline = d
		s.stopMovingLocked()
	}
}

// stopMoving closes the channel DeadlineMoved handed out, if any: the
// session has ended.
func (s *Session) stopMoving() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stopMovingLocked()
}

func (s *Session) stopMovingLocked() {
	if s.moved != nil {
		close(s.moved)
		s.moved = nil
	}
}

// reply is a beat's acknowledgement (its send time and the TTL the server
// granted), or why it failed.
type reply struct {
	sent time.Time
	ttl  int64
	err  error
}

// Deadline returns the session's local deadline: the send time of the last
// acknowledged keepalive plus the TTL. The server cannot expire the lease
// before it.
func (s *Session) Deadline() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.deadline
}

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
func (s *Session) DeadlineMoved() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ctx.Err() != nil {
		return Closed
	}
	if s.moved == nil {
		s.moved = make(chan struct{})
	}
	return s.moved
}
