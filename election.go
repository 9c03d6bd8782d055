package etcdsync

import (
	"context"
	"errors"
	"fmt"
	"sync"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Election is a leader election on a name. A candidate's key is
// NAME/<lease-hex> with its value, the same key etcd's concurrency.Election,
// etcdctl elect and the server's election API write; the oldest direct child
// of NAME/ leads. It runs on the same acquire step and wait loop as Mutex:
// two Election values on one Session exclude each other like Mutexes. All
// methods are safe for concurrent use.
type Election struct {
	hr          holder
	campaigning chan struct{} // one Campaign at a time on this value

	mu  sync.Mutex
	hdr *pb.ResponseHeader // of the last successful Proclaim, if later than the term's start
}

// NewElection returns an Election on name for session s. It does not touch
// etcd. An invalid name or a nil session is reported by every call that uses
// them (Observe's channel closes at once).
func NewElection(s *Session, name string) *Election {
	return &Election{hr: newHolder(s, name), campaigning: make(chan struct{}, 1)}
}

// ResumeElection returns an Election on name that leads with leaderKey at
// leaderRev, as a process restarted with WithLease resumes its leadership. It
// does not touch etcd: a leadership that is gone shows at the first guarded
// call (Proclaim, Do) or through Done. When leaderKey is not this session's
// key under name, or another value of the session uses that key, the Election
// does not lead and Err says why; Campaign still works.
func ResumeElection(s *Session, name, leaderKey string, leaderRev int64) *Election {
	e := NewElection(s, name)
	if e.hr.bad != nil {
		return e
	}
	if leaderKey != e.hr.slot.key || leaderRev <= 0 {
		e.hr.last = fmt.Errorf("%w: leader key %q at revision %d is not this session's key %q", ErrInvalidArgument, leaderKey, leaderRev, e.hr.slot.key)
		return e
	}
	if err := s.claimKey(context.Background(), leaderKey, false); err != nil {
		e.hr.last = err
		return e
	}
	e.hr.h = newHold(e.hr.slot, leaderRev, &pb.ResponseHeader{Revision: leaderRev})
	return e
}

// Campaign blocks until this candidate leads with val, ctx ends (the error
// wraps ctx.Err()) or the session ends (ErrSessionExpired). A candidate whose
// own key vanishes returns ErrSessionExpired at once. On error no candidate
// key is left behind. On a value that already leads it returns at once after
// proclaiming val; Campaigns on one value run one at a time, so a second one
// started while the first waits proclaims once the first leads. Uncontended,
// it costs one RPC. To withdraw a waiting candidacy, cancel ctx.
func (e *Election) Campaign(ctx context.Context, val string) error {
	if e.hr.bad != nil {
		return e.hr.bad
	}
	if err := ctx.Err(); err != nil { // nothing is sent
		return fmt.Errorf("etcdsync: campaign on %s: %w", e.hr.name, err)
	}
	select {
	case e.campaigning <- struct{}{}:
		defer func() { <-e.campaigning }()
	case <-ctx.Done():
		return fmt.Errorf("etcdsync: campaign on %s: %w", e.hr.name, ctx.Err())
	}
	if e.hr.current() != nil {
		err := e.Proclaim(ctx, val)
		if !errors.Is(err, ErrElectionNotLeader) {
			return err
		}
		// The leadership was gone behind our back: campaign anew.
	}
	old, err := e.hr.take(ctx, val, waitTurn)
	if err != nil {
		return err
	}
	if old != nil && string(old) != val { // a resumed key with another value
		if err := e.Proclaim(ctx, val); err != nil {
			return errors.Join(err, e.hr.abandon())
		}
	}
	return nil
}

// Proclaim sets the leader's value without a new election. It blocks for one
// RPC bounded by ctx. When this value does not lead (or its leadership is
// gone, which then resets its state) it returns an error wrapping
// ErrElectionNotLeader and writes nothing.
func (e *Election) Proclaim(ctx context.Context, val string) error {
	h, err := e.hr.held(ErrElectionNotLeader)
	if err != nil {
		return err
	}
	resp, err := h.do(ctx, clientv3.OpPut(h.key, val, clientv3.WithLease(h.s.Lease())))
	if errors.Is(err, ErrNotHeld) {
		return fmt.Errorf("%w: %w", ErrElectionNotLeader, err)
	}
	if err != nil {
		return err
	}
	e.setHeader(resp.Header)
	return nil
}

// Resign ends the leadership: it deletes the key only at the
// revision it was created, so a retried Resign never deletes a later term.
// It blocks for one RPC bounded by ctx and by the leadership: when that ends
// meanwhile (the session reached its local deadline, the key was deleted) it
// returns at once. It returns nil when not leading (as etcd does); on an RPC
// error the leadership stays and Resign can be retried.
func (e *Election) Resign(ctx context.Context) error {
	if e.hr.bad != nil {
		return e.hr.bad
	}
	h := e.hr.current()
	if h == nil {
		return nil
	}
	err := h.unhold(ctx)
	if errors.Is(err, ErrLockReleased) {
		return nil
	}
	return err
}

// Leader returns the current leader's key and value (one KeyValue), or an
// error wrapping ErrElectionNoLeader. It blocks for one RPC bounded by ctx.
// Only direct children NAME/<hex> are candidates.
func (e *Election) Leader(ctx context.Context) (*clientv3.GetResponse, error) {
	if e.hr.bad != nil {
		return nil, e.hr.bad
	}
	resp, err := e.hr.slot.s.client.Get(ctx, e.hr.slot.prefix, clientv3.WithPrefix(),
		clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
	if err != nil {
		return nil, fmt.Errorf("etcdsync: leader of %s: %w", e.hr.name, err)
	}
	if kv := leaderOf(e.hr.slot.prefix, resp.Kvs); kv != nil {
		resp.Kvs, resp.Count, resp.More = []*mvccpb.KeyValue{kv}, 1, false
		return resp, nil
	}
	return nil, fmt.Errorf("%w: %s", ErrElectionNoLeader, e.hr.name)
}

// leaderOf returns the first direct child of prefix in kvs (sorted by create
// revision), or nil.
func leaderOf(prefix string, kvs []*mvccpb.KeyValue) *mvccpb.KeyValue {
	for _, kv := range kvs {
		if isChild(prefix, string(kv.Key)) {
			return kv
		}
	}
	return nil
}

// Observe returns a channel that delivers the leader current when it starts
// (or, with none, the first one), then each later change of leader or value,
// in revision order. It never reports a candidate that is not the leader, nor
// a key other than a direct child NAME/<hex>. A slow reader may miss
// intermediate values across a re-read (after a leader change or a
// compaction) but always gets the latest. Each response's header carries the
// revision at which its value was current. It needs no lease, so it outlives
// the session. The channel closes when ctx ends; ctx owns the goroutine.
func (e *Election) Observe(ctx context.Context) <-chan *clientv3.GetResponse {
	ch := make(chan *clientv3.GetResponse)
	if e.hr.bad != nil {
		close(ch)
		return ch
	}
	go func() {
		defer close(ch)
		e.observe(ctx, ch)
	}()
	return ch
}

func (e *Election) observe(ctx context.Context, ch chan<- *clientv3.GetResponse) {
	cli, prefix := e.hr.slot.s.client, e.hr.slot.prefix
	var last *mvccpb.KeyValue
	send := func(hdr *pb.ResponseHeader, rev int64, kv *mvccpb.KeyValue) bool {
		if last != nil && string(last.Key) == string(kv.Key) && last.ModRevision == kv.ModRevision {
			return true // delivered already
		}
		h := &pb.ResponseHeader{ClusterId: hdr.ClusterId, MemberId: hdr.MemberId, Revision: rev, RaftTerm: hdr.RaftTerm}
		select {
		case ch <- &clientv3.GetResponse{Header: h, Kvs: []*mvccpb.KeyValue{kv}, Count: 1}:
			last = kv
			return true
		case <-ctx.Done():
			return false
		}
	}
	wctx := clientv3.WithRequireLeader(ctx)
	for ctx.Err() == nil {
		resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix(),
			clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
		if err != nil {
			if cli.Ctx().Err() != nil || sleep(ctx, retryPause) != nil {
				return // the client is closed, or ctx ended
			}
			continue
		}
		from := resp.Header.Revision + 1
		leader := leaderOf(prefix, resp.Kvs)
		if leader == nil {
			// Wait for a candidate's create, then read again: the first
			// create seen need not be the leader.
			if !watchUntil(wctx, cli, prefix, from, true, func(ev *clientv3.Event) bool {
				return ev.IsCreate() && isChild(prefix, string(ev.Kv.Key))
			}) && sleep(ctx, retryPause) != nil {
				return
			}
			continue
		}
		if !send(resp.Header, resp.Header.Revision, leader) {
			return
		}
		// Follow the leader's key: each put is a proclamation; a delete
		// ends the term, and a read finds the next leader.
		if !watchUntil(wctx, cli, string(leader.Key), from, false, func(ev *clientv3.Event) bool {
			if ev.Type == mvccpb.DELETE {
				return true
			}
			return !send(resp.Header, ev.Kv.ModRevision, ev.Kv)
		}) && sleep(ctx, retryPause) != nil {
			return
		}
	}
}

// watchUntil watches key (a prefix with prefix) from revision from until stop
// returns true for an event (then it returns true), or the watch ends (ctx,
// compaction, lost leader: false).
func watchUntil(ctx context.Context, cli *clientv3.Client, key string, from int64, prefix bool, stop func(*clientv3.Event) bool) bool {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	opts := []clientv3.OpOption{clientv3.WithRev(from)}
	if prefix {
		opts = append(opts, clientv3.WithPrefix())
	}
	for wr := range cli.Watch(ctx, key, opts...) {
		if wr.Canceled {
			return false
		}
		for _, ev := range wr.Events {
			if stop(ev) {
				return true
			}
		}
	}
	return false
}

// setHeader records a Proclaim's header; headers only move forward.
func (e *Election) setHeader(hdr *pb.ResponseHeader) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.hdr == nil || hdr.Revision > e.hdr.Revision {
		e.hdr = hdr
	}
}

// Do runs ops in one transaction only while this value leads (its key still
// exists at the term's create revision). It blocks for one RPC bounded by ctx.
// Otherwise it returns an error wrapping ErrNotHeld and resets the state.
func (e *Election) Do(ctx context.Context, ops ...clientv3.Op) (*clientv3.TxnResponse, error) {
	return e.hr.do(ctx, ops...)
}

// Key returns the leader key while leading, else "".
func (e *Election) Key() string { return e.hr.key() }

// Rev returns the term's fencing token: the create revision of the leader
// key, strictly increasing from one leader to the next; 0 when not leading.
func (e *Election) Rev() int64 { return e.hr.rev() }

// Header returns the response header of the last successful Campaign or
// Proclaim of the current term, else nil.
func (e *Election) Header() *pb.ResponseHeader {
	h := e.hr.current()
	if h == nil {
		return nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.hdr != nil && e.hdr.Revision > h.hdr.Revision {
		return e.hdr
	}
	return h.hdr
}

// IsLeader returns a comparison that holds while this value leads, for the
// caller's own transactions; when not leading it is always false.
func (e *Election) IsLeader() clientv3.Cmp { return e.hr.guard() }

// Done returns a channel closed when the leadership ends: Resign committed,
// the session ended, or the key was deleted by anyone. The first call for a
// term starts one watch of its key. When not leading it returns a closed channel.
func (e *Election) Done() <-chan struct{} { return e.hr.done() }

// Err returns nil while leading, else why the last term ended (as Mutex.Err).
func (e *Election) Err() error { return e.hr.err() }
