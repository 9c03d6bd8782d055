package etcdsync

// Leader election (type Election): a candidate's key NAME/<lease-hex> with
// its value under the exclusive rule (internal/queue), Campaign, Proclaim,
// Resign, Handover and the leader's Run; Leader and Observe through an
// Observer (observer.go).

import (
	"context"
	"errors"
	"fmt"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// Election is a leader election on a name. A candidate's key is
// NAME/<lease-hex> with its value, the same key etcd's concurrency.Election,
// etcdctl elect and the server's election API write; the oldest direct child
// of NAME/ leads. It runs on the same acquire step and wait loop as Mutex:
// two Election values on one Session exclude each other like Mutexes. All
// methods are safe for concurrent use.
type Election struct {
	hr          queue.Holder
	campaigning chan struct{} // one Campaign at a time on this value
}

// NewElection returns an Election on name for session s. It does not touch
// etcd. An invalid name or a nil session is reported by every call that uses
// them (Observe's channel closes at once).
func NewElection(s *Session, name string) *Election {
	return &Election{hr: queue.NewHolder(s.core(), name, "election", &queue.Exclusive), campaigning: make(chan struct{}, 1)}
}

// ResumeElection returns an Election on name that leads with leaderKey at
// leaderRev, as a process restarted with WithLease resumes its leadership. It
// does not touch etcd: a leadership that is gone shows at the first guarded
// call (Proclaim, Do) or through Done. When another Election of this session
// leads with that key and revision, the two share the leadership (one term,
// two handles, as etcd's election server does for each request): Proclaim,
// Do and Resign through either act on the same term, and after a Resign
// either may Campaign again. When leaderKey is not this session's key under
// name, or a value of the session uses the key otherwise, the Election does
// not lead and Err says why; Campaign still works.
func ResumeElection(s *Session, name, leaderKey string, leaderRev int64) *Election {
	e := NewElection(s, name)
	e.hr.Resume(leaderKey, leaderRev)
	return e
}

// Campaign blocks until this candidate leads with val, ctx ends (the error
// wraps ctx.Err()) or the session ends (ErrSessionExpired; ErrSessionClosed
// once it was closed). A candidate whose own key vanishes returns
// ErrSessionExpired at once. On error no candidate key of this call is left
// behind; a leadership this session resumed from a restarted process
// (WithLease) is kept, also when proclaiming val on it fails (Campaign then
// returns that error while the value leads). On a value that already leads it
// returns at once after proclaiming val; Campaigns on one value run one at a
// time, so a second one started while the first waits proclaims once the first
// leads. Uncontended, it costs one RPC. To withdraw a waiting candidacy,
// cancel ctx.
func (e *Election) Campaign(ctx context.Context, val string) error {
	if e.hr.Bad() != nil {
		return e.hr.Bad()
	}
	if err := ctx.Err(); err != nil { // nothing is sent
		return fmt.Errorf("etcdsync: campaign on %s: %w", e.hr.Name(), err)
	}
	select {
	case e.campaigning <- struct{}{}:
		defer func() { <-e.campaigning }()
	case <-ctx.Done():
		return fmt.Errorf("etcdsync: campaign on %s: %w", e.hr.Name(), ctx.Err())
	}
	if e.hr.Current() != nil {
		err := e.Proclaim(ctx, val)
		if !errors.Is(err, ErrElectionNotLeader) {
			return err
		}
		// The leadership was gone behind our back: campaign anew.
	}
	return e.elect(ctx, val, queue.WaitTurn)
}

// elect is Campaign past its checks (TryCampaign with tryTurn): it waits for
// this value's own term, if any, to end (as a second Lock on a Mutex does),
// then campaigns; a restarted process's key it resumes is proclaimed val.
func (e *Election) elect(ctx context.Context, val string, md queue.Mode) error {
	old, err := e.hr.Acquire(ctx, val, md)
	if err != nil {
		return err
	}
	if old != nil && string(old) != val { // a resumed key with another value
		if err := e.Proclaim(ctx, val); err != nil {
			if h := e.hr.Current(); h != nil && h.Inherited() {
				// A restarted process's leadership (WithLease) is not
				// this call's to end: it goes on with its old value.
				return fmt.Errorf("etcdsync: campaign on %s resumed the leadership, but proclaiming the new value failed: %w", e.hr.Name(), err)
			}
			return queue.WithCleanup(err, e.hr.Abandon())
		}
	}
	return nil
}

// Run campaigns with val (as Campaign, bounded by ctx), calls fn with a
// context that is cancelled the moment the leadership ends (context.Cause
// says why), and resigns after fn returns, bounded by the session's TTL even
// if ctx has ended: a leader-only loop. A panic in fn resigns and goes on. It
// returns Campaign's error, or fn's error joined with the cause when the
// leadership ended before fn returned (fn's error alone when it wraps the
// cause already, as Mutex.Run), and with Resign's error, if any. On a
// value that already leads (by another Run, or Campaign) it waits for that
// term to end, as Mutex.Run does on a held Mutex. Inside fn's context, a Run
// of this session and name with the same val enters the term at once; with
// another val it is an error wrapping ErrInvalidArgument.
func (e *Election) Run(ctx context.Context, val string, fn func(ctx context.Context) error) error {
	if e.hr.Bad() != nil {
		return e.hr.Bad()
	}
	return e.hr.Run(ctx, 1, val, func(ctx context.Context) error { return e.elect(ctx, val, queue.WaitTurn) }, e.Resign, fn)
}

// TryCampaign leads with val only when nobody leads or waits: otherwise
// (also when this value leads) it returns an error wrapping ErrLocked at
// once, in one RPC that writes nothing and leaves no key. When the name has
// only nested keys under it (NAME/x/…), it falls back to one more RPC. ctx
// bounds the call; on error no key of this call is left behind.
func (e *Election) TryCampaign(ctx context.Context, val string) error {
	if e.hr.Bad() != nil {
		return e.hr.Bad()
	}
	return e.elect(ctx, val, queue.TryTurn)
}

// TryRun is Run with TryCampaign: when someone leads or waits it returns an
// error wrapping ErrLocked at once, without running fn.
func (e *Election) TryRun(ctx context.Context, val string, fn func(ctx context.Context) error) error {
	if e.hr.Bad() != nil {
		return e.hr.Bad()
	}
	return e.hr.Run(ctx, 1, val, func(ctx context.Context) error { return e.TryCampaign(ctx, val) }, e.Resign, fn)
}

// Handover steps down so that the next candidate leads at once, for a
// leader asked to stop (a rolling deploy, SIGTERM): it cancels the context of
// each Run under this value's leadership (context.Cause wraps
// ErrLockReleased), waits until their fn has returned and the Run has
// resigned, then resigns if the term still lasts. When it returns nil, the
// term has ended: the oldest queued candidate leads from the resign's
// revision on, or none is queued. A successor never leads while this leader's
// work under Run still runs. Not leading, it returns nil at once. It blocks
// until then, bounded by ctx: when ctx ends first it returns an error
// wrapping ctx.Err(), and a Run that was asked to stop still resigns once its
// fn returns. A Run that gets the term as the Handover begins does not start
// its fn (it returns an error wrapping ErrLockReleased). On a resign error
// the term lasts, no Run under it starts its work, and Handover can be
// retried. Called from inside a Run's fn, it waits for that fn: pass a ctx
// that ends.
func (e *Election) Handover(ctx context.Context) error {
	if e.hr.Bad() != nil {
		return e.hr.Bad()
	}
	h := e.hr.Current()
	if h == nil {
		return nil
	}
	for _, over := range h.StopRuns(fmt.Errorf("%w: %s is handed over", ErrLockReleased, h.Key())) {
		select {
		case <-over:
		case <-ctx.Done():
			return fmt.Errorf("etcdsync: hand over %s: %w", e.hr.Name(), ctx.Err())
		}
	}
	return resign(ctx, h)
}

// Proclaim sets the leader's value without a new election. It blocks for one
// RPC bounded by ctx (two when the value changed since this term's last
// Proclaim: see below). Proclaims of a term run one at a time, and each
// writes only over the value the term's last one left: a Proclaim that failed
// on the client (its ctx ended) but that the server applies late, after a
// newer one, writes nothing, so the newest value stays. When this value does not lead (or its leadership is
// gone, which then resets its state) it returns an error wrapping
// ErrElectionNotLeader and writes nothing.
func (e *Election) Proclaim(ctx context.Context, val string) error {
	h, err := e.hr.Held(ErrElectionNotLeader)
	if err != nil {
		return err
	}
	hdr, err := h.Put(ctx, val)
	if errors.Is(err, ErrNotHeld) {
		return fmt.Errorf("%w: %w", ErrElectionNotLeader, err)
	}
	if err != nil {
		return err
	}
	h.Advance(hdr)
	return nil
}

// Resign ends the leadership: it deletes the key only at the
// revision it was created, so a retried Resign never deletes a later term.
// It blocks for one RPC bounded by ctx and by the leadership: when that ends
// meanwhile (the session reached its local deadline, the key was deleted) it
// returns at once. It returns nil when not leading, also after a term lost
// behind its back (Unlock says ErrLockReleased in that case): etcd's
// Election.Resign does so, and code written for it treats any error from
// Resign as a failure to step down. Err (or Done) tells whether the term
// ended by loss. On an RPC error the leadership stays and Resign can be
// retried.
func (e *Election) Resign(ctx context.Context) error {
	if e.hr.Bad() != nil {
		return e.hr.Bad()
	}
	return resign(ctx, e.hr.Current())
}

// resign ends the term of h (nil: none) as Resign does.
func resign(ctx context.Context, h *queue.Hold) error {
	if h == nil {
		return nil
	}
	if err := h.Unhold(ctx); err != nil && !errors.Is(err, ErrLockReleased) {
		return err
	}
	return nil
}

// Leader returns the current leader's key and value (one KeyValue), or an
// error wrapping ErrElectionNoLeader. It blocks for one RPC bounded by ctx.
// Only direct children NAME/<hex> are candidates. It needs no lease (see
// Observer).
func (e *Election) Leader(ctx context.Context) (*clientv3.GetResponse, error) {
	if e.hr.Bad() != nil {
		return nil, e.hr.Bad()
	}
	return NewObserver(e.hr.Session().Client(), e.hr.Name()).Leader(ctx)
}

// Observe follows the leader as Observer.Observe does; it needs no lease, so
// it outlives the session. With an invalid name the channel closes at once.
func (e *Election) Observe(ctx context.Context) <-chan *clientv3.GetResponse {
	if e.hr.Bad() != nil {
		ch := make(chan *clientv3.GetResponse)
		close(ch)
		return ch
	}
	return NewObserver(e.hr.Session().Client(), e.hr.Name()).Observe(ctx)
}

// Do runs ops in one transaction only while this value leads (its key still
// exists at the term's create revision). It blocks for one RPC bounded by ctx.
// Otherwise it returns an error wrapping ErrNotHeld and resets the state.
func (e *Election) Do(ctx context.Context, ops ...clientv3.Op) (*clientv3.TxnResponse, error) {
	return e.hr.Do(ctx, ops...)
}

// Key returns the leader key while leading, else "".
func (e *Election) Key() string { return e.hr.Key() }

// Rev returns the term's fencing token: the create revision of the leader
// key, strictly increasing from one leader to the next; 0 when not leading.
func (e *Election) Rev() int64 { return e.hr.Rev() }

// Header returns the response header of the last successful Campaign or
// Proclaim of the current term (through any handle that shares it), else nil.
func (e *Election) Header() *pb.ResponseHeader { return e.hr.Header() }

// IsLeader returns a comparison that holds while this value leads, for the
// caller's own transactions; when not leading it is always false.
func (e *Election) IsLeader() clientv3.Cmp { return e.hr.Guard() }

// Check is a health answer for a leader-only service: nil while this value
// leads and the leadership is current, else why not, as Mutex.Check.
func (e *Election) Check() error { return e.hr.Check() }

// Done returns a channel closed when the leadership ends: Resign committed,
// the session ended, or the key was deleted by anyone. The first call for a
// term starts one watch of its key. When not leading it returns a closed channel.
func (e *Election) Done() <-chan struct{} { return e.hr.Done() }

// Err returns nil while leading, else why the last term ended (as Mutex.Err).
func (e *Election) Err() error { return e.hr.Err() }
