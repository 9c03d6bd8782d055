package etcdsync

// Following an election's leader without a session (type Observer): one
// read of the direct children of NAME/, then one watch of the prefix.

import (
	"context"
	"errors"
	"fmt"
	"sync"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// Observer follows the leader of an election on a name. It needs no Session
// (no lease), so a process that only watches the leader holds nothing in etcd.
// All methods are safe for concurrent use.
type Observer struct {
	cli    *clientv3.Client
	name   string
	prefix string
	bad    error // why the client or name is unusable, or nil

	mu  sync.Mutex
	err error // why an Observe channel closed before its ctx ended
}

// NewObserver returns an Observer of the election on name. It does not touch
// etcd. A nil client or an invalid name is reported by every call (Observe's
// channel then closes at once and Err says why).
func NewObserver(cli *clientv3.Client, name string) *Observer {
	o := &Observer{cli: cli, name: name, prefix: name + "/"}
	if cli == nil {
		o.bad = fmt.Errorf("%w: nil client", ErrInvalidArgument)
	} else if err := queue.CheckName(name); err != nil {
		o.bad = err
	}
	return o
}

// Leader returns the current leader's key and value (one KeyValue), or an
// error wrapping ErrElectionNoLeader. It blocks for one RPC bounded by ctx.
// Only direct children NAME/<hex> are candidates.
func (o *Observer) Leader(ctx context.Context) (*clientv3.GetResponse, error) {
	if err := o.usable(); err != nil {
		return nil, err
	}
	resp, err := o.read(ctx, 0)
	if err != nil {
		return nil, fmt.Errorf("etcdsync: leader of %s: %w", o.name, err)
	}
	if kv := leaderOf(o.prefix, resp.Kvs); kv != nil {
		resp.Kvs, resp.Count, resp.More = []*mvccpb.KeyValue{kv}, 1, false
		return resp, nil
	}
	return nil, fmt.Errorf("%w: %s", ErrElectionNoLeader, o.name)
}

// usable returns why the observer cannot be used (a bad name or client, or
// a closed client: ErrInvalidArgument), else nil.
func (o *Observer) usable() error {
	switch {
	case o.bad != nil:
		return o.bad
	}
	return queue.ClosedClient(o.cli)
}

// Err returns why an Observe channel closed before its context ended (an
// invalid name or client, a closed client: ErrInvalidArgument), else nil.
func (o *Observer) Err() error {
	if o.bad != nil {
		return o.bad
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.err
}

// Observe returns a channel that delivers the leader current when it starts
// (or, with none, the next one), then each later leader and each value it
// proclaims, in revision order: a reader that keeps up gets every one. A slow
// reader may miss values only across a compaction of the history it needs,
// and always gets the latest. It never reports a candidate that is not the
// leader, nor a key other than a direct child NAME/<hex>. Each response's
// header carries the revision at which its value became current. A term that
// ends with no candidate behind it is silent here, as in etcd's Observe:
// Terms reports it. It does not block; the channel closes when ctx ends (ctx
// owns the goroutine), or early when the client closes (Err says why).
func (o *Observer) Observe(ctx context.Context) <-chan *clientv3.GetResponse {
	ch := make(chan *clientv3.GetResponse)
	deliver(o, ctx, ch, func(hdr *pb.ResponseHeader, t Term) (*clientv3.GetResponse, bool) {
		if t.Leader == nil {
			return nil, false
		}
		h := &pb.ResponseHeader{ClusterId: hdr.ClusterId, MemberId: hdr.MemberId, Revision: t.Rev, RaftTerm: hdr.RaftTerm}
		return &clientv3.GetResponse{Header: h, Kvs: []*mvccpb.KeyValue{t.Leader}, Count: 1}, true
	})
	return ch
}

// Term is the state of an election at revision Rev, where it was first seen
// (the delete that ended the last term, the put of a proclamation, or the
// read that started the stream): Leader is the leader's key with its value at
// Rev, or nil when there is no leader (the last one went with no candidate
// behind it, or none had come).
// A new leader and a value proclaimed by the same leader are each a Term; a
// new term is one whose Leader.CreateRevision differs from the last one's.
type Term struct {
	Rev    int64
	Leader *mvccpb.KeyValue
}

// Terms returns a channel that delivers the election's state when it starts
// (a leader, or no leader), then each change in revision order: a new
// leader, a value the leader proclaims, and "no leader" (Leader nil) when a
// leader goes with no candidate queued behind it. A reader that keeps up gets
// every change; a slow one may miss changes only across a compaction of the
// history it needs, and always gets the latest. It never reports a candidate
// that is not the leader. It does not block; the channel closes when ctx ends
// (ctx owns the goroutine), or early when the client closes (Err says why).
func (o *Observer) Terms(ctx context.Context) <-chan Term {
	ch := make(chan Term)
	deliver(o, ctx, ch, func(_ *pb.ResponseHeader, t Term) (Term, bool) { return t, true })
	return ch
}

// deliver runs o.observe for ctx in a goroutine that owns ch and closes it
// when observe returns; each state goes out as as makes it (one as declines
// is skipped). An unusable observer closes ch at once. Either way Err says
// why ch closed before ctx ended.
func deliver[T any](o *Observer, ctx context.Context, ch chan<- T, as func(*pb.ResponseHeader, Term) (T, bool)) {
	if err := o.usable(); err != nil {
		o.failed(err)
		close(ch)
		return
	}
	go func() {
		defer close(ch)
		err := o.observe(ctx, func(hdr *pb.ResponseHeader, t Term) bool {
			v, ok := as(hdr, t)
			if !ok {
				return true
			}
			select {
			case ch <- v:
				return true
			case <-ctx.Done():
				return false
			}
		})
		if err != nil {
			o.failed(err)
		}
	}()
}

// failed records why a channel closed before its ctx ended.
func (o *Observer) failed(err error) {
	o.mu.Lock()
	o.err = err
	o.mu.Unlock()
}

// observe reads the candidates at a revision, then follows one prefix watch
// from there: with no leader, the first direct child created is the next
// leader; each put of the leader's key is a proclamation; its delete at D
// ends the term, and the read at D says who leads next, or that nobody does.
// A failed watch reads again where it stopped. Each state goes to send once
// (a state read again after a failed watch is not sent twice); a send that
// returns false stops it. It returns nil when ctx ends or send stops it.
func (o *Observer) observe(ctx context.Context, send func(*pb.ResponseHeader, Term) bool) error {
	sent := false
	var last Term
	once := func(hdr *pb.ResponseHeader, t Term) bool {
		if sent && sameState(last, t) {
			return true
		}
		sent, last = true, t
		return send(hdr, t)
	}
	at := int64(0) // the revision to read at next; 0: the current one
	for ctx.Err() == nil {
		resp, err := o.read(ctx, at)
		if errors.Is(err, rpctypes.ErrCompacted) {
			at = 0 // the history is gone: the latest will do
			continue
		}
		if err != nil {
			if err := o.usable(); err != nil {
				return fmt.Errorf("etcdsync: observe %s: %w", o.name, err)
			}
			if queue.Pause(ctx) != nil {
				return nil
			}
			continue
		}
		if at == 0 { // a read at a past revision has the current one in its header
			at = resp.Header.Revision
		}
		leader := leaderOf(o.prefix, resp.Kvs)
		if !once(resp.Header, Term{Rev: at, Leader: leader}) {
			return nil
		}
		if at = o.follow(ctx, at, leader, once); at < 0 {
			// The watch ended (ctx, a lost leader, a member restart):
			// read again where it stopped.
			if at = -at; queue.Pause(ctx) != nil {
				return nil
			}
		}
	}
	return nil
}

// sameState reports whether a and b are the same state read twice: the
// same leader's key at the same value, or no leader (since whichever
// revision: a read after a failed watch finds the same empty election).
func sameState(a, b Term) bool {
	if a.Leader == nil || b.Leader == nil {
		return a.Leader == nil && b.Leader == nil
	}
	return string(a.Leader.Key) == string(b.Leader.Key) && a.Leader.ModRevision == b.Leader.ModRevision
}

// follow watches the prefix from after revision at, where leader was current
// (nil: none yet), and delivers each leader and value. It returns the
// revision of the leader's delete, or -(the revision of the last event it
// was delivered, or at) when the watch ended.
func (o *Observer) follow(ctx context.Context, at int64, leader *mvccpb.KeyValue, send func(*pb.ResponseHeader, Term) bool) int64 {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	seen := at
	for wr := range o.cli.Watch(wctx, o.prefix, clientv3.WithPrefix(), clientv3.WithRev(at+1)) {
		if wr.Canceled {
			break
		}
		for _, ev := range wr.Events {
			key := string(ev.Kv.Key)
			switch {
			case !queue.IsChild(o.prefix, key):
			case leader == nil && ev.IsCreate(), leader != nil && key == string(leader.Key) && ev.Type == mvccpb.PUT:
				leader = ev.Kv
				// A copy, field by field: WatchResponse.Header is a
				// pointer from client v3.7 on, a value before.
				h := &pb.ResponseHeader{ClusterId: wr.Header.ClusterId, MemberId: wr.Header.MemberId, Revision: wr.Header.Revision, RaftTerm: wr.Header.RaftTerm}
				if !send(h, Term{Rev: ev.Kv.ModRevision, Leader: ev.Kv}) {
					return -seen
				}
			case leader != nil && key == string(leader.Key):
				return ev.Kv.ModRevision
			}
			// Only what was delivered counts as seen: a watch that
			// catches up sends the backlog in batches whose header has
			// the store's current revision, not the batch's last.
			seen = max(seen, ev.Kv.ModRevision)
		}
	}
	return -seen
}

// read lists the candidates oldest first, at revision at (0: the current).
func (o *Observer) read(ctx context.Context, at int64) (*clientv3.GetResponse, error) {
	opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend)}
	if at > 0 {
		opts = append(opts, clientv3.WithRev(at))
	}
	return o.cli.Get(ctx, o.prefix, opts...)
}

// leaderOf returns the first direct child of prefix in kvs (sorted by create
// revision), or nil.
func leaderOf(prefix string, kvs []*mvccpb.KeyValue) *mvccpb.KeyValue {
	for _, kv := range kvs {
		if queue.IsChild(prefix, string(kv.Key)) {
			return kv
		}
	}
	return nil
}
